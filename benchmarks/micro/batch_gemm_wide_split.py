"""Wide split-K TMA tiles for the 64-row decode-batch GEMM against the production candidates and cuBLAS (GPU).

    PYTHONPATH=$PWD python3 benchmarks/micro/batch_gemm_wide_split.py [--json OUT.json] [ROWS ...]

Why: the production TMA tiles that win at 64 rows are narrow (BLOCK_N 32-64, one K slice), so each of the ~128
programs pulls all of x through its SM (512 KB per layer at K = 4096, 1.5 MB at the down projection's 12,288) for
256-768 KB of weight: session 40 measured the SM's intake, not the L2, as the cap of such programs. A wider tile
cut into K slices reads x / SPLIT_K per program for the same weight bytes and keeps ~128 programs, at the cost of
the fp32 partials and the last slice's in-order sum. The session 8 sweep (batch_gemm_sweep.py) never offered
BLOCK_N 256 nor more than 3 slices. Same timing as the start-up tuner: weights rotated past the L2, calls replayed
from a CUDA graph; every candidate is checked against cuBLAS first. Prints per shape the production best, the wide
best and cuBLAS; --json writes the wide tiles that beat the production best.
"""
import json
import sys

import torch

from voltllm.kernels.batch_gemm import TMA_CONFIGS, batch_gemm, tma_supported
from voltllm.worker.skinny_tuning import graph_replay_ms

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qwen3-8b qkv, o, gate_up, down
SMEM = 227 * 1024


def wide_grid(n: int, rows: int) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, warps, stages, SPLIT_K, TMA) tiles of 64-256 features whose programs make 0.7-3 waves."""
    out = []
    for bn in (64, 128, 256):
        for bk, stages in ((64, (4, 6)), (128, (3, 4))):
            for st in stages:
                if (rows + bn) * bk * st * 2 + rows * bn * 4 > SMEM:
                    continue
                for sp in (1, 2, 4, 8):
                    if not 90 <= -(-n // bn) * sp <= 400:
                        continue
                    for warps in ((4, 8) if bn == 256 else (4,)):
                        out.append((bn, bk, warps, st, sp, True))
    return out


def main(argv):
    json_out = None
    if argv[:1] == ["--json"]:
        json_out, argv = argv[1], argv[2:]
    rows_list = [int(a) for a in argv] or [64]
    assert tma_supported(torch.device("cuda")), "needs sm_90+ and Triton tensor descriptors"
    torch.manual_seed(0)
    summary, winners = [], {}
    for n, k in SHAPES:
        weights = [torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
                   for _ in range(max(2, int(400e6 // (n * k * 2)) + 1))]
        mb = n * k * 2 / 1e6
        for m in rows_list:
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            out = torch.empty(m, n, dtype=torch.float16, device="cuda")
            ref = torch.matmul(x, weights[0].t()).float()
            t_lib = graph_replay_ms(lambda w: torch.matmul(x, w.t(), out=out), weights, reps=30) * 1e3
            timed = {}
            for cfg in (*TMA_CONFIGS, *wide_grid(n, m)):
                if cfg in timed:
                    continue
                try:
                    out.fill_(float("nan"))
                    got = batch_gemm(x, weights[0], config=cfg, out=out).float()
                except Exception as e:  # a tile the device cannot launch (resources): report and skip
                    print(f"{n}x{k} m{m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                err = ((got - ref).norm() / ref.norm()).item()
                if not err <= 2e-3:
                    raise AssertionError(f"{n}x{k} m{m} {cfg}: relative error {err:.2e}")
                timed[cfg] = graph_replay_ms(lambda w: batch_gemm(x, w, config=cfg, out=out), weights, reps=30) * 1e3
            prod = min((timed[c], c) for c in TMA_CONFIGS if c in timed)
            wide = sorted((t, c) for c, t in timed.items() if c not in TMA_CONFIGS)
            print(f"{n}x{k} m{m} fastest wide tiles:", [(round(t, 2), c) for t, c in wide[:6]], flush=True)
            line = (f"{n:>6}x{k:<6} m{m:<3} cuBLAS {t_lib:6.2f} us {mb / t_lib:4.2f} TB/s | production {prod[0]:6.2f} "
                    f"{mb / prod[0]:4.2f} {prod[1]} | wide {wide[0][0]:6.2f} {mb / wide[0][0]:4.2f} {wide[0][1]}")
            print(line, flush=True)
            summary.append(line)
            winners[f"{n}x{k}m{m}"] = [list(c) for t, c in wide[:2] if t < min(prod[0], t_lib)]
        del weights
        torch.cuda.empty_cache()
    print("\n".join(summary))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(winners, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
