"""Cold-L2 sweep of the decode-batch GEMM (voltllm.kernels.batch_gemm) against cuBLAS at 8B decode shapes (GPU).

    PYTHONPATH=$PWD python3 benchmarks/micro/batch_gemm_sweep.py [ROWS ...]

Times every pointer-load config (CONFIGS) and, on sm_90+, a grid of TMA tiles (BLOCK_N x BLOCK_K x stages x
split-K, 4 warps) per shape and row count, with the weights rotated past the L2 and the calls replayed from a CUDA
graph (the start-up tuner's timing). Every candidate's output is checked against cuBLAS first. Prints the
five fastest TMA tiles and one summary line per shape.
"""
import sys

import torch

from voltllm.kernels.batch_gemm import CONFIGS, batch_gemm, tma_supported
from voltllm.worker.skinny_tuning import graph_replay_ms

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qwen3-8b qkv, o, gate_up, down
TMA_GRID = [(bn, bk, 4, st, sp, True) for bn in (16, 32, 64, 128) for bk in (64, 128, 256) for st in (3, 4, 6, 8)
            for sp in (1, 2, 3) if (bn + 64) * bk * st * 2 <= 220 * 1024]


def _time(fn, weights):
    return graph_replay_ms(fn, weights, reps=30) * 1e3


def main(rows_list):
    torch.manual_seed(0)
    grid = TMA_GRID if tma_supported(torch.device("cuda")) else []
    summary = []
    for n, k in SHAPES:
        weights = [torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
                   for _ in range(max(2, int(400e6 // (n * k * 2)) + 1))]
        mb = n * k * 2 / 1e6
        for m in rows_list:
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            out = torch.empty(m, n, dtype=torch.float16, device="cuda")
            ref = torch.matmul(x, weights[0].t()).float()
            t_lib = _time(lambda w: torch.matmul(x, w.t(), out=out), weights)
            timed = {}
            for cfg in (*CONFIGS, *grid):
                err = ((batch_gemm(x, weights[0], config=cfg).float() - ref).norm() / ref.norm()).item()
                if err > 2e-3:
                    raise AssertionError(f"{n}x{k} m{m} {cfg}: relative error {err:.2e}")
                timed[cfg] = _time(lambda w: batch_gemm(x, w, config=cfg, out=out), weights)
            ptr = min((t, c) for c, t in timed.items() if len(c) == 5)
            tma = sorted((t, c) for c, t in timed.items() if len(c) == 6)
            if tma:
                print(f"{n}x{k} m{m} fastest TMA tiles:", [(round(t, 1), c) for t, c in tma[:5]], flush=True)
            line = (f"{n:>6}x{k:<6} m{m:<3} cuBLAS {t_lib:6.1f} us {mb / t_lib:4.2f} TB/s | pointer {ptr[0]:6.1f} "
                    f"{mb / ptr[0]:4.2f} {ptr[1]}" + (f" | TMA {tma[0][0]:6.1f} {mb / tma[0][0]:4.2f} {tma[0][1]}"
                                                       if tma else ""))
            print(line, flush=True)
            summary.append(line)
        del weights
        torch.cuda.empty_cache()
    print("\n".join(summary))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [64])
