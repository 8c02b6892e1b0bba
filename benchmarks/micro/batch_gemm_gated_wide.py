"""Gated gate_up tiles (silu(gate) * up in the epilogue) of 64-256 features at 64 rows against cuBLAS + the SiLU
kernel and the production candidates (GPU).

    PYTHONPATH=$PWD python3 benchmarks/micro/batch_gemm_gated_wide.py [--json OUT.json] [ROWS ...]

Why: in session 49's wide sweep (batch_gemm_wide_split.py) the plain gate_up at 64 rows streamed as fast with 96
programs of 256 features (52.3 us) as with 384 of 64 (52.2; cuBLAS 51.8), while the gated form the tuner times only
has tiles of at most 64 features per half (192 programs), which tie with cuBLAS + SiLU at 64 rows (session 9). A
wider gated tile would drop the SiLU launch (~2 us per layer) if it streams like the plain wide tile. Same timing as
the start-up tuner (weights rotated past the L2, CUDA-graph replays); each candidate checked against the reference.
--json writes the tiles that beat both the production gated best and cuBLAS + SiLU, in bench_with_tma_configs.py's
format.
"""
import json
import sys

import torch

from voltllm.kernels.batch_gemm import TMA_CONFIGS, batch_gemm, batch_gemm_ref
from voltllm.kernels.fused import silu_and_mul
from voltllm.worker.skinny_tuning import graph_replay_ms

SHAPE = (24576, 4096)  # qwen3-8b gate_up ([gate; up])


def grid():
    return [(bn, bk, warps, st, 1, True) for bn in (64, 128, 256) for bk in (64, 128) for st in (3, 4, 5)
            for warps in ((4, 8) if bn >= 128 else (4,)) if (64 + 2 * bn) * bk * st * 2 <= 220 * 1024]


def main(argv):
    json_out = None
    if argv[:1] == ["--json"]:
        json_out, argv = argv[1], argv[2:]
    rows_list = [int(a) for a in argv] or [64]
    torch.manual_seed(0)
    n, k = SHAPE
    weights = [torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
               for _ in range(int(400e6 // (n * k * 2)) + 1)]
    winners = {}
    for m in rows_list:
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        out = torch.empty(m, n // 2, dtype=torch.float16, device="cuda")
        full = torch.empty(m, n, dtype=torch.float16, device="cuda")
        ref = batch_gemm_ref(x, weights[0], gated=True).float()
        t_lib = graph_replay_ms(lambda w: silu_and_mul(torch.matmul(x, w.t(), out=full), out=out), weights,
                                reps=30) * 1e3
        timed = {}
        for cfg in [c for c in TMA_CONFIGS if c[4] == 1] + grid():
            if cfg in timed:
                continue
            try:
                out.fill_(float("nan"))
                got = batch_gemm(x, weights[0], config=cfg, gated=True, out=out).float()
            except Exception as e:  # a tile the device cannot launch: report and skip
                print(f"m{m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            err = ((got - ref).norm() / ref.norm()).item()
            if not err <= 2e-3:
                raise AssertionError(f"gated m{m} {cfg}: relative error {err:.2e}")
            timed[cfg] = graph_replay_ms(lambda w: batch_gemm(x, w, config=cfg, gated=True, out=out), weights,
                                         reps=30) * 1e3
        prod = min((t, c) for c, t in timed.items() if c in TMA_CONFIGS)
        wide = sorted((t, c) for c, t in timed.items() if c not in TMA_CONFIGS)
        print(f"gated m{m} fastest new tiles:", [(round(t, 2), c) for t, c in wide[:6]], flush=True)
        print(f"gated gate_up m{m}: cuBLAS + SiLU {t_lib:6.2f} us | production gated {prod[0]:6.2f} {prod[1]} | "
              f"new {wide[0][0]:6.2f} {wide[0][1]}", flush=True)
        winners[f"gated{n}x{k}m{m}"] = [list(c) for t, c in wide[:2] if t < min(prod[0], t_lib)]
    if json_out:
        with open(json_out, "w") as f:
            json.dump(winners, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
