"""Draft-model speculation in the runner: the draft model, its KV cache, and its proposal steps.

The draft's KV lives in the target's paged blocks: the same block ids, block size and slots, in cache tensors of its
own (one per draft layer). So the scheduler's block bookkeeping covers both: allocation, prefix-cache hits,
preemption and freeing need nothing more, provided the draft computes every token the target computes in the same
step. Each step therefore runs the draft on the target's own step inputs (`run_step`: the same buffers and metadata,
or the draft's decode graph of the same batch size), and before it, for the requests that speculate, K one-token
draft steps (`propose`): the request's known token, then each draft so far, each step's choice the next draft. A
step in which every request drafts leaves `run_step` out; the one token it would add per request (the last draft)
is caught up by the next step's first proposal pass when it was accepted (`lag`). The drafts stay on the device:
they are copied into the step's input ids and read by the verification there, and reach the host with its results.

Greedy requests take the draft's argmax (a deterministic draft: the target's greedy comparison keeps its tokens).
Sampled requests draw their drafts from the draft's distribution q, processed with the request's own temperature /
top-k / top-p / min-p / logit_bias, and the verification (Sampler.verify_drafts) accepts a draft d with probability
min(1, p(d) / q(d)) and otherwise samples max(0, p - q): the target's distribution p exactly, with more drafts
accepted than an argmax draft would get (sum of min(p, q) against p(argmax q)).

Tensor parallelism: the draft runs whole on rank 0 beside its target shard (vLLM's draft_tensor_parallel_size 1,
the default here: a small draft's per-layer all-reduces would cost more than its weights' read), or, with
draft_tensor_parallel_size the target's -tp, split over the ranks as a target is (its own vocabulary-parallel
embedding and LM head; every rank runs every pass). Then rank 0 alone plans: before a proposal's first collective it
sends the other ranks the passes' rows (`DraftPlan`, a pipe message) and after each pass but the last broadcasts the
drafts that feed the next; whether the step's own draft run is left out rides the step (`StepInputs.draft_skip_run`).
The other ranks replay both (`follow_propose`, `follow_run_step`) in the same order of collectives.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np
import torch

from voltllm.attention.backend import AttentionMetadata
from voltllm.host_to_device import upload
from voltllm.model.forward_context import ForwardContext
from voltllm.worker.device_drafts import DeviceDrafts, draft_weights

logger = logging.getLogger("voltllm")


class _GraphView:
    """What DecodeGraphs reads of a runner, pointing at the draft (its model, caches and backend; the target's input
    buffers, so a draft graph replays on the same inputs as the target's graph of that batch size)."""

    def __init__(self, draft: "DraftRunner", runner: Any):
        self.config, self.device, self.buffers = runner.config, runner.device, runner.buffers
        self.model, self.kv_caches, self.backend = draft.model, draft.kv_caches, draft.backend
        self.state_cache = None


@dataclass
class DraftPlan:
    """A proposal's passes as rank 0 planned them (_plan), which the other ranks of a split draft replay: every pass's
    positions, slots and context lengths, pass 0's input ids and its drafting rows (`plan`, one int64 vector), the
    block tables (pass 0's, then the later passes' when pass 0 had catch-up rows), the row counts (pass 0's, the
    drafting requests', the catch-up rows'), the passes, the graphs' batch sizes (or the row counts: eager), the
    tables' width, and the context lengths per pass on the host."""

    plan: np.ndarray
    tables: np.ndarray
    n_first: int
    n: int
    n_catch: int
    kmax: int
    bs0: int
    bsn: int
    width: int
    lens: list[np.ndarray]


class DraftRunner(DeviceDrafts):
    """The draft model beside a ModelRunner (which owns it and calls propose / fill_inputs / run_step /
    verification_drafts / verification_probs in each step's execute_async; the last three: DeviceDrafts). A split
    draft's other ranks call follow_propose / follow_run_step."""

    def __init__(self, runner: Any, spec: Any):
        from voltllm.worker.runner import select_attention_backend

        self.runner = weakref.proxy(runner)  # (the runner owns this: no cycle)
        self.spec = spec
        # the group the draft is split over (every rank runs it), or None: whole here, on rank 0
        self.group = runner.tp if spec.drafter_split(runner.config.parallel) else None
        self.model = self._load(runner, spec)
        # its own backend: a backend's split-KV scratch may grow for another model's heads, and graphs keep pointers
        self.backend = select_attention_backend(runner.config)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = None  # DecodeGraphs of the draft, on the target's input buffers
        self._graph_view: Optional[_GraphView] = None
        self._arange: Optional[torch.Tensor] = None  # query start locations of one-token rows, on the device
        # the last proposal's draft distributions [passes, requests, vocab] (sampled requests), and each request's
        # index in them
        self._probs: Optional[torch.Tensor] = None
        self._prob_rows: dict[str, int] = {}
        # requests whose last draft of a step without the draft's run beside it has no draft KV yet: request id ->
        # that position (caught up by the next proposal's first pass if the draft was accepted)
        self.lag: dict[str, int] = {}
        self._skip_run = False  # this step's draft run can be left out (propose decides)
        self._drafts: Optional[torch.Tensor] = None  # the last proposal's drafts [passes, requests], on the device
        from voltllm.attention.kv_spec import enable_key_offsets, kv_scales_to_calculate

        cache = runner.config.cache
        self.calc_kv_scales_pending = kv_scales_to_calculate(self.model, cache.calculate_kv_scales)
        self.calc_key_offsets_pending = bool(getattr(cache, "calculate_key_offsets", False))
        if self.calc_key_offsets_pending:
            enable_key_offsets(self.model)

    def _load(self, runner: Any, spec: Any) -> torch.nn.Module:
        """The draft, dense, in the target's dtype (a quantized draft checkpoint is dequantized at load; split: this
        rank's part)."""
        from voltllm.model.models.registry import build_model
        from voltllm.worker.runner import init_dummy_weights

        t0 = time.monotonic()
        mc, dtype = runner.config.model, runner.dtype
        with torch.device(runner.device):
            model = build_model(spec.draft_hf_config, dtype, mc.max_model_len, tp=self.group)
        if mc.load_format == "dummy":
            init_dummy_weights(model, mc.seed)
        else:
            model.load_weights(draft_weights(spec, dtype))
        logger.info("loaded draft model %s in %.1f s", spec.model, time.monotonic() - t0)
        return model.eval()

    # -- KV cache: DeviceDrafts' (its layers in the target's blocks); graphs -----------------------
    def capture_graphs(self) -> None:
        from voltllm.worker.cuda_graphs import DecodeGraphs

        self._graph_view = _GraphView(self, self.runner)
        graphs = DecodeGraphs(self._graph_view)
        graphs.capture()
        self.graphs = graphs

    def _graph(self, batch: int):
        return self.graphs.graphs.get(batch) if self.graphs is not None and batch else None

    # -- per step -------------------------------------------------------------------------------
    def forget(self, request_ids: list[str]) -> None:
        """Finished, aborted or preempted requests: no catch-up owed to them (a preempted one is recomputed whole)."""
        for rid in request_ids:
            self.lag.pop(rid, None)

    def run_step(self, sched: Any, graph_batch: int, meta: AttentionMetadata) -> None:
        """The draft on the step the target has just run (its inputs still in the buffers): the draft's KV for every
        token of the step. graph_batch: the target's decode graph's batch size (0: it ran without one). Left out
        when every request of the step drafted: the proposal passes wrote all their tokens' draft KV but each one's
        last draft, which the next step's first pass computes if it was accepted (self.lag)."""
        if self._skip_run:
            for s in sched.scheduled:
                self.lag[s.request.request_id] = s.start + len(s.spec_tokens)
            return
        self._run_on_step(graph_batch, meta)

    @property
    def skips_run(self) -> bool:
        """Whether this step's run_step is left out (propose decided): the other ranks of a split draft follow it."""
        return self._skip_run

    @torch.inference_mode()
    def follow_run_step(self, step: Any, meta: AttentionMetadata) -> None:
        """A rank other than 0 of a split draft: run_step's forward over the step (unless rank 0 left it out)."""
        if not step.draft_skip_run:
            self._run_on_step(step.graph_rows, meta)

    def _run_on_step(self, graph_batch: int, meta: AttentionMetadata) -> None:
        graph = self._graph(graph_batch)
        if graph is not None:
            graph.replay()
            return
        buf = self.runner.buffers
        n = meta.query_start_loc_cpu[-1]  # tokens in rows (a prompt graph's padding tokens are in none)
        if meta.slot_mapping.shape[0] != n:
            meta = replace(meta, slot_mapping=meta.slot_mapping[:n])
        ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend,
                             calc_kv_scales=self.calc_kv_scales_pending,
                             calc_key_offsets=self.calc_key_offsets_pending)
        self.calc_kv_scales_pending = self.calc_key_offsets_pending = False
        self.model(buf.input_ids[:n], buf.positions[:n], ctx)

    @torch.inference_mode()
    def propose(self, sched: Any) -> None:
        """Fill the draft slots the scheduler reserved (ScheduledRequest.spec_tokens placeholders) with the draft's
        tokens. Pass j feeds each drafting request's token at position start + j (its known token, then the draft of
        pass j - 1) as one decode row and writes its draft KV there; a request with fewer drafts than the longest is
        a padding row (writing nowhere) in the passes past its own. Pass 0 also catches up on the draft KV a
        request still owes (its last draft of a step whose draft run was left out, accepted): one more row of that
        request, before its known token's. Nothing waits for the GPU: the drafts go to the step's input ids and
        verification on the device (fill_inputs, verification_drafts), to the host with the step's results."""
        self._probs, self._drafts, self._skip_run = None, None, False
        self.forget(sched.released_ids)
        rows = [s for s in sched.scheduled if s.spec_tokens]
        catch_up = []
        for s in sched.scheduled:
            at = self.lag.pop(s.request.request_id, None)
            if at is not None and at < s.start:  # (at >= start: the step recomputes it anyway)
                catch_up.append((s, at))
        self._skip_run = bool(rows) and len(rows) == len(sched.scheduled)
        self._prob_rows = {s.request.request_id: i for i, s in enumerate(rows)}
        buf = self.runner._ensure_buffers()
        if len(catch_up) + len(rows) > buf.max_seqs:  # pass 0 would outgrow the decode rows: catch up on its own
            self._passes(catch_up, [])
            catch_up = []
        if rows or catch_up:
            self._passes(catch_up, rows)

    def _passes(self, catch_up: list, rows: list) -> None:
        """propose's passes: catch_up (scheduled request, position) rows and the drafting requests' `rows`."""
        ks = [len(s.spec_tokens) for s in rows]
        plan = self._plan(catch_up, rows, ks)
        if self.group is not None:  # (before the passes' first collective: the other ranks run them too)
            self.runner.send_message(("draft", plan))
        out = self._run_plan(plan, self.chain_drawer(rows, ks, plan.kmax))
        if out is not None:
            self._drafts = out

    @torch.inference_mode()
    def follow_propose(self, plan: DraftPlan) -> None:
        """A rank other than 0 of a split draft: rank 0's proposal passes (their drafts come from rank 0)."""
        self._run_plan(plan, None)

    def _plan(self, catch_up: list, rows: list, ks: list[int]) -> DraftPlan:
        """The passes' rows on the host: every pass's positions, slots and context lengths, pass 0's input ids and the
        rows of its drafting requests, and the block tables (uploaded once, two copies)."""
        n = len(rows)
        kmax = max(ks, default=1)
        first = catch_up + [(s, s.start) for s in rows]  # pass 0's rows: (scheduled request, position)
        g0 = self._for_batch(len(first))
        gn = self._for_batch(n) if kmax > 1 else None
        bs0 = g0.batch_size if g0 is not None else len(first)
        bsn = gn.batch_size if gn is not None else n
        width = max(len(s.block_ids) for s, _ in first)
        p0 = self._pass_arrays(first, bs0, width)
        later = [self._pass_arrays([(s, s.start + j) if j < k else None for s, k in zip(rows, ks)], bsn, width)
                 for j in range(1, kmax)]
        ids0 = np.zeros(bs0, dtype=np.int64)
        ids0[:len(first)] = [s.request.all_token_ids[at] for s, at in first]
        known = np.arange(len(catch_up), len(first), dtype=np.int64)
        plan = np.concatenate([p0[0].ravel(), ids0, known] + [a[0].ravel() for a in later])
        tables = np.concatenate([p0[1].ravel()] + ([later[0][1].ravel()] if later and catch_up else []))
        return DraftPlan(plan, tables, len(first), n, len(catch_up), kmax, bs0, bsn, width,
                         [p0[0][2]] + [a[0][2] for a in later])

    def _run_plan(self, p: DraftPlan, draw: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]]
                  ) -> Optional[torch.Tensor]:
        """The planned passes; the drafts [kmax, n] (None when only catching up). draw(j, logits, out) sets out[j]
        (rank 0); on the other ranks of a split draft it is None and rank 0's broadcast brings them."""
        r = self.runner
        buf = r._ensure_buffers()
        dev = r.device
        n, kmax, bs0, bsn, width = p.n, p.kmax, p.bs0, p.bsn, p.width
        g0 = self._for_batch(p.n_first)
        gn = self._for_batch(n) if kmax > 1 else None
        if (g0.batch_size if g0 is not None else p.n_first, gn.batch_size if gn is not None else n) != (bs0, bsn):
            raise RuntimeError("tensor-parallel ranks disagree on the draft model's CUDA graphs")
        plan_d, tables_d = upload(torch.from_numpy(p.plan), dev), upload(torch.from_numpy(p.tables), dev)
        buf.select_compact()  # the layout the draft's graphs read
        if self._arange is None:
            self._arange = torch.arange(buf.max_seqs + 1, dtype=torch.int32, device=dev)
        buf.query_start_loc.copy_(self._arange[:buf.query_start_loc.numel()])
        buf.block_tables[:bs0, :width].copy_(tables_d[:bs0 * width].view(bs0, width))
        at = 3 * bs0
        hidden = self._pass(g0, p.n_first, bs0, plan_d[:at], plan_d[at:at + bs0], p.lens[0])
        at += bs0
        known_d, at = plan_d[at:at + n], at + n
        if p.n_catch and kmax > 1:  # the later passes' rows are the drafting requests alone
            buf.block_tables[:bsn, :width].copy_(tables_d[bs0 * width:].view(bsn, width))
        out = torch.empty(kmax, n, dtype=torch.long, device=dev)
        for j in range(kmax):
            if j > 0:
                ids = out[j - 1]
                if bsn > n:
                    ids = torch.cat([ids, ids.new_zeros(bsn - n)])
                hidden = self._pass(gn, n, bsn, plan_d[at:at + 3 * bsn], ids, p.lens[j])
                at += 3 * bsn
            if n == 0:
                return None  # catch-up only: nothing drafts this step
            h = hidden if j > 0 or not p.n_catch else hidden[known_d]
            logits = self.model.compute_logits(h)  # (split: the LM head's gather is a collective every rank joins)
            if draw is not None:
                draw(j, logits, out)
            if self.group is not None and j < kmax - 1:  # rank 0's draft j feeds pass j + 1 on every rank
                self.group.broadcast_(out[j])
        return out

    def _for_batch(self, n: int):
        return self.graphs.for_batch(n) if self.graphs is not None and n else None

    def _pass_arrays(self, entries: list, bs: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """One pass's rows as decode rows, padded to bs: [positions, slots, context lengths] ([3, bs] int64; a None
        entry and the padding rows: position 0, no slot, one token of context) and the block tables ([bs, width]
        int32). entries: (scheduled request, position) or None."""
        blk = self.runner.block_size
        arr = np.zeros((3, bs), dtype=np.int64)
        arr[1] = -1
        arr[2] = 1
        table = np.zeros((bs, width), dtype=np.int32)
        for i, e in enumerate(entries):
            if e is None:
                continue
            s, p = e
            table[i, :len(s.block_ids)] = s.block_array
            arr[0, i], arr[1, i], arr[2, i] = p, s.block_ids[p // blk] * blk + p % blk, p + 1
        return arr, table

    def _pass(self, graph, rows: int, bs: int, arrays: torch.Tensor, ids: torch.Tensor,
              lens: np.ndarray) -> torch.Tensor:
        """One proposal pass over `rows` decode rows (bs with a graph's padding): arrays = its positions, slots and
        context lengths ([3 * bs] on the device), ids its input ids; the block tables are in place. Returns the
        rows' hidden states."""
        buf = self.runner.buffers
        buf.input_ids[:bs].copy_(ids)
        buf.positions[:bs].copy_(arrays[:bs])
        buf.slot_mapping[:bs].copy_(arrays[bs:2 * bs])
        buf.seq_lens[:bs].copy_(arrays[2 * bs:])
        if graph is not None:
            return graph.replay()[:rows]
        meta = AttentionMetadata(
            num_tokens=rows, query_start_loc=buf.query_start_loc[:rows + 1], seq_lens=buf.seq_lens[:rows],
            block_tables=buf.block_tables[:rows], slot_mapping=buf.slot_mapping[:rows], max_query_len=1,
            max_seq_len=int(lens[:rows].max()), query_start_loc_cpu=list(range(rows + 1)),
            seq_lens_cpu=lens[:rows].tolist())
        return self.model(buf.input_ids[:rows], buf.positions[:rows],
                          ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend))
