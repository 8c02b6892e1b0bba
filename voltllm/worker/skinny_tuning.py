"""Pick, per weight shape, cuBLAS or the skinny Triton GEMM for decode-sized matmuls, by timing both.

Decode at small batch is a weight-streaming problem; which implementation streams faster depends on the
GPU, the shape and the library version, so the runner measures it once at start (a few ms per shape)
instead of assuming it. Timings replay a CUDA graph and rotate over every layer's weight of that shape:
a decode step reads each weight once from HBM, and timing one weight again and again would measure the
L2 cache instead (a 4096x4096 fp16 weight is 32 MiB; an H200's L2 holds 50 MiB).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from voltllm.model.layers.linear import Linear, UnquantizedLinearMethod

logger = logging.getLogger("voltllm")

L2_FLUSH_BYTES = 256 << 20  # stream at least this much between two reads of the same weight


def graph_replay_ms(fn, weights: list[torch.Tensor], reps: int = 24) -> float:
    """Per-call time of fn over the rotation, replayed from a CUDA graph: decode replays graphs too, and
    timing Python launches would measure the (slow) host instead of the kernel."""
    for w in weights[:3]:
        fn(w)  # compile / pick algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (2 * reps)


def _rotation(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The shape's weights, plus scratch copies when there are too few of them to leave L2 cold. The copies
    are views of one buffer filled by one launch (a small weight needs thousands: 8 KB -> 32768)."""
    w = weights[0]
    per = w.numel() * w.element_size()
    need = -(-L2_FLUSH_BYTES // per)
    if len(weights) >= need or per >= L2_FLUSH_BYTES:
        return weights
    pool = torch.empty((need - len(weights), *w.shape), dtype=w.dtype, device=w.device).normal_(0, 0.02)
    return weights + list(pool.unbind(0))


@torch.inference_mode()
def tune_skinny_gemm(model: torch.nn.Module, rows: int = 1) -> dict[tuple[int, int], object]:
    """Set `skinny` on every unquantized Linear (and the model's logits) where the Triton GEMM wins."""
    from voltllm.kernels.gemv import CONFIGS, gemv

    groups: dict[tuple[int, int], list] = {}
    for mod in model.modules():
        if isinstance(mod, Linear) and isinstance(mod.method, UnquantizedLinearMethod):
            if mod.weight.dtype in (torch.float16, torch.bfloat16) and mod.weight.is_cuda:
                groups.setdefault(tuple(mod.weight.shape), []).append(mod)
    logits_w = getattr(model, "logits_weight", None)
    if logits_w is not None and logits_w.is_cuda and logits_w.dtype in (torch.float16, torch.bfloat16):
        groups.setdefault(tuple(logits_w.shape), []).append(model)
    decisions = {}
    lines = []
    for (n, k), mods in groups.items():
        weights = _rotation([m.logits_weight if m is model else m.weight for m in mods])
        w = weights[0]
        x = torch.randn(rows, k, dtype=w.dtype, device=w.device)
        t_lib = graph_replay_ms(lambda w_: F.linear(x, w_), weights)
        ref = F.linear(x, w).float()
        best, t_tri = None, float("inf")
        for cfg in CONFIGS:
            err = (gemv(x, w, config=cfg).float() - ref).norm() / ref.norm().clamp_min(1e-6)
            if err.item() > 1e-2:
                continue  # never choose a config that computes something else
            t = graph_replay_ms(lambda w_: gemv(x, w_, config=cfg), weights)
            if t < t_tri:
                best, t_tri = cfg, t
        del weights
        use = best if t_tri < 0.97 * t_lib else None
        decisions[(n, k)] = use
        for m in mods:
            if m is model:
                model.logits_skinny = use
            else:
                m.skinny = use
        gbps = lambda t: n * k * w.element_size() / t / 1e6  # noqa: E731
        lines.append(f"{n}x{k}: cuBLAS {t_lib * 1e3:.1f} us ({gbps(t_lib):.0f} GB/s), best triton {best} "
                     f"{t_tri * 1e3:.1f} us ({gbps(t_tri):.0f} GB/s) -> {'triton' if use else 'cuBLAS'}")
    if lines:
        logger.info("decode GEMM choice (M=%d, cold L2):\n  %s", rows, "\n  ".join(lines))
    return decisions
