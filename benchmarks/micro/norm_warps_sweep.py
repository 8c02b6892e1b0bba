"""Fused add + RMSNorm (voltllm.kernels.fused) at decode-batch shapes: warps per row (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/micro/norm_warps_sweep.py

The decode step runs 73 of these per token batch (qwen3-8b: rows of 4096, fp16 input, fp32 residual); at 1-64 rows
they are latency-bound. Replays 36 back-to-back launches from a CUDA graph, PDL on (as in the step), and prints us per
launch for each warp count (the launcher picks elems // 512, capped at 8 since session 9; it was 16).
"""
import torch

from graph_timing import graph_us
from voltllm.kernels import fused, pdl


def main():
    w = torch.rand(4096, device="cuda") + 0.5
    orig = fused._warps
    pdl.configure(True)
    try:
        for rows in (1, 16, 64, 256):
            x = torch.randn(rows, 4096, dtype=torch.float16, device="cuda")
            res0 = torch.randn(rows, 4096, device="cuda")
            res = res0.clone()
            out = torch.empty_like(x)
            line = []
            ref = None
            for warps in (1, 2, 4, 8, 16):
                fused._warps = lambda elems, lo=1, hi=16, n=warps: n  # noqa: E731
                fused.fused_add_rms_norm(x, res0.clone(), w, 1e-6, out=out)  # the same inputs for every count
                ref = out.clone() if ref is None else ref  # (the sum of squares is reduced in another order)
                assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-3, warps
                us = graph_us(lambda i: fused.fused_add_rms_norm(x, res, w, 1e-6, out=out), reps=36)
                line.append(f"{warps:2d} warps {us:5.2f} us")
            print(f"rows {rows:3d} (the launcher picks {orig(2 * 4096, hi=8)}): " + " | ".join(line))
    finally:
        fused._warps = orig
        pdl.configure(False)


if __name__ == "__main__":
    main()
