"""CUDA graphs for decode batches: one graph per bucketed batch size, replayed on padded inputs.

Each graph runs the whole model forward (all layers, attention included) on the runner's persistent
input buffers and writes the final hidden states to a static output; logits and sampling stay eager
(they are two kernels, and the logits of big vocabularies would cost a static buffer per bucket).
The attention metadata is captured with max_seq_len = --max-model-len, so split-KV grids fit any
context the engine can hold.

Hybrid models (Gated DeltaNet layers) read their recurrent-state slots from buffers.state_slots, a device
tensor the runner fills before each replay (padding rows: the state cache's scratch slot); whether a row
resumes a state is derived on the device from seq_lens. The runner does the host-side slot work a replay
skips: allocation and release, snapshot restores before and saves after, StateCache.note_step.
A hybrid with speculation also captures a second set, `walks=True`: a verification step as decode rows, whose GDN
layers walk each request's rows in order from buffers.state_walks (voltllm.model.layers.gdn_verify).
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from voltllm.attention.backend import AttentionMetadata
from voltllm.model.forward_context import ForwardContext


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off while CUDA graphs are captured. A collection in the middle of a capture
    may destroy a dead engine's graphs (engines hold reference cycles), and destroying a graph invalidates the capture
    in progress; torch.cuda.graph no longer collects before it captures. Callers collect at a safe point instead."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# most rows a decode-form CUDA graph captures
GRAPH_ROWS_LIMIT = 512


def replay_median_ms(step, device: torch.device, replays: int = 3) -> float:
    """Median ms of one replay of step() captured into a CUDA graph (after one eager call, which also compiles), on
    a stream of `device`, with Python's cyclic GC paused during the capture: start-up timings and micro benchmarks."""
    step()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, stream=torch.cuda.Stream(device=device)):
        step()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def decode_graph_rows(config) -> int:
    """Rows a decode-form step may have: the compact input buffers' capacity and the graphs' largest batch. One per
    running request; with speculation every request's K + 1 tokens as decode rows (a verification; DFlash's drafter
    block and MTP's pass over the step have as many), within the step's token budget and GRAPH_ROWS_LIMIT. (Sized by
    --max-num-seqs alone, a hybrid target, whose K state checkpoints per slot keep --max-num-seqs small, ran the
    verifications of more than --max-num-seqs / (K + 1) requests eagerly: 27B shape, K = 15, 4 requests 105.7 ms a
    round, 6.6x its plain step.)"""
    sc, spec = config.scheduler, config.speculative
    if spec is None:
        return sc.max_num_seqs
    per_request = spec.num_speculative_tokens + 1
    return max(sc.max_num_seqs, min(sc.max_num_seqs * per_request, sc.max_num_batched_tokens, GRAPH_ROWS_LIMIT))


def graph_batch_sizes(max_num_seqs: int, limit: int = GRAPH_ROWS_LIMIT) -> list[int]:
    top = min(max_num_seqs, limit)
    sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def decode_capture_sizes(rows: int, graphs) -> list[int]:
    """The batch sizes a decode-graph set of up to `rows` rows captures, as DeviceConfig.cuda_graphs asks
    (voltllm.cuda_graph_config): its cudagraph_capture_sizes that fit the rows, else graph_batch_sizes up to its
    max_cudagraph_capture_size (default GRAPH_ROWS_LIMIT). A batch above the largest runs eagerly."""
    if graphs.capture_sizes is not None:
        return [s for s in graphs.capture_sizes if s <= rows]
    return graph_batch_sizes(rows, graphs.max_capture_size or GRAPH_ROWS_LIMIT)


@dataclass
class CapturedGraph:
    batch_size: int
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.hidden


class DecodeGraphs:
    def __init__(self, runner, walks: bool = False, rows: Optional[int] = None):
        """walks: the hybrid verification set (the GDN layers read buffers.state_walks). rows: the largest batch
        (None: the input buffers' row capacity, decode_graph_rows)."""
        self.runner = weakref.proxy(runner)  # (no cycle: a dropped engine frees its graphs at once)
        self.walks = walks
        self.sizes = decode_capture_sizes(rows if rows is not None else runner.buffers.max_seqs,
                                          runner.config.device.cuda_graphs)
        self.graphs: dict[int, CapturedGraph] = {}
        self.pool = None
        self.replays = 0

    def for_batch(self, n: int) -> Optional[CapturedGraph]:
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            return None
        g = self.graphs.get(self.sizes[i])
        if g is not None:
            self.replays += 1
        return g

    def context(self, bs: int) -> ForwardContext:
        """The forward context a graph of `bs` rows is captured with: every tensor a persistent buffer."""
        r = self.runner
        buf = r.buffers
        buf.select_compact()
        meta = AttentionMetadata(
            num_tokens=bs, query_start_loc=buf.query_start_loc[: bs + 1], seq_lens=buf.seq_lens[:bs],
            block_tables=buf.block_tables[:bs], slot_mapping=buf.slot_mapping[:bs], max_query_len=1,
            max_seq_len=r.config.model.max_model_len,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[1] * bs)
        ctx = ForwardContext(meta=meta, kv_caches=r.kv_caches, backend=r.backend)
        graph_extra = getattr(r, "graph_extra", None)  # (a DFlash drafter's view: its rings' metadata)
        if graph_extra is not None:
            ctx.extra.update(graph_extra(meta, bs))
        if r.state_cache is not None:
            ctx.extra["state_cache"] = r.state_cache
            ctx.extra["state_slots"] = buf.state_slots[:bs]
            if self.walks:
                ctx.extra["state_walks"] = (buf.state_walks[:bs], buf.state_walks[buf.max_seqs:buf.max_seqs + bs])
        return ctx

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """pool: another set's graph memory pool to share (sets never replay at once)."""
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        if not self.sizes:  # every configured size is above this set's rows: its batches run eagerly
            return
        r = self.runner
        buf = r.buffers
        buf.select_compact()  # graphs read the compact layout (decode batches fit it)
        # dummy decode inputs: every row attends to one token in block 0 and writes nowhere
        buf.input_ids.zero_()
        buf.positions.zero_()
        buf.slot_mapping.fill_(-1)
        buf.query_start_loc.copy_(torch.arange(buf.query_start_loc.numel(), dtype=torch.int32))
        buf.seq_lens.fill_(1)
        buf.block_tables.zero_()
        if r.state_cache is not None:  # and read / write only the scratch state slot
            buf.state_slots.fill_(r.state_cache.pad_slot)
            if self.walks:  # one-row walks
                n = buf.max_seqs
                buf.state_walks[:n].copy_(torch.arange(n, dtype=torch.int32))
                buf.state_walks[n:].copy_(torch.arange(1, n + 1, dtype=torch.int32))
        heads, dim = r.model.kv_heads_and_dim
        num_q_heads = r.model.config.num_attention_heads
        if hasattr(r.backend, "reserve"):  # split-KV scratch must exist before capture
            # for the buffers' whole row capacity, not just this set's largest batch: a hybrid's decode graphs (up to
            # --max-num-seqs rows) come before its verification graphs (up to max_num_seqs x (K + 1)), and scratch
            # grown by a later set would leave the earlier graphs on the old one (TritonBackend keeps it alive)
            rows = max(self.sizes[-1], buf.max_seqs)
            r.backend.reserve(rows, num_q_heads, heads, dim, r.config.model.max_model_len, r.device)
        with gc_paused():
            self._capture_all()
        torch.cuda.synchronize()

    def _capture_all(self) -> None:
        r = self.runner
        buf = r.buffers
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            ctx = self.context(bs)
            ids, pos = buf.input_ids[:bs], buf.positions[:bs]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels and settle the allocator outside capture
                    r.model(ids, pos, ctx)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # on this engine's stream: torch's default capture stream is one per process, made on the first card that
            # captured (a second engine on another card in the same process would capture on it)
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                hidden = r.model(ids, pos, ctx)
            self.graphs[bs] = CapturedGraph(bs, graph, hidden)
