"""DFlash speculation in the runner: the drafter, its context cache, and its one forward per step.

Context cache in the target's blocks. The drafter's context K / V of a position depend only on the target's hidden
states there (model/models/dflash.py), so, like a draft model's KV (worker/draft_runner.py), they live in cache
tensors of their own (one per drafter layer) addressed by the target's block ids and slots. Each step, after the
target's forward, `run_step` writes the context K / V of every token the target computed, at the slots the target
wrote (the target keeps the chosen layers' outputs in a fixed buffer: models/aux_hidden.py, in the llama-family and
the hybrid decoders alike). So the scheduler's books cover the drafter too: a prefix-cache hit carries its context,
preemption recomputes it, a freed block frees it, and nothing here is per request.

Hybrid targets (Gated DeltaNet layers) need nothing more: their verification's hidden states at each position are
those of the walked recurrent state (worker/hybrid_spec.py), so an accepted draft's context is the one plain decoding
would give; a prefix-cache hit is cut back to a recurrent-state snapshot boundary, and every position before it lies
in cached blocks, whose context was written when they were computed.

Rejected drafts. A verification step computes the known token and every draft, so their context K / V are written
too; but the next block starts right after the accepted tokens and its rows overwrite every slot from there on
before its attention reads, and a drafter forward only reads positions before its block. A rejected token's context
is thus never read: it is overwritten by the next block, then by the target's next computation of that position.

The block (`propose`, before the step's inputs are prepared). For each request the scheduler gave k draft slots
(placeholders), k + 1 rows: its known token at `start`, then k mask tokens, at positions start .. start + k (the
slots the step allocated). Each row is a decode row whose context ends after the block's last position, so every
row sees the context and the whole block (non-causal); the rows' K / V are written at those slots first (the target
overwrites them in this step). Row j + 1's logits (the target's LM head) give draft j: argmax for greedy requests (a
DFlash2 drafter: its candidate selector's path from the known token instead), a draw from the request's processed
distribution q for sampled ones (verified with min(1, p / q): a block's drafts are drawn independently, so draft j's
q does not depend on the drafts before it, and the rule stays exact; a DFlash2 drafter's selector does not take part
there, its path being no draw from q). Nothing waits for the GPU: the drafts go into the step's input ids and
verification on the device (DeviceDrafts).

The block's forward replays a CUDA graph of the drafter (DecodeGraphs over the target's input buffers, like a draft
model's: the block rows are decode rows) when its rows fit the largest graph, else runs eagerly; the context write
and the LM head stay eager (a few launches). Its caches are in --kv-cache-dtype, as the target's: a 27B drafter's
five layers of 8 x 128 K / V take 20 KiB per token in fp16, more than the target's own 16 attention layers (4 x 256)
in fp8, so fp8 halves a large part of a block. With fp8 the layers' scales are the checkpoint's, else
1.0, or the first real step's context under --calculate-kv-scales; keys are not centred (--calculate-key-offsets
leaves the drafter alone).

Tensor parallelism (-tp without -pp): the drafter's layers are split over the ranks as a Qwen3 target's are (each
rank's context cache holds its heads), and every rank runs the block with the target's vocabulary-parallel embedding
and LM head: no whole tables on rank 0, no whole [vocab, hidden] head read by one GPU. Rank 0 alone knows the
scheduler's rows, the rings and the requests' sampling: before the block's first collective it sends the other ranks
the block's inputs (`DFlashBlock`, a pipe message; `follow_propose` lays them out and runs the block and its logits
gather), and each step's context ring slots ride its StepInputs (`follow_run_step` writes that rank's heads' context).
The drafts (argmax, DFlash2's selector, draws) are made on rank 0 from the gathered logits and reach the other ranks
in the step's input ids, as every drafter's do. Under -pp, or with draft_tensor_parallel_size 1, the drafter runs whole
on rank 0 (SpeculativeConfig.drafter_split).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np
import torch

from voltllm.attention.backend import AttentionMetadata
from voltllm.attention.kv_spec import calc_kv_scales, kv_scales_to_calculate
from voltllm.worker.draft_runner import _GraphView
from voltllm.worker.drafter_rings import DrafterRings
from voltllm.host_to_device import to_device, upload
from voltllm.model.forward_context import ForwardContext
from voltllm.sampling.sampler import SamplingRow
from voltllm.worker.aux_features import aux_capacity
from voltllm.worker.device_drafts import PAD_ROW, DeviceDrafts, draft_weights

logger = logging.getLogger("voltllm")


@dataclass
class DFlashBlock:
    """A block forward's rows as rank 0 laid them out (_block_arrays), which the other ranks of a split drafter lay out
    the same way: ids / positions / slots (and the rings' slots) [3 or 4, padded], context lengths [padded], block
    tables [padded, width] (and the rings'), the real rows, the graph's batch size (0: eager) and the draft rows to
    take (`pick`: [kmax + 1, n], the last row each block's first)."""

    longs: np.ndarray
    lens: np.ndarray
    tables: np.ndarray
    ring_tables: Optional[np.ndarray]
    total: int
    graph_rows: int
    pick: np.ndarray


class DFlashRunner(DeviceDrafts):
    """The DFlash drafter beside a ModelRunner, which calls it as it calls a DraftRunner (propose / fill_inputs /
    run_step / verification_drafts / verification_probs in each step's execute_async). Under -tp the other ranks'
    runners hold one too and call follow_propose / follow_run_step."""

    def __init__(self, runner: Any, spec: Any):
        import weakref

        from voltllm.engine.dflash import dflash_params
        from voltllm.worker.runner import select_attention_backend

        self.spec = spec
        self.runner = weakref.proxy(runner)
        mc = runner.config.model
        self.params = dflash_params(spec.draft_hf_config, mc.hf_config, spec.num_speculative_tokens)
        # the group the drafter is split over (every rank runs it), or None: whole here
        self.group = runner.tp if spec.drafter_split(runner.config.parallel) else None
        self.drafter = self._load(runner, spec)
        self.model = self.drafter.body  # what memory profiling and GEMM tuning run
        self.backend = select_attention_backend(runner.config)
        self.dtype = runner.dtype
        self.kv_caches: list[torch.Tensor] = []
        sc = runner.config.scheduler
        # the target's chosen layers' outputs for every token of a step (the runner's input buffers' capacity)
        self.features = runner.model.set_aux_hidden(self.params.target_layer_ids, aux_capacity(sc))
        self._drafts, self._probs, self._prob_rows = None, None, {}
        self.graphs = None  # DecodeGraphs of the drafter's block forward, on the target's input buffers
        # --calculate-kv-scales (fp8 caches): the first real step's context K / V set the drafter's layers' scales;
        # else they stay at the checkpoint's or 1.0
        self.calc_kv_scales_pending = kv_scales_to_calculate(self.drafter.body, runner.config.cache.calculate_kv_scales)
        # sliding-window layers keep each request's last positions in a ring of its own (worker/drafter_rings.py)
        windows = [layer.self_attn.sliding_window for layer in self.drafter.layers]
        self.windowed = [w > 0 for w in windows]
        self.rings = DrafterRings(max(windows), spec.num_speculative_tokens, runner.block_size, sc.max_num_seqs) \
            if any(self.windowed) else None
        self._ring_tables: Optional[torch.Tensor] = None  # the drafter graphs' ring block tables and slots
        self._ring_slots: Optional[torch.Tensor] = None
        self._window_meta: Optional[AttentionMetadata] = None  # an eager block forward's windowed layers' metadata
        self._step_ring_slots: Optional[np.ndarray] = None  # the step's context ring slots (step_ring_slots)

    def _load(self, runner: Any, spec: Any):
        from voltllm.model.models.dflash import DFlashDrafter

        t0 = time.monotonic()
        mc, dtype = runner.config.model, runner.dtype
        with torch.device(runner.device):
            drafter = DFlashDrafter(spec.draft_hf_config, self.params, runner.model, dtype,
                                    mc.max_model_len + self.params.block_size,
                                    runner.full_vocab if self.group is None else None, tp=self.group)
        if mc.load_format == "dummy":
            _dummy_weights(drafter, mc.seed)
        else:
            drafter.load_weights(draft_weights(spec, dtype))
        logger.info("loaded DFlash drafter %s in %.1f s", spec.model, time.monotonic() - t0)
        return drafter.eval()

    # -- KV cache (the block's rows and the context), in the target's KV storage dtype (uint8 for fp8, as vLLM's
    # drafter layers): full-attention layers in the target's blocks, sliding-window ones in per-request rings
    def _layer_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """One drafter layer's K / V bytes per block."""
        return super().kv_block_bytes(block_size, kv_dtype) // len(self.windowed)

    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return self._layer_block_bytes(block_size, kv_dtype) * self.windowed.count(False)

    def fixed_kv_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """The rings' bytes (allocated whatever the block count)."""
        if self.rings is None:
            return 0
        return self._layer_block_bytes(block_size, kv_dtype) * self.rings.num_blocks * self.windowed.count(True)

    def settle_rings(self, budget: int, target_block_bytes: int, most_blocks: int) -> None:
        """Keep the rings only where they leave more blocks (at most most_blocks) than the windowed layers' K / V in
        the blocks would: rings cost --max-num-seqs x C positions whatever the contexts, so many short requests
        are better served by blocks (and prefix-cache hits then need no recomputed window)."""
        if self.rings is None:
            return
        bs, kv_dtype = self.runner.block_size, self.runner.kv_dtype
        layer = self._layer_block_bytes(bs, kv_dtype)
        with_rings = min(most_blocks, max(budget - self.fixed_kv_bytes(bs, kv_dtype), 0)
                         // (target_block_bytes + self.kv_block_bytes(bs, kv_dtype)))
        in_blocks = min(most_blocks, max(budget, 0) // (target_block_bytes + layer * len(self.windowed)))
        kept = with_rings > in_blocks
        if self.group is not None:  # (the ranks' caches must be laid out alike: rings only where every rank gains)
            kept = self.group.min_int(int(kept)) > 0
        logger.info("DFlash drafter: sliding-window layers' K / V %s (%d blocks; %d the other way)",
                    f"in {self.rings.num_rings} rings of {self.rings.capacity} positions" if kept
                    else "in the blocks", max(with_rings, in_blocks), min(with_rings, in_blocks))
        if not kept:
            self.windowed, self.rings = [False] * len(self.windowed), None

    def initialize_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """Every layer's cache: num_blocks blocks, or a sliding-window layer's rings' blocks. (Memory profiling's
        forward takes DeviceDrafts.profile_caches instead, num_blocks for every layer: it runs without the rings'
        metadata, so its windowed layers write at the profile's slots, beyond rings sized for few requests.)"""
        from voltllm.attention.backend import make_kv_cache

        heads, dim = self.model.kv_heads_and_dim
        self.kv_caches = [make_kv_cache(1, self.rings.num_blocks if windowed else num_blocks, block_size, heads, dim,
                                        kv_dtype, self.runner.device)[0] for windowed in self.windowed]

    @property
    def block_kv_caches(self) -> list[torch.Tensor]:
        """The caches addressed by the target's block ids (what moves with a block to the CPU tier)."""
        return [c for c, windowed in zip(self.kv_caches, self.windowed) if not windowed]

    def capture_graphs(self) -> None:
        from voltllm.worker.cuda_graphs import DecodeGraphs

        self._graph_view = _DFlashGraphView(self, self.runner)  # (DecodeGraphs holds it weakly)
        graphs = DecodeGraphs(self._graph_view)
        graphs.capture()
        self.graphs = graphs

    def forget(self, request_ids: list[str]) -> None:
        """Finished, aborted or preempted requests give their rings back (the rest of the context lives in the
        target's blocks)."""
        if self.rings is not None:
            for rid in request_ids:
                self.rings.release(rid)

    def _ring_meta(self, meta: AttentionMetadata, tables: Optional[torch.Tensor], slots: torch.Tensor
                   ) -> AttentionMetadata:
        """The windowed layers' metadata: the step's, with the rings' block tables and slots."""
        return replace(meta, slot_mapping=slots, block_tables=meta.block_tables if tables is None else tables)

    def _ring_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block forward's graphs' ring block tables and slots: persistent, shaped as the input buffers' tables
        and slots the graphs read beside them."""
        if self._ring_tables is None:
            buf = self.runner._ensure_buffers()
            dev = buf.block_tables.device
            self._ring_tables = torch.zeros(buf.block_tables.shape, dtype=torch.int32, device=dev)
            self._ring_slots = torch.full(buf.slot_mapping.shape, -1, dtype=torch.long, device=dev)
        return self._ring_tables, self._ring_slots

    def graph_extra(self, meta: AttentionMetadata, bs: int) -> dict:
        """What a graph of the block forward of `bs` rows adds to its context (DecodeGraphs.context): the windowed
        layers' metadata over the ring buffers."""
        if self.rings is None:
            return {}
        tables, slots = self._ring_buffers()
        return {"window_meta": self._ring_meta(meta, tables[:bs], slots[:bs])}

    # -- per step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_step(self, sched: Any, graph_batch: int, meta: AttentionMetadata) -> None:
        """The context K / V of every token the target's step just computed, at its slots (padding: slot -1)."""
        ring_slots = None
        if self.rings is not None:
            ring_slots = self._step_ring_slots
            if ring_slots is None:
                ring_slots = self._context_ring_slots(sched, meta.slot_mapping.shape[0])
        self._step_ring_slots = None
        self._write_context(meta, ring_slots)

    def step_ring_slots(self, sched: Any, t: int) -> Optional[np.ndarray]:
        """Rank 0 of a split drafter, before the step is sent: its t tokens' context ring slots (None without rings),
        for the other ranks' StepInputs; run_step takes the same."""
        if self.rings is None:
            return None
        self._step_ring_slots = self._context_ring_slots(sched, t)
        return self._step_ring_slots

    @torch.inference_mode()
    def follow_run_step(self, step: Any, meta: AttentionMetadata) -> None:
        """A rank other than 0 of a split drafter: run_step's context write, this rank's heads (ring slots: rank 0's,
        in the StepInputs)."""
        self._write_context(meta, step.draft_ring_slots)

    def _write_context(self, meta: AttentionMetadata, ring_slots: Optional[np.ndarray]) -> None:
        slots = meta.slot_mapping
        t = slots.shape[0]
        positions = self.runner.buffers.positions[:t]
        k, v = self.drafter.context_kv(self.features[:t], positions)
        calibrate, self.calc_kv_scales_pending = self.calc_kv_scales_pending, False
        ring_meta = None
        if ring_slots is not None:
            ring_meta = self._ring_meta(meta, None, upload(torch.from_numpy(ring_slots), slots.device))
        for i, (cache, layer) in enumerate(zip(self.kv_caches, self.drafter.layers)):
            attn = layer.self_attn
            if calibrate:  # the first real step's context sets the fp8 scales (rows past num_tokens: padding)
                n = meta.num_tokens
                calc_kv_scales(attn, k[:n, i], v[:n, i])
            # (fp8 caches: encoded with the layer's scales, which its attention reads the block rows with)
            self.backend.write_kv(k[:, i].contiguous(), v[:, i].contiguous(), cache,
                                  ring_meta if self.windowed[i] else meta, attn.k_scale, attn.v_scale)

    def _context_ring_slots(self, sched: Any, t: int) -> np.ndarray:
        """The step's tokens' ring slots: each request's num_new_tokens tokens in scheduled order, at its positions
        from its start on (as ModelRunner.prepare lays them out, one row per request or per token); padding -1."""
        slots = np.full(t, -1, dtype=np.int64)
        a = 0
        for s in sched.scheduled:
            n = s.num_new_tokens
            slots[a:a + n] = self.rings.slots(self.rings.ring(s.request.request_id), np.arange(s.start, s.start + n))
            a += n
        return slots

    @torch.inference_mode()
    def propose(self, sched: Any) -> None:
        """Fill the step's draft slots (ScheduledRequest.spec_tokens placeholders) from one drafter forward."""
        self._drafts, self._probs = None, None
        rows = [s for s in sched.scheduled if s.spec_tokens]
        self._prob_rows = {s.request.request_id: i for i, s in enumerate(rows)}
        if not rows:
            return
        r, dev = self.runner, self.runner.device
        ks = [len(s.spec_tokens) for s in rows]
        kmax, n = max(ks), len(rows)
        graph = self._block_graph(sum(ks) + n)
        block = self._block_arrays(rows, ks, graph.batch_size if graph else 0)
        if self.group is not None:  # (before the block's first collective: the other ranks run it too)
            r.send_message(("draft", block))
        ids_d, draft_hidden, logits, pick_d = self._run_block(block)
        greedy = [s.request.sampling_params.greedy for s in rows]

        def selected() -> torch.Tensor:  # the deterministic drafts [kmax, n]
            ids = ids_d if ids_d is not None else r.buffers.input_ids
            return self.drafter.select(draft_hidden, logits, ids[pick_d[kmax * n:]])

        if self.spec.draft_sample_method == "greedy" or all(greedy):
            self._drafts = selected()
            return
        tokens, probs = r.sampler.draw_drafts(logits, [
            SamplingRow(s.request.sampling_params, s.request.prompt_token_ids, (), s.request.generator,
                        s.request.num_output_tokens + j) if j < k else PAD_ROW
            for j in range(kmax) for s, k in zip(rows, ks)])
        self._drafts = tokens.view(kmax, n)
        if self.drafter.selector is not None and any(greedy):  # greedy requests' drafts: the selector's path
            self._drafts = torch.where(to_device(greedy, torch.bool, dev)[None, :], selected(), self._drafts)
        if probs is not None:
            self._probs = probs.view(kmax, n, -1)

    @torch.inference_mode()
    def follow_propose(self, block: DFlashBlock) -> None:
        """A rank other than 0 of a split drafter: rank 0's block forward and its logits gather (the drafts are rank
        0's; they come in the step's input ids)."""
        self._run_block(block)

    def _block_graph(self, total: int) -> Any:
        """The graph a block forward of `total` rows replays, or None (eager)."""
        return self.graphs.for_batch(total) if self.graphs is not None else None

    def _run_block(self, block: DFlashBlock) -> tuple:
        """The block forward and the logits of its draft rows (a collective under -tp: every rank calls it): the
        block's input ids on the device (None when a graph read them from the input buffers), the draft rows' hidden
        states and logits ([kmax * n] rows, draft-major), and `pick` on the device."""
        dev = self.runner.device
        total, kn = block.total, block.pick.shape[1] * (block.pick.shape[0] - 1)
        graph = self._block_graph(total)
        if (graph.batch_size if graph is not None else 0) != block.graph_rows:
            raise RuntimeError("tensor-parallel ranks disagree on the DFlash drafter's CUDA graph")
        ids_d, pos_d, meta = self._block_inputs(block, dev)
        if graph is not None:
            hidden = graph.replay()[:total]
        else:
            ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend)
            if self._window_meta is not None:
                ctx.extra["window_meta"] = self._window_meta
            hidden = self.drafter.block_hidden(ids_d, pos_d, ctx)
        pick_d = upload(torch.from_numpy(block.pick.ravel()), dev)
        draft_hidden = hidden[pick_d[:kn]]
        return ids_d, draft_hidden, self.drafter.compute_logits(draft_hidden), pick_d

    def _block_arrays(self, rows: list, ks: list[int], graph_rows: int) -> DFlashBlock:
        """The block rows on the host: for each request its known token and k mask tokens at positions start ..
        start + k (every row seeing the whole block), padded to graph_rows (token 0 at position 0, no slot, one token
        of context) when a graph replays them; and the draft rows: draft j of request i is the block row after its
        known token's + j ([kmax, n]; past its own k: unused), then each block's first row (its known token: where a
        DFlash2 selector's walk starts)."""
        bs = self.runner.block_size
        mask = self.params.mask_token_id
        total = sum(ks) + len(rows)
        width = max(len(s.block_ids) for s in rows)
        padded = max(total, graph_rows)
        longs = np.zeros((3, padded), dtype=np.int64)  # ids, positions, slots
        longs[2, total:] = -1
        lens = np.ones(padded, dtype=np.int32)
        tables = np.zeros((padded, width), dtype=np.int32)
        rings = self.rings
        # the windowed layers' ring slots and block tables (row 4 of longs; a second table)
        longs = np.concatenate([longs, np.full((1, padded), -1, dtype=np.int64)]) if rings else longs
        ring_tables = np.zeros((padded, width), dtype=np.int32) if rings else None
        base, at = [], 0
        for s, k in zip(rows, ks):
            base.append(at)
            p = np.arange(s.start, s.start + k + 1)
            longs[0, at] = s.request.all_token_ids[s.start]
            longs[0, at + 1:at + k + 1] = mask
            longs[1, at:at + k + 1] = p
            longs[2, at:at + k + 1] = np.asarray(s.block_ids, dtype=np.int64)[p // bs] * bs + p % bs
            lens[at:at + k + 1] = s.start + k + 1  # every row sees the whole block
            tables[at:at + k + 1, :len(s.block_ids)] = s.block_array
            if rings:
                ring = rings.ring(s.request.request_id)
                longs[3, at:at + k + 1] = rings.slots(ring, p)
                # (each row reads from its window's start on: the block's first row reaches back furthest)
                ring_tables[at:at + k + 1] = rings.table(ring, width, first=rings.first_block(s.start))
            at += k + 1
        pick = np.array([[base[i] + 1 + min(j, k - 1) for i, k in enumerate(ks)] for j in range(max(ks))] + [base],
                        dtype=np.int64)
        return DFlashBlock(longs, lens, tables, ring_tables, total, graph_rows, pick)

    def _block_inputs(self, block: DFlashBlock, dev: torch.device):
        """The block rows' input ids, positions and attention metadata on the device (one upload of each array).
        A graph's rows go into the runner's input buffers it reads instead (ids, positions and metadata: None)."""
        longs, lens, tables, ring_tables = block.longs, block.lens, block.tables, block.ring_tables
        total, graph_rows, rings = block.total, block.graph_rows, ring_tables is not None
        padded, width = lens.shape[0], tables.shape[1]
        longs_d = upload(torch.from_numpy(longs), dev)
        self._window_meta = None
        if graph_rows:
            buf = self.runner._ensure_buffers()
            buf.select_compact()  # the layout the drafter's graphs read
            ints_d = upload(torch.from_numpy(np.concatenate([lens, tables.ravel()] + (
                [ring_tables.ravel()] if rings else []))), dev)
            buf.input_ids[:padded].copy_(longs_d[0])
            buf.positions[:padded].copy_(longs_d[1])
            buf.slot_mapping[:padded].copy_(longs_d[2])
            buf.seq_lens[:padded].copy_(ints_d[:padded])
            buf.block_tables[:padded, :width].copy_(ints_d[padded:padded * (1 + width)].view(padded, width))
            if rings:
                ring_tables_d, ring_slots_d = self._ring_buffers()
                ring_slots_d[:padded].copy_(longs_d[3])
                ring_tables_d[:padded, :width].copy_(ints_d[padded * (1 + width):].view(padded, width))
            qsl = buf.query_start_loc
            qsl.copy_(torch.arange(qsl.numel(), dtype=qsl.dtype, device=dev))
            return None, None, None
        lens, tables = lens[:total], tables[:total]
        ints_d = upload(torch.from_numpy(np.concatenate([np.arange(total + 1, dtype=np.int32), lens, tables.ravel()]
                                                        + ([ring_tables[:total].ravel()] if rings else []))), dev)
        end = 2 * total + 1 + total * width
        meta = AttentionMetadata(
            num_tokens=total, query_start_loc=ints_d[:total + 1], seq_lens=ints_d[total + 1:2 * total + 1],
            block_tables=ints_d[2 * total + 1:end].view(total, width), slot_mapping=longs_d[2, :total],
            max_query_len=1, max_seq_len=int(lens.max()), query_start_loc_cpu=list(range(total + 1)),
            seq_lens_cpu=lens.tolist())
        if rings:
            self._window_meta = self._ring_meta(meta, ints_d[end:].view(total, width), longs_d[3, :total])
        return longs_d[0, :total], longs_d[1, :total], meta


class _DFlashGraphView(_GraphView):
    """A draft graph view whose windowed layers read the rings' block tables and slots (DFlashRunner's persistent
    buffers) with the step's other metadata."""

    def __init__(self, dflash: DFlashRunner, runner: Any):
        super().__init__(dflash, runner)
        self.dflash = dflash

    def graph_extra(self, meta: AttentionMetadata, bs: int) -> dict:
        return self.dflash.graph_extra(meta, bs)


@torch.no_grad()
def _dummy_weights(drafter: torch.nn.Module, seed: int) -> None:
    """--load-format dummy: random drafter weights (N(0, 0.02), norms at 1), the target's embedding left alone. Each
    tensor draws from its own seed, so the tensors every rank of a split drafter holds whole (fc, the selector) are
    the same on each whatever the shapes of its split ones."""
    gen = torch.Generator(device=drafter.fc.weight.device)
    for i, (name, p) in enumerate(drafter.named_parameters()):
        if "embed_tokens" in name:
            continue
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen.manual_seed(seed + 1 + i))
    drafter.finish_loading()
