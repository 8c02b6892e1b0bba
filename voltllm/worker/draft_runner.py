"""Draft-model speculation in the runner: the draft model, its KV cache, and its proposal steps.

The draft's KV lives in the target's paged blocks: the same block ids, block size and slots, in cache tensors of its
own (one per draft layer). So the scheduler's block bookkeeping covers both: allocation, prefix-cache hits,
preemption and freeing need nothing more, provided the draft computes every token the target computes in the same
step. Each step therefore runs the draft on the target's own step inputs (`run_step`: the same buffers and metadata,
or the draft's decode graph of the same batch size), and before it, for the requests that speculate, K one-token
draft steps (`propose`): the request's known token, then each draft so far, each step's argmax the next draft.

Greedy requests take the draft's argmax (a deterministic draft: the target's greedy comparison keeps its tokens).
Sampled requests draw their drafts from the draft's distribution q, processed with the request's own temperature /
top-k / top-p / min-p / logit_bias, and the verification (Sampler.verify_drafts) accepts a draft d with probability
min(1, p(d) / q(d)) and otherwise samples max(0, p - q): the target's distribution p exactly, with more drafts
accepted than an argmax draft would get (sum of min(p, q) against p(argmax q)).
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import replace
from typing import Any, Optional

import numpy as np
import torch

from voltllm.attention.backend import AttentionMetadata, make_kv_cache
from voltllm.host_to_device import to_device, upload
from voltllm.model.forward_context import ForwardContext
from voltllm.sampling.params import SamplingParams
from voltllm.sampling.sampler import SamplingRow

logger = logging.getLogger("voltllm")

# a request's row in the proposal steps past its own drafts: greedy (no random draw), its token unused
_PAD_ROW = SamplingRow(SamplingParams(temperature=0.0), (), (), None, 0)


class _GraphView:
    """What DecodeGraphs reads of a runner, pointing at the draft (its model, caches and backend; the target's input
    buffers, so a draft graph replays on the same inputs as the target's graph of that batch size)."""

    def __init__(self, draft: "DraftRunner", runner: Any):
        self.config, self.device, self.buffers = runner.config, runner.device, runner.buffers
        self.model, self.kv_caches, self.backend = draft.model, draft.kv_caches, draft.backend
        self.state_cache = None


class DraftRunner:
    def __init__(self, runner: Any, spec: Any):
        from voltllm.worker.runner import select_attention_backend

        self.runner = weakref.proxy(runner)  # (the runner owns this: no cycle)
        self.k = spec.num_speculative_tokens
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
        from voltllm.attention.kv_spec import enable_key_offsets, kv_scales_to_calculate

        cache = runner.config.cache
        self.calc_kv_scales_pending = kv_scales_to_calculate(self.model, cache.calculate_kv_scales)
        self.calc_key_offsets_pending = bool(getattr(cache, "calculate_key_offsets", False))
        if self.calc_key_offsets_pending:
            enable_key_offsets(self.model)

    @staticmethod
    def _load(runner: Any, spec: Any) -> torch.nn.Module:
        """The draft, dense, in the target's dtype (a quantized draft checkpoint is dequantized at load)."""
        from voltllm.model.loader import iter_weights, resolve_model
        from voltllm.model.models.registry import build_model
        from voltllm.worker.runner import init_dummy_weights

        t0 = time.monotonic()
        mc, dtype = runner.config.model, runner.dtype
        with torch.device(runner.device):
            model = build_model(spec.draft_hf_config, dtype, mc.max_model_len)
        if mc.load_format == "dummy":
            init_dummy_weights(model, mc.seed)
        else:
            model.load_weights((n, t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                               for n, t in iter_weights(resolve_model(spec.model), spec.draft_hf_config))
        logger.info("loaded draft model %s in %.1f s", spec.model, time.monotonic() - t0)
        return model.eval()

    # -- KV cache -------------------------------------------------------------------------------
    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        heads, dim = self.model.kv_heads_and_dim
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        return 2 * block_size * heads * dim * elem * self.model.num_attention_layers

    def initialize_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        self.kv_caches = self.profile_caches(num_blocks, block_size, kv_dtype)

    def profile_caches(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> list[torch.Tensor]:
        """Cache tensors of the draft's layers for num_blocks blocks (its KV cache; memory profiling's forward)."""
        heads, dim = self.model.kv_heads_and_dim
        return make_kv_cache(self.model.num_attention_layers, num_blocks, block_size, heads, dim, kv_dtype,
                             self.runner.device)

    def capture_graphs(self) -> None:
        from voltllm.worker.cuda_graphs import DecodeGraphs

        self._graph_view = _GraphView(self, self.runner)
        graphs = DecodeGraphs(self._graph_view)
        graphs.capture()
        self.graphs = graphs

    def _graph(self, batch: int):
        return self.graphs.graphs.get(batch) if self.graphs is not None and batch else None

    # -- per step -------------------------------------------------------------------------------
    def run_step(self, graph_batch: int, meta: AttentionMetadata) -> None:
        """The draft on the step the target has just run (its inputs still in the buffers): the draft's KV for every
        token of the step. graph_batch: the target's decode graph's batch size (0: it ran without one)."""
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
        greedy tokens: pass j feeds each speculating request's token at position start + j (its known token, then
        the draft of pass j - 1) as one decode row and writes its draft KV there. A request with fewer drafts than
        the longest is a padding row (writing nowhere) in the passes past its own. One host sync, at the end."""
        rows = [s for s in sched.scheduled if s.spec_tokens]
        if not rows:
            return
        r = self.runner
        buf = r._ensure_buffers()
        blk, dev = r.block_size, r.device
        n = len(rows)
        ks = [len(s.spec_tokens) for s in rows]
        kmax = max(ks)
        graph = None
        if self.graphs is not None:
            graph = self.graphs.for_batch(n)
        bs = graph.batch_size if graph is not None else n
        width = max(len(s.block_ids) for s in rows)
        # the passes' positions, slots and context lengths ([kmax, bs] each; padding rows: position 0, no slot, one
        # token of context) and the first pass's input ids, uploaded together
        plan = np.zeros((3 * kmax + 1, bs), dtype=np.int64)
        pos, slot, lens, ids0 = plan[:kmax], plan[kmax:2 * kmax], plan[2 * kmax:3 * kmax], plan[3 * kmax]
        slot[:] = -1
        lens[:] = 1
        table = np.zeros((bs, width), dtype=np.int32)
        for i, s in enumerate(rows):
            tokens = s.request.all_token_ids
            assert s.start == len(tokens) - 1, "a draft model proposes for decoding requests"
            ids0[i] = tokens[-1]
            bids = s.block_ids
            table[i, :len(bids)] = s.block_array
            p = np.arange(s.start, s.start + ks[i])
            pos[:ks[i], i] = p
            slot[:ks[i], i] = np.asarray(bids, dtype=np.int64)[p // blk] * blk + p % blk
            lens[:ks[i], i] = p + 1
        plan_d = upload(torch.from_numpy(plan), dev)
        buf.select_compact()  # the layout the draft's graphs read
        buf.block_tables[:bs, :width].copy_(upload(torch.from_numpy(table), dev), non_blocking=True)
        if self._arange is None or self._arange.device != buf.query_start_loc.device:
            self._arange = torch.arange(buf.max_seqs + 1, dtype=torch.int32, device=dev)
        buf.query_start_loc[:bs + 1].copy_(self._arange[:bs + 1])
        ids = plan_d[3 * kmax]
        out = torch.empty(kmax, n, dtype=torch.long, device=dev)
        # sampled requests draw their drafts from the draft's distributions, kept for the verification
        sampled = not all(s.request.sampling_params.greedy for s in rows)
        self._probs, self._prob_rows = None, {s.request.request_id: i for i, s in enumerate(rows)}
        for j in range(kmax):
            buf.input_ids[:bs].copy_(ids)
            buf.positions[:bs].copy_(plan_d[j])
            buf.slot_mapping[:bs].copy_(plan_d[kmax + j])
            buf.seq_lens[:bs].copy_(plan_d[2 * kmax + j])
            if graph is not None:
                hidden = graph.replay()
            else:
                meta = AttentionMetadata(
                    num_tokens=n, query_start_loc=buf.query_start_loc[:n + 1], seq_lens=buf.seq_lens[:n],
                    block_tables=buf.block_tables[:n], slot_mapping=buf.slot_mapping[:n], max_query_len=1,
                    max_seq_len=int(lens[j].max()), query_start_loc_cpu=list(range(n + 1)),
                    seq_lens_cpu=lens[j, :n].tolist())
                hidden = self.model(buf.input_ids[:n], buf.positions[:n],
                                    ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend))
            logits = self.model.compute_logits(hidden[:n])
            if not sampled:
                out[j] = logits.argmax(dim=-1)
            else:
                tokens, probs = r.sampler.draw_drafts(logits, [
                    SamplingRow(s.request.sampling_params, s.request.prompt_token_ids, (), s.request.generator,
                                s.request.num_output_tokens + j) if j < ks[i] else _PAD_ROW
                    for i, s in enumerate(rows)])
                out[j] = tokens
                if probs is not None:  # (None: every request still drafting here is greedy; none reads pass j's q)
                    if self._probs is None:
                        self._probs = probs.new_empty(kmax, n, probs.shape[1])
                    self._probs[j] = probs
            if j + 1 < kmax:
                ids = torch.zeros(bs, dtype=torch.long, device=dev) if bs > n else out[j]
                if bs > n:
                    ids[:n] = out[j]
        drafts = out.t().tolist()
        for i, s in enumerate(rows):
            s.spec_tokens = drafts[i][:ks[i]]

    def verification_probs(self, rows: list) -> tuple[Optional[torch.Tensor], Optional[list[bool]]]:
        """For the runner's verification rows of `rows` ((index, ScheduledRequest), each request's drafts then the
        row after them): the draft distributions the drafts were drawn from and which rows' drafts were drawn
        (Sampler.verify_drafts' draft_probs / drawn); (None, None) when every draft was a greedy one."""
        probs, self._probs = self._probs, None
        if probs is None:
            return None, None
        n, vocab = probs.shape[1], probs.shape[2]
        src, drawn = [], []
        for _, s in rows:
            i, k = self._prob_rows[s.request.request_id], len(s.spec_tokens)
            src += [j * n + i for j in range(k)] + [i]
            drawn += [not s.request.sampling_params.greedy] * k + [False]
        return probs.view(-1, vocab)[to_device(src, torch.long, probs.device)], drawn
