"""GGUF-quantized linear layers on the GPU (voltllm.kernels.quant_gemv) against fp16 cuBLAS, cold L2 (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/micro/quant_gemv_sweep.py [--quick]

Per weight shape (qwen3-8b and SmolLM2-135M projections), GGUF kind and row count: the dequant-GEMM (rows <= 16),
dequantize + cuBLAS, and fp16 cuBLAS on a dense weight of the same shape; times
in us from CUDA-graph replays over rotated copies (past the L2, as in decode), and the quantized bytes streamed per
second. With --configs, the dequant-GEMM's tiles at 1 and 4 rows. The last lines are a table: best form per row count.
"""
import argparse

import torch

from voltllm.kernels.quant_gemv import dequantize, quant_matmul
from voltllm.model.layers.gguf_planes import KINDS, planes_from_blocks, random_blocks
from voltllm.worker.skinny_tuning import graph_replay_ms

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (960, 576), (3072, 576)]
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
# (BLOCK_N, U, num_warps)
# one warp with several rows keeps the rows in each thread's registers, so each activation element is loaded and
# converted once per thread for all of them (with rows across warps, every warp converts its own copy): the
# (R, 32, 1) / (R, 16, 1) entries test that (session 23 left them unmeasured)
FMA_CONFIGS = [(1, 64, 2), (1, 32, 1), (2, 32, 2), (2, 64, 2), (4, 32, 1), (8, 32, 1), (4, 16, 1), (8, 16, 1),
               (4, 64, 2), (16, 16, 1)]
ROWS_CONFIGS = [(16, 8, 4), (8, 16, 4), (4, 32, 1), (8, 16, 1), (8, 32, 1), (16, 8, 1), (32, 4, 4)]



def rotation(name, n, k, total=400e6):
    g = torch.Generator().manual_seed(n * 7 + k)
    first = planes_from_blocks(random_blocks(name, n, k, g), name, k, torch.device("cuda"))
    copies = max(2, int(total // first.nbytes) + 1)
    return [first] + [planes_from_blocks(random_blocks(name, n, k, g), name, k, torch.device("cuda"))
                      for _ in range(min(copies, 12) - 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8B shapes, Q4_K and Q8_0 only")
    ap.add_argument("--configs", action="store_true", help="also sweep the dequant-GEMM tiles at 1 / 4 rows")
    args = ap.parse_args()
    kinds = ["Q4_K", "Q8_0"] if args.quick else list(KINDS)
    shapes = SHAPES[:4] if args.quick else SHAPES
    print(f"{'shape':>12} {'kind':>5} rows  {'gemm us':>7} {'deq+mm':>7} {'fp16 us':>7}  best GB/s")
    summary = []
    for n, k in shapes:
        dense = [torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
                 for _ in range(max(2, int(400e6 // (n * k * 2)) + 1))]
        for name in kinds:
            planes = rotation(name, n, k)
            qbytes = planes[0].nbytes
            if args.configs:
                for m, configs in ((1, FMA_CONFIGS), (4, ROWS_CONFIGS)):
                    x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                    times = sorted((graph_replay_ms(lambda p: quant_matmul(x, p, config=c), planes,
                                                    reps=30) * 1e3, c) for c in configs)
                    print(f"   configs {n}x{k} {name} rows {m}: " + ", ".join(f"{c}:{t:.1f}" for t, c in times[:4]))
            for m in ROWS:
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                fma = graph_replay_ms(lambda p: quant_matmul(x, p), planes, reps=30) * 1e3 if m <= 16 else float("nan")
                deq = graph_replay_ms(lambda p: x @ dequantize(p).t(), planes, reps=10) * 1e3
                ref = graph_replay_ms(lambda w: x @ w.t(), dense, reps=30) * 1e3
                best = min(t for t in (fma, deq) if t == t)
                form = {fma: "gemm", deq: "deq+mm"}[best]
                print(f"{n:>6}x{k:<5} {name:>5} {m:>4}  {fma:7.1f} {deq:7.1f} {ref:7.1f}  "
                      f"{form} {qbytes / best / 1e3:.0f}")
                summary.append((n, k, name, m, form, best, ref))
            del planes
            torch.cuda.empty_cache()
        del dense
    print("\nbest form vs fp16 cuBLAS (speed-up), per row count:")
    for m in ROWS:
        rows = [s for s in summary if s[3] == m]
        print(f"rows {m:>3}: " + "  ".join(f"{s[2]} {s[0]}x{s[1]} {s[4]} {s[6] / s[5]:.2f}x" for s in rows
                                           if s[0] >= 4096))


if __name__ == "__main__":
    main()
