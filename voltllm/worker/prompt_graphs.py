"""Piecewise CUDA graphs for prompt steps (prefill chunks and mixed batches) of up to `max_tokens` tokens.

Why: an eager prompt step costs the host ~10 kernel launches per decoder layer (~0.46 ms per layer on the H200
machine's CPU for SmolLM2), so short prompts wait on Python, not on the GPU (docs/kernels.md, "Session 15").

What: one graph sequence per bucketed token count T (powers of two from 16). Attention is the one part whose
kernels depend on the step's sequences (their count, lengths and query spans set the grid), so it stays eager and
cuts the forward into pieces: piece 0 runs the embedding and the first layer up to its attention call (norm,
qkv projection, RoPE with the K/V store); piece i runs layer i-1's o_proj, MLP and layer i up to its attention;
the last piece ends with the final norm. A step replays piece 0, runs layer 0's attention with the step's own
metadata, replays piece 1, and so on: L + 1 graph launches and L attention launches instead of ~10 L launches.

How the pieces meet: each piece ends by copying its q into a static buffer (so later pieces may reuse q's graph
memory), the eager attention reads it and writes a static output buffer, and the next piece starts from that
output. K and V reach the cache inside the piece (the RoPE launch's store, or the backend's write), so the eager
call only attends. Padding tokens (T - num_tokens) have input id 0, position 0 and slot -1: they write no cache
row, belong to no sequence, and their attention rows are zeroed by the backend.

The graphs share the decode graphs' memory pool (steps never overlap). Only attention-only models over the Triton
backend use them (hybrid models' Gated DeltaNet layers need per-step host metadata in every layer).
"""
from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from voltllm.attention.backend import AttentionMetadata
from voltllm.model.forward_context import ForwardContext
from voltllm.worker.cuda_graphs import gc_paused

SMALLEST_BUCKET = 16

# The largest bucket when DeviceConfig.prompt_graph_max_tokens is None. Replay pays while the eager step waits on
# the host, whose cost is about the same per decoder layer whatever its width, and a step padded up to its bucket
# (up to 2x its tokens) must still finish before the eager one would. A layer's GPU time grows with tokens x the
# layer's projection parameters, so buckets stop where that product passes AUTO_TOKEN_LAYER_PARAMS, scaled by the
# GPU's matmul speed against the H200 it was measured on (docs/kernels.md, "Session 17"): SmolLM2's shape (3.5e6
# parameters per layer) gains 2.4-4.7x on 2,048-8,192-token steps; Qwen3-0.6B's (1.6e7) 1.4x at 4,096 tokens and
# loses 5% at 8,192; the 8B shape's (1.9e8) 1.35x at 500 tokens, but a 520-token step replayed as 1,024 (24 ms)
# would lose to eager (~18-20 ms). Those bound the constant to [9.9e10, 1.29e11).
AUTO_TOKEN_LAYER_PARAMS = 11 * 10**10
AUTO_MAX_TOKENS = 8192

# Dense fp16 tensor-core FLOPs per SM and clock (fp32 accumulation) by compute capability, for device_speed: V100 /
# T4 1,024, A100 2,048, GeForce Ampere / Ada / Blackwell 512, H100 / H200 4,096, B200 8,192. Clock rates (1.4-2.5
# GHz) are left out.
_FLOPS_PER_SM_CLOCK = {(7, 0): 1024, (7, 2): 1024, (7, 5): 1024, (8, 0): 2048, (8, 6): 512, (8, 7): 512,
                       (8, 9): 512, (9, 0): 4096, (10, 0): 8192, (12, 0): 512}
_REFERENCE_SPEED = 132 * 4096  # the H200 the constant was measured on


def device_speed(device: torch.device) -> float:
    """The GPU's matmul speed relative to the H200 (SMs x tensor-core FLOPs per SM and clock); 1.0 off CUDA and for
    capabilities not in the table."""
    if device.type != "cuda":
        return 1.0
    props = torch.cuda.get_device_properties(device)
    per_sm = _FLOPS_PER_SM_CLOCK.get((props.major, props.minor))
    return 1.0 if per_sm is None else props.multi_processor_count * per_sm / _REFERENCE_SPEED


def auto_max_tokens(layer_params: float, speed: float = 1.0) -> int:
    """The largest prompt-graph token count for decoder layers of `layer_params` projection parameters each on a
    GPU of relative matmul speed `speed` (device_speed): the largest power of two with tokens x layer_params <=
    AUTO_TOKEN_LAYER_PARAMS x speed, at most AUTO_MAX_TOKENS (0: none)."""
    limit = min(AUTO_MAX_TOKENS, int(AUTO_TOKEN_LAYER_PARAMS * speed / max(layer_params, 1.0)))
    sizes = prompt_graph_sizes(limit)
    return sizes[-1] if sizes else 0


def prompt_graph_sizes(max_tokens: int) -> list[int]:
    """Token buckets: 16, 32, ... up to the largest power of two <= max_tokens (none below 16)."""
    sizes, t = [], SMALLEST_BUCKET
    while t <= max_tokens:
        sizes.append(t)
        t *= 2
    return sizes


@dataclass
class AttentionSplice:
    """One eager attention call between two graph pieces: its static input / output buffers and the layer's
    cache and scales (all persistent tensors)."""

    q: torch.Tensor  # [T, Hq, D] view of the static q buffer
    out: torch.Tensor  # [T, Hq, D] view of the static output buffer
    kv_cache: torch.Tensor
    scale: float
    k_scale: Optional[torch.Tensor]
    v_scale: Optional[torch.Tensor]
    window: int = 0  # a sliding-window layer's window


class _PieceRecorder:
    """Captures consecutive graph pieces into one memory pool, cutting at each attention call."""

    def __init__(self, pool):
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.splices: list[AttentionSplice] = []
        self._current: Optional[torch.cuda.CUDAGraph] = None

    def begin(self) -> None:
        self._current = torch.cuda.CUDAGraph()
        self._current.capture_begin(pool=self.pool)

    def cut(self, splice: AttentionSplice) -> None:
        self.end()
        self.splices.append(splice)
        self.begin()

    def end(self) -> None:
        self._current.capture_end()
        self.pieces.append(self._current)
        self._current = None


class _SplicingBackend:
    """Stands in for the attention backend while a prompt graph is captured: at each attention call the piece
    being captured stores K / V (unless the RoPE launch did) and copies q to the static buffer, then ends; the call
    is recorded and the next piece begins, starting from the static output buffer."""

    def __init__(self, real, recorder: _PieceRecorder, q_buf: torch.Tensor, out_buf: torch.Tensor):
        self.real = real
        self.name = real.name
        self.recorder = recorder
        self.q_buf = q_buf
        self.out_buf = out_buf

    def cache_write_for(self, v, kv_cache, meta, k_scale=None, v_scale=None):
        return self.real.cache_write_for(v, kv_cache, meta, k_scale, v_scale)

    def fuses_decode_rope(self, q, kv_cache, meta, rotary_dim) -> bool:
        return False  # prompt steps are never pure decode

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None,
                kv_written: bool = False, rope=None, window: int = 0, query_positions=None):
        if rope is not None:
            raise ValueError("prompt graphs do not take a DecodeRope (pure-decode steps only)")
        if query_positions is not None:
            raise ValueError("prompt graphs do not take query positions (rows seeing past their own position)")
        t = q.shape[0]
        if not kv_written:
            self.real.write_kv(k, v, kv_cache, meta, k_scale, v_scale)
        q_static = self.q_buf[:t]
        q_static.copy_(q)
        out = self.out_buf[:t]
        self.recorder.cut(AttentionSplice(q_static, out, kv_cache, scale, k_scale, v_scale, window))
        return out


@dataclass
class PromptGraph:
    num_tokens: int
    pieces: list[torch.cuda.CUDAGraph]
    splices: list[AttentionSplice]
    hidden: torch.Tensor  # [num_tokens, hidden] final-norm output, static

    def replay(self, backend, meta: AttentionMetadata) -> torch.Tensor:
        """Run the step: each piece, then its attention with the step's metadata (`backend.forward`, looked up by
        the caller so that instrumentation wrappers count the calls)."""
        for i, piece in enumerate(self.pieces):
            piece.replay()
            if i < len(self.splices):
                s = self.splices[i]
                backend.forward(s.q, None, None, s.kv_cache, meta, s.scale, k_scale=s.k_scale, v_scale=s.v_scale,
                                kv_written=True, out=s.out, **({"window": s.window} if s.window else {}))
        return self.hidden


class PromptGraphs:
    def __init__(self, runner, max_tokens: int):
        self.runner = weakref.proxy(runner)  # (no cycle: a dropped engine frees its graphs at once)
        self.sizes = prompt_graph_sizes(max_tokens)
        self.graphs: dict[int, PromptGraph] = {}
        self.replays = 0

    def for_tokens(self, n: int) -> Optional[PromptGraph]:
        """The graph of the smallest bucket holding n tokens (None over the largest); counted as a replay."""
        i = bisect.bisect_left(self.sizes, n)
        g = self.graphs.get(self.sizes[i]) if i < len(self.sizes) else None
        if g is not None:
            self.replays += 1
        return g

    def _warm_up_seqs(self, t: int) -> list[int]:
        """The lengths of the sequences a warm-up of t tokens attends as: none longer than --max-model-len (a longer
        one would read past its block-table row); the bucket cap (max_num_seqs x max_model_len) bounds their count."""
        longest = max(1, min(self.runner.config.model.max_model_len, self.runner.buffers.block_tables.shape[1] *
                             self.runner.block_size))
        return [min(longest, t - start) for start in range(0, t, longest)]

    def _capture_meta(self, t: int) -> AttentionMetadata:
        """The warm-up sequences of t tokens on the persistent buffers (warm-up runs attend with them; nothing is
        stored)."""
        buf = self.runner.buffers
        lens = self._warm_up_seqs(t)
        n = len(lens)
        starts = [0]
        for length in lens:
            starts.append(starts[-1] + length)
        return AttentionMetadata(
            num_tokens=t, query_start_loc=buf.query_start_loc[:n + 1], seq_lens=buf.seq_lens[:n],
            block_tables=buf.block_tables[:n], slot_mapping=buf.slot_mapping[:t], max_query_len=max(lens),
            max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens)

    @torch.inference_mode()
    def capture(self, pool) -> None:
        with gc_paused():
            self._capture_all(pool)
        torch.cuda.synchronize()

    def _capture_all(self, pool) -> None:
        r = self.runner
        buf = r.buffers
        attn = r.model.layers[0].self_attn
        heads, dim = attn.num_heads, attn.head_dim
        top = self.sizes[-1]
        q_buf = torch.zeros(top, heads, dim, dtype=r.dtype, device=r.device)
        out_buf = torch.zeros_like(q_buf)
        for t in reversed(self.sizes):  # largest first, so smaller ones reuse its pool memory
            lens = self._warm_up_seqs(t)
            buf.select_for(t, len(lens))  # the layout a step of t (padded) tokens uploads into
            # dummy inputs: token 0 at position 0, stored nowhere; sequences reading block 0 (warm-ups only)
            buf.input_ids[:t].zero_()
            buf.positions[:t].zero_()
            buf.slot_mapping[:t].fill_(-1)
            meta = self._capture_meta(t)
            buf.query_start_loc[:len(lens) + 1].copy_(torch.tensor(meta.query_start_loc_cpu, dtype=torch.int32))
            buf.seq_lens[:len(lens)].copy_(torch.tensor(lens, dtype=torch.int32))
            buf.block_tables[:len(lens)].zero_()
            ids, pos = buf.input_ids[:t], buf.positions[:t]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the kernels of this token count and settle the allocator
                    r.model(ids, pos, ForwardContext(meta=meta, kv_caches=r.kv_caches, backend=r.backend))
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            recorder = _PieceRecorder(pool)
            ctx = ForwardContext(meta=meta, kv_caches=r.kv_caches,
                                 backend=_SplicingBackend(r.backend, recorder, q_buf, out_buf))
            with torch.cuda.stream(stream):
                recorder.begin()
                try:
                    hidden = r.model(ids, pos, ctx)
                finally:
                    recorder.end()
            torch.cuda.current_stream().wait_stream(stream)
            self.graphs[t] = PromptGraph(t, recorder.pieces, recorder.splices, hidden)
