"""Pick, per weight shape, cuBLAS or the skinny Triton GEMM for decode-sized matmuls, by timing both.

Decode at small batch is a weight-streaming problem; which implementation streams faster depends on the
GPU, the shape and the library version, so the runner measures it once at start (a few ms per shape)
instead of assuming it.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from voltllm.model.layers.linear import Linear, UnquantizedLinearMethod

logger = logging.getLogger("voltllm")


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


@torch.inference_mode()
def tune_skinny_gemm(model: torch.nn.Module, rows: int = 1) -> dict[tuple[int, int], bool]:
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
        w = mods[0].logits_weight if mods[0] is model else mods[0].weight
        x = torch.randn(rows, k, dtype=w.dtype, device=w.device)
        t_lib = _time_ms(lambda: F.linear(x, w))
        ref = F.linear(x, w).float()
        best, t_tri = None, float("inf")
        for cfg in CONFIGS:
            err = (gemv(x, w, config=cfg).float() - ref).norm() / ref.norm().clamp_min(1e-6)
            if err.item() > 1e-2:
                continue  # never choose a config that computes something else
            t = _time_ms(lambda: gemv(x, w, config=cfg))
            if t < t_tri:
                best, t_tri = cfg, t
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
        logger.info("decode GEMM choice (M=%d):\n  %s", rows, "\n  ".join(lines))
    return decisions
