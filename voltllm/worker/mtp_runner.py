"""MTP speculation in the runner: the target's own MTP module (model/models/qwen3_next_mtp.py), its KV cache, its
drafts.

What the MTP's KV at position i needs: the target's hidden state h_i and the next token x_{i+1}. So it is written
once x_{i+1} is known, which for a step's tokens is right after that step's sampling and verification, on the device:
`after_step` (called by the runner after both, in the same stream) runs the module once over every token the step
computed, in the step's own rows, positions and slots (the attention metadata of the target's forward), each row fed
the token after it: the next input id within the step; the next prompt token (host) after a chunk that ends inside
the prompt; the sampled token after a request's last row; and for a verifying request, at each row, the token the
verification emitted there (its draft while accepted, then the correction / bonus). Rows past a request's last
accepted position get wrong inputs: their KV is never read before it is rewritten (every read is causal, and the
request's next step writes its positions from its first one on before reading them). Invariant: after a step, every
position below a request's computed length holds correct MTP KV, so a full block is correct when the scheduler caches
it, and prefix-cache hits, preemption and freeing need nothing here (the KV lives in cache tensors of its own addressed
by the target's block ids, as a draft model's does). No lag, no catch-up.

The same pass leaves, per request, the module's output at its last accepted position in `outs` (a slot
per request): the source of its next step's first draft. `propose` (before the next step's forward) then takes the
LM head of that output as draft 1 and chains K - 1 one-token passes (draft j and the previous output at the position
after), each pass's logits giving the next draft, as vLLM's MTP proposer chains its single layer. The chained passes
write KV at positions the next after_step rewrites. Drafts stay on the device (fill_inputs / verification_drafts);
sampled requests draw them from q (their processed MTP distribution) and are verified with min(1, p/q), like a draft
model's (DeviceDrafts: fill_inputs, verification_drafts / verification_probs).

CUDA graphs (`capture_graphs`, as DFlash's drafter block and a draft model: DecodeGraphs over the target's input
buffers, one graph per decode batch size, its own memory pool). The module's forward is captured with its extra
inputs in fixed buffers of its own: `_ids` (the rows' input ids) and `_hidden` (their hidden inputs); positions,
slots, context lengths, block tables and query start locations are the target's compact input buffers, as its decode
graphs read them. A chained pass replays the graph of the smallest batch size that holds its rows: its rows go into
those buffers (padding rows: token 0 at position 0, slot -1, one token of context: they write nowhere), then the
outputs' first rows are the pass's. The pass over the step replays the graph of exactly the step's rows when the
target's step itself replayed a decode or verification-walks graph (its rows are then decode rows, already in the
buffers, padding rows writing nowhere): only the next tokens and the hidden states are copied in. Otherwise (more
rows than the largest graph, a prompt-form step, --enforce-eager, the CPU) the passes run eagerly. The LM heads and
the draws stay eager (a few launches each).

Tensor parallelism (-tp without -pp): the module is split over the ranks as a target layer is, and every rank runs
every pass, with the target's vocabulary-parallel embedding and LM head (no whole copies of them on rank 0, and no
whole [vocab, hidden] head read by one GPU per draft). Rank 0 alone knows the scheduler's rows and samples: before a
proposal's first collective it sends the other ranks the passes' inputs (`MTPProposal`, a pipe message), and after
each pass but the last it broadcasts the drafts that feed the next one (greedy or drawn); after a step's sampling it
broadcasts the pass's next tokens and the (step row, output slot) pairs kept (`after_step`). The other ranks replay
both (`follow_propose`, `follow_after_step`) in the same order of collectives, so their KV (their heads) and their
output slots equal rank 0's. The EAGLE heads built on this runner split the same way. Under -pp, or with
draft_tensor_parallel_size 1, the module runs whole on rank 0 (SpeculativeConfig.drafter_split).
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
from voltllm.host_to_device import to_device, upload
from voltllm.model.forward_context import ForwardContext
from voltllm.worker.device_drafts import DeviceDrafts

logger = logging.getLogger("voltllm")


@dataclass
class MTPProposal:
    """What the other ranks of a split module need for a proposal's passes: each drafting request's outs row,
    the draft count, the graph batch size of the chained passes (0: eager) and their inputs (_chain_inputs' arrays,
    None for one draft), and the block tables' width."""

    sources: list[int]
    kmax: int
    graph_rows: int
    chain: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]
    width: int


class MTPRunner(DeviceDrafts):
    """The MTP module beside a ModelRunner, which calls it as it calls a DraftRunner (propose / fill_inputs /
    run_step / verification_drafts / verification_probs) and, after the step's sampling, after_step. Under -tp the
    other ranks' runners hold one too and call follow_propose / follow_after_step."""

    def __init__(self, runner: Any, spec: Any):
        from voltllm.worker.runner import select_attention_backend

        self.runner = weakref.proxy(runner)  # (the runner owns this: no cycle)
        self.spec = spec
        # the group the module is split over (every rank runs it), or None: whole here
        self.group = runner.tp if spec.drafter_split(runner.config.parallel) else None
        self.model = self._load(runner)
        self.backend = select_attention_backend(runner.config)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = None
        n = runner.config.scheduler.max_num_seqs
        # per running request: the module's output at its last accepted position (its next first draft), and the
        # positions (first, last) of the step that left it (the accepted one is among them); row n stays zero
        self.outs = torch.zeros(n + 1, runner.model.config.hidden_size, dtype=runner.dtype, device=runner.device)
        self._zero_row = n
        self.slots: dict[str, int] = {}
        self.saved: dict[str, tuple[int, int]] = {}
        self._free = list(range(n - 1, -1, -1))
        self._drafts: Optional[torch.Tensor] = None  # [K, drafting requests] on the device
        self._probs: Optional[torch.Tensor] = None  # [K, drafting requests, vocab]: sampled requests' q
        self._prob_rows: dict[str, int] = {}
        self._verify_ids: Optional[torch.Tensor] = None  # the drafts of the step's verification rows
        # graphs: the view DecodeGraphs captures, its fixed input buffers (graph_view), and the decode graph's batch
        # size of the target's step in flight (run_step; 0: it ran without one)
        self._graph_view: Optional[_MTPGraphView] = None
        self._ids: Optional[torch.Tensor] = None
        self._hidden: Optional[torch.Tensor] = None
        self._step_graph = 0

    def _load(self, runner: Any) -> torch.nn.Module:
        """The MTP module of the target checkpoint, dense, in the target's dtype (this rank's part when split)."""
        from voltllm.distributed.experts import expert_shard, model_num_experts
        from voltllm.model.loader import iter_weights
        from voltllm.model.models.qwen3_next_mtp import HybridMTP, mtp_name
        from voltllm.worker.runner import init_dummy_weights

        t0 = time.monotonic()
        mc, dtype, tp = runner.config.model, runner.dtype, self.group
        with torch.device(runner.device):
            model = HybridMTP(runner.model, dtype, runner.full_vocab if tp is None else None, tp=tp)
        if mc.load_format == "dummy":
            init_dummy_weights(model, mc.seed + 1)
        else:  # (under expert parallelism the other ranks' experts are not read)
            weights = iter_weights(mc.weights_source(), mc.hf_config, only=lambda n: mtp_name(n) is not None,
                                   experts=expert_shard(model_num_experts(mc.hf_config), tp))
            model.load_weights((mtp_name(n), t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                                else t) for n, t in weights)
        logger.info("loaded the MTP module of %s in %.1f s", mc.model, time.monotonic() - t0)
        return model.eval()

    # -- KV cache: DeviceDrafts' (its layers in the target's blocks); graphs -----------------------
    def graph_view(self) -> "_MTPGraphView":
        """What DecodeGraphs (or a CPU stand-in) captures: the module reading its hidden inputs from `_hidden`, on
        the target's input buffers with the ids from `_ids` (made here, once)."""
        if self._graph_view is None:  # (rows: a step's, as decode rows: up to the runner's max_decode_rows)
            n = self.runner.max_decode_rows
            self._ids = torch.zeros(n, dtype=torch.long, device=self.runner.device)
            self._hidden = torch.zeros(n, self.outs.shape[1], dtype=self.outs.dtype, device=self.runner.device)
            self._graph_view = _MTPGraphView(self, self.runner)
        return self._graph_view

    def capture_graphs(self) -> None:
        from voltllm.worker.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.graph_view())  # (it holds the view weakly: self._graph_view keeps it)
        graphs.capture()
        self.graphs = graphs

    # -- per request ----------------------------------------------------------------------------
    def forget(self, request_ids: list[str]) -> None:
        """Finished, aborted or preempted requests give back their output slot (a preempted one is recomputed and
        samples again before it drafts)."""
        for rid in request_ids:
            self.saved.pop(rid, None)
            slot = self.slots.pop(rid, None)
            if slot is not None:
                self._free.append(slot)

    def _slot(self, rid: str) -> int:
        slot = self.slots.get(rid)
        if slot is None:
            if not self._free:
                raise RuntimeError("MTP: more running requests than --max-num-seqs output slots")
            slot = self.slots[rid] = self._free.pop()
        return slot

    # -- drafts ---------------------------------------------------------------------------------
    def _source(self, s: Any) -> int:
        """The outs row of a drafting request's first draft: its slot when its last step left the output at position
        start - 1. Else the zero row, a guard: the scheduler drafts only for running requests, whose last step left
        it; were one to draft without, its drafts would be guesses, verified like any, and nothing else reads them."""
        lo, hi = self.saved.get(s.request.request_id, (1, 0))
        return self.slots[s.request.request_id] if lo <= s.start - 1 <= hi else self._zero_row

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """The draft logits of MTP outputs (the target's LM head)."""
        return self.model.compute_logits(out)

    @torch.inference_mode()
    def propose(self, sched: Any) -> None:
        """Fill the draft slots the scheduler reserved (ScheduledRequest.spec_tokens placeholders): draft 1 from the
        output each drafting request's last step left, drafts 2..k from chained one-token passes."""
        self._drafts = self._probs = self._verify_ids = None
        self.forget(sched.released_ids)
        rows = [s for s in sched.scheduled if s.spec_tokens]
        self._prob_rows = {s.request.request_id: i for i, s in enumerate(rows)}
        if not rows:
            return
        ks = [len(s.spec_tokens) for s in rows]
        kmax, n = max(ks), len(rows)
        graph = self._chain_graph(n, kmax)
        p = MTPProposal([self._source(s) for s in rows], kmax, graph.batch_size if graph is not None else 0,
                        self._chain_inputs(rows, ks, kmax, graph.batch_size if graph is not None else n)
                        if kmax > 1 else None, max(len(s.block_ids) for s in rows))
        if self.group is not None:  # (before the passes' first collective: the other ranks run them too)
            self.runner.send_message(("draft", p))
        self._drafts = self._chain(p, n, self.chain_drawer(rows, ks, kmax))

    @torch.inference_mode()
    def follow_propose(self, p: MTPProposal) -> None:
        """A rank other than 0 of a split module: rank 0's proposal's passes (their drafts come from rank 0)."""
        self._chain(p, len(p.sources), None)

    def _chain_graph(self, n: int, kmax: int) -> Any:
        """The graph the chained passes of n rows replay, or None (eager; a single draft has no pass)."""
        return self.graphs.for_batch(n) if self.graphs is not None and kmax > 1 else None

    def _chain(self, p: MTPProposal, n: int, draw: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]]
               ) -> torch.Tensor:
        """The proposal's drafts [kmax, n]: draft 1 from the LM head of each request's kept output, each later one
        from a chained pass fed the draft before. draw(j, logits, drafts) sets drafts[j] (rank 0); on the other ranks
        of a split module it is None and rank 0's broadcast brings them."""
        dev = self.runner.device
        out = self.outs[to_device(p.sources, torch.long, dev)]
        graph = self._chain_graph(n, p.kmax)
        if (graph.batch_size if graph is not None else 0) != p.graph_rows:
            raise RuntimeError("tensor-parallel ranks disagree on the MTP module's CUDA graph")
        longs_d = ints_d = lens = None
        if p.chain is not None:
            longs, ints, lens = p.chain
            longs_d, ints_d = upload(torch.from_numpy(longs), dev), upload(torch.from_numpy(ints), dev)
            if graph is not None:
                self._graph_inputs(ints_d, graph.batch_size, lens.shape[0], p.width)
        drafts = torch.empty(p.kmax, n, dtype=torch.long, device=dev)
        for j in range(p.kmax):
            if j > 0:
                out = (self._graph_pass(graph, drafts[j - 1], out, j, longs_d, ints_d) if graph is not None
                       else self._pass(drafts[j - 1], out, j, longs_d, ints_d, lens))
            logits = self._logits(out)  # (split: the LM head's gather is a collective every rank joins)
            if draw is not None:
                draw(j, logits, drafts)
            if self.group is not None and j < p.kmax - 1:  # rank 0's draft j feeds pass j + 1 on every rank
                self.group.broadcast_(drafts[j])
        return drafts

    def _chain_inputs(self, rows: list, ks: list[int], kmax: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The chained passes' n rows (pass j = 1..kmax-1, one per drafting request, then padding up to a graph's
        batch size): positions and slots ([kmax-1, 2, n] int64), then the query start locations, each pass's context
        lengths and the block tables (one int32 vector), and the context lengths on the host [kmax-1, n]. Request i's
        row of pass j sits at position start - 1 + j (the module's output at start - 2 + j and draft j); past its own
        drafts, and past the requests, a padding row (position 0, no slot, one token of context)."""
        bs = self.runner.block_size
        width = max(len(s.block_ids) for s in rows)
        longs = np.zeros((kmax - 1, 2, n), dtype=np.int64)
        longs[:, 1] = -1
        lens = np.ones((kmax - 1, n), dtype=np.int32)
        tables = np.zeros((n, width), dtype=np.int32)
        for i, (s, k) in enumerate(zip(rows, ks)):
            tables[i, :len(s.block_ids)] = s.block_array
            mm = s.request.multi_modal  # (a prompt with images: decoding positions are shifted by its M-RoPE delta)
            delta = mm.rope_delta if mm is not None else 0
            for j in range(1, k):
                p = s.start - 1 + j
                longs[j - 1, :, i] = p + delta, s.block_ids[p // bs] * bs + p % bs
                lens[j - 1, i] = p + 1
        ints = np.concatenate([np.arange(n + 1, dtype=np.int32), lens.ravel(), tables.ravel()])
        return longs, ints, lens

    def _pass(self, ids: torch.Tensor, hidden: torch.Tensor, j: int, longs: torch.Tensor, ints: torch.Tensor,
              lens: np.ndarray) -> torch.Tensor:
        """Chained pass j (1..kmax-1) over its one-token rows (_chain_inputs' arrays, on the device: longs, ints;
        on the host: lens)."""
        kmax, n = lens.shape[0] + 1, lens.shape[1]
        at = n + 1 + (j - 1) * n
        meta = AttentionMetadata(
            num_tokens=n, query_start_loc=ints[:n + 1], seq_lens=ints[at:at + n],
            block_tables=ints[n + 1 + (kmax - 1) * n:].view(n, -1), slot_mapping=longs[j - 1, 1], max_query_len=1,
            max_seq_len=int(lens[j - 1].max()), query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=lens[j - 1].tolist())
        ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend)
        return self.model(ids, longs[j - 1, 0], ctx, hidden)

    def _graph_inputs(self, ints: torch.Tensor, bs: int, passes: int, width: int) -> None:
        """Before a proposal's graph passes (bs rows, requests then padding; _chain_inputs' ints on the device): the
        rows' query start locations and block tables into the target's input buffers (the compact layout its graphs
        read), the padding rows' ids zero."""
        buf = self.runner.buffers
        buf.select_compact()
        buf.query_start_loc[:bs + 1].copy_(ints[:bs + 1])
        at = bs + 1 + passes * bs
        buf.block_tables[:bs, :width].copy_(ints[at:].view(bs, width))
        self._ids.zero_()

    def _graph_pass(self, graph: Any, ids: torch.Tensor, hidden: torch.Tensor, j: int, longs: torch.Tensor,
                    ints: torch.Tensor) -> torch.Tensor:
        """Chained pass j as a replay of `graph` (its rows' positions, slots and context lengths into the input
        buffers; the ids and hidden inputs into the module's own), the requests' rows of its output."""
        buf, bs, n = self.runner.buffers, graph.batch_size, ids.shape[0]
        buf.positions[:bs].copy_(longs[j - 1, 0])
        buf.slot_mapping[:bs].copy_(longs[j - 1, 1])
        at = bs + 1 + (j - 1) * bs
        buf.seq_lens[:bs].copy_(ints[at:at + bs])
        self._ids[:n].copy_(ids)
        self._hidden[:n].copy_(hidden)
        return graph.replay()[:n]

    def verification_drafts(self, rows: list) -> Optional[torch.Tensor]:
        """DeviceDrafts.verification_drafts, kept for after_step (the verification's greedy matches)."""
        self._verify_ids = super().verification_drafts(rows)
        return self._verify_ids

    def run_step(self, sched: Any, graph_batch: int, meta: AttentionMetadata) -> None:
        """(Nothing before sampling: the MTP's pass over the step needs the tokens it samples; after_step.) Notes
        the target's graph batch size (0: none), which after_step's graph form needs."""
        self._step_graph = graph_batch

    # -- after the step's sampling --------------------------------------------------------------
    @torch.inference_mode()
    def after_step(self, sched: Any, meta: AttentionMetadata, hidden: torch.Tensor, qsl: list[int],
                   handle: Any) -> None:
        """The MTP's KV for every token of the step just run (its rows in the target's forward: `meta`, `hidden`,
        the runner's input buffers; qsl: each request's span), and each request's output at its last accepted
        position into its slot. handle: the step's StepHandle (its device results: sampled_device,
        spec_device)."""
        buf = self.runner.buffers
        dev = hidden.device
        n = meta.query_start_loc_cpu[-1]  # tokens in rows (a decode graph's padding rows included, writing nowhere)
        nxt = torch.zeros(n, dtype=torch.long, device=dev)
        nxt[:n - 1] = buf.input_ids[1:n]  # within a span, each row's next token is the next input id
        host_dst, host_val, samp_dst, samp_src, ver_dst = [], [], [], [], []
        keep_rows, keep_slots = [], []  # (step row, slot) of each request that did not verify: its last row
        ver = []  # (i, ScheduledRequest) of the verifying requests, in verification-row order
        sampled_at = {rid: j for j, rid in enumerate(handle.sampled_ids)}
        for i, s in enumerate(sched.scheduled):
            last = qsl[i + 1] - 1
            if s.spec_tokens:
                ver_dst += range(qsl[i], qsl[i + 1])
                ver.append((i, s))
                self.saved[s.request.request_id] = (s.start, last - qsl[i] + s.start)
                continue
            if s.samples:
                samp_dst.append(last)
                samp_src.append(sampled_at[s.request.request_id])
            else:  # a chunk that ends inside the prompt: its next token is the prompt's
                host_dst.append(last)
                host_val.append(s.request.all_token_ids[s.start + s.num_new_tokens])
            keep_rows.append(last)  # (after a prompt chunk too: the last prompt token may come with drafts)
            keep_slots.append(self._slot(s.request.request_id))
            self.saved[s.request.request_id] = (s.start + s.num_new_tokens - 1,) * 2
        a, b, v = len(host_dst), len(samp_dst), len(ver_dst)
        idx = to_device(host_dst + samp_dst + ver_dst + host_val + samp_src + keep_rows + keep_slots, torch.long, dev)
        vals = [idx[a + b + v:2 * a + b + v]]
        if b:
            vals.append(handle.sampled_device[idx[2 * a + b + v:2 * a + 2 * b + v]])
        if ver:
            vals.append(self._emitted(handle))
        nxt.index_copy_(0, idx[:a + b + v], torch.cat(vals))
        # the (step row, outs slot) pairs kept: each request's (its last row, or its last accepted one)
        tail = idx[2 * a + 2 * b + v:]
        rows, slots = tail[:len(keep_rows)], tail[len(keep_rows):]
        if ver:
            acc_rows, acc_slots = self._accepted_rows(ver, qsl, handle, dev)
            rows, slots = torch.cat([rows, acc_rows]), torch.cat([slots, acc_slots])
        if self.group is not None:  # the other ranks' pass over the step (follow_after_step: one row per request)
            self.group.broadcast_(torch.cat([nxt, rows, slots]))
        out = self._step_pass(nxt, meta, hidden, n)
        self.outs.index_copy_(0, slots, out[rows])

    @torch.inference_mode()
    def follow_after_step(self, step: Any, meta: AttentionMetadata, hidden: torch.Tensor) -> None:
        """A rank other than 0 of a split module, after the step's logits: rank 0's after_step of the step just run
        (its StepInputs: the request count and the graph), from rank 0's broadcast of the next tokens and the rows
        kept."""
        n, m = meta.query_start_loc_cpu[-1], step.draft_requests
        got = self.group.broadcast_(torch.empty(n + 2 * m, dtype=torch.long, device=hidden.device))
        self._step_graph = step.graph_rows
        out = self._step_pass(got[:n], meta, hidden, n)
        self.outs.index_copy_(0, got[n + m:], out[got[n:n + m]])

    def _step_pass(self, nxt: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor, n: int) -> torch.Tensor:
        """The module over the step's n rows, each fed its next token: a replay of the graph of exactly those rows
        when the target's step replayed one, else eagerly."""
        graph = self._step_graph_for(n)
        self._step_graph = 0
        if graph is not None:  # the step's rows are in the input buffers (decode rows, padding writing nowhere)
            self._ids[:n].copy_(nxt)
            self._hidden[:n].copy_(hidden[:n])
            return graph.replay()[:n]
        if meta.slot_mapping.shape[0] != n:
            meta = replace(meta, slot_mapping=meta.slot_mapping[:n])
        ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend)
        return self.model(nxt, self.runner.buffers.positions[:n], ctx, hidden[:n])

    def _step_graph_for(self, n: int) -> Any:
        """The graph of exactly the step's n rows when the target's step replayed a graph of n rows, else None."""
        if self.graphs is None or self._step_graph != n or not n:
            return None
        graph = self.graphs.for_batch(n)
        return graph if graph is not None and graph.batch_size == n else None

    def _emitted(self, handle: Any) -> torch.Tensor:
        """Per verification row, the token the verification emitted there (valid up to each request's first
        rejected row): greedy, the model's choice (equal to the draft while accepted); sampled, the draft where
        accepted, else the replacement."""
        tokens, accepted = handle.spec_device
        return tokens if accepted is None else torch.where(accepted, self._verify_ids, tokens)

    def _accepted_rows(self, ver: list, qsl: list[int], handle: Any, dev: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """For the verifying requests: the step row of each one's last accepted position (its first row + its
        accepted drafts, counted on the device) and its output slot."""
        tokens, accepted = handle.spec_device
        match = accepted if accepted is not None else tokens == self._verify_ids
        n_drafts = [len(s.spec_tokens) for _, s in ver]
        req_of_row = [r for r, k in enumerate(n_drafts) for _ in range(k + 1)]
        pos = [j for k in n_drafts for j in range(k + 1)]
        flat = to_device(req_of_row + pos + [qsl[i] for i, _ in ver]
                         + [self._slot(s.request.request_id) for _, s in ver], torch.long, dev)
        m, r = len(req_of_row), len(ver)
        req_d, pos_d, first_d, slots_d = flat[:m], flat[m:2 * m], flat[2 * m:2 * m + r], flat[2 * m + r:]
        # accepted drafts = the position of the request's first unmatched row (its last row never matches)
        miss = torch.where(match, torch.full_like(pos_d, m), pos_d)
        acc = torch.full_like(first_d, m).scatter_reduce_(0, req_d, miss, "amin")
        return first_d + acc, slots_d


class _MTPForward(torch.nn.Module):
    """The module as a decode graph captures it (model(ids, positions, ctx)): its hidden inputs from a fixed buffer."""

    def __init__(self, model: torch.nn.Module, hidden: torch.Tensor):
        super().__init__()
        self.mtp, self._hidden_buf = model, [hidden]  # (a list: the buffer is no submodule state)
        self.config = model.config

    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        return self.mtp.kv_heads_and_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.mtp(input_ids, positions, ctx, self._hidden_buf[0][:input_ids.shape[0]])


class _Buffers:
    """The target's input buffers, but the ids: the MTP's own (so after_step leaves the step's ids alone)."""

    def __init__(self, buffers: Any, ids: torch.Tensor):
        self._buffers, self.input_ids = buffers, ids

    def __getattr__(self, name: str) -> Any:  # (the target's attributes follow its layout selection)
        return getattr(self._buffers, name)


class _MTPGraphView:
    """What DecodeGraphs reads of a runner (and tests/graph_stand_ins.py of a drafter), pointing at the MTP."""

    def __init__(self, mtp: MTPRunner, runner: Any):
        self.config, self.device = runner.config, runner.device
        self.buffers = _Buffers(runner.buffers, mtp._ids)
        self.model = _MTPForward(mtp.model, mtp._hidden)
        self.kv_caches, self.backend = mtp.kv_caches, mtp.backend
        self.state_cache = None
        self.runner = self  # (the stand-ins read draft.runner.buffers)
