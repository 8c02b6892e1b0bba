"""Does the stream-K grid (batch_gemm_streamk) speed up the decode-batch TMA GEMMs? (GPU, sm_90+)

    PYTHONPATH=$PWD python3 benchmarks/micro/gemm_streamk.py [ROWS]

A projection whose tile count is not a multiple of the SM count ends in a partial wave (the 8B gated gate_up at 64
rows: 192 tiles on 132 SMs). Per 8B projection shape (qkv, o, the gated gate_up, down): chains of 36 GEMMs (each its
own weight, so the L2 stays cold), replayed from a CUDA graph with PDL on: cuBLAS, every production TMA tile, and
stream-K grids of some of them; then the 36-layer chain of all four (the fastest per shape) without and with the
stream-K candidates, A B A B. Every candidate is first checked against the fp32 reference (output poisoned with NaN)
and for its tile counters back at zero.
"""
import sys

import torch

from voltllm.kernels import pdl
from voltllm.kernels.batch_gemm import TMA_CONFIGS, _counters, batch_gemm, batch_gemm_ref
from graph_timing import graph_median_us  # (beside this script)

CHAIN = 36
# (name, weight rows, K, gated): the 8B decode step's projections
SHAPES = (("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 24576, 4096, True),
          ("down", 4096, 12288, False))


def make(m: int, n: int, k: int, gated: bool):
    ws = [torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02 for _ in range(CHAIN)]
    x = torch.randn(m, k, dtype=torch.float16, device="cuda")
    ys = [torch.empty(m, n // 2 if gated else n, dtype=torch.float16, device="cuda") for _ in range(CHAIN)]
    return x, ws, ys


# stream-K grids (seventh field: programs per SM) of the production TMA tiles
STREAMK = ((64, 128, 4, 6, 1, True, 1), (32, 256, 4, 4, 1, True, 1), (32, 128, 4, 6, 1, True, 1),
           (64, 64, 4, 4, 1, True, 1), (64, 64, 4, 4, 1, True, 2), (128, 64, 8, 4, 1, True, 1))


def gemm_fn(cfg, gated: bool):
    """f(x, w, y) computing one projection with tile cfg ("cublas": torch.matmul)."""
    if cfg == "cublas":
        return lambda x, w, y: torch.matmul(x, w.t(), out=y)
    return lambda x, w, y: batch_gemm(x, w, config=cfg, out=y, gated=gated)


def check(fn, x, w, y, gated: bool, what) -> None:
    y.fill_(float("nan"))
    fn(x, w, y)
    ref = batch_gemm_ref(x, w, gated=gated).float()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    if not err < 2e-3:
        raise AssertionError(f"{what}: relative error {err}")
    if x.device in _counters and _counters[x.device].any():
        raise AssertionError(f"{what}: tile counters not back at zero")


def main(m: int) -> None:
    torch.manual_seed(0)
    pdl.configure(True)
    best = {}  # (shape, with stream-K candidates) -> (us, cfg)
    for name, n, k, gated in SHAPES:
        x, ws, ys = make(m, n, k, gated)
        cands = [c for c in TMA_CONFIGS if not gated or c[4] == 1] + ([] if gated else ["cublas"]) + list(STREAMK)
        for cfg in cands:
            fn = gemm_fn(cfg, gated)
            check(fn, x, ws[0], ys[0], gated, (name, cfg))
            t = graph_median_us(lambda fn=fn: [fn(x, w, y) for w, y in zip(ws, ys)], CHAIN)
            print(f"m{m} {name:8s} {str(cfg):30s}: {t:7.2f} us ({n * k * 2 / 1e6 / t:4.2f} TB/s)", flush=True)
            sk = cfg != "cublas" and len(cfg) == 7
            for r in (True,) if sk else (False, True):
                if t < best.get((name, r), (float("inf"),))[0]:
                    best[(name, r)] = (t, cfg)
        ws = ys = None  # (free the chain before the next shape)
        torch.cuda.empty_cache()
    # the 36-layer chain qkv -> o -> gate_up (gated) -> down, each GEMM reading the previous one's output
    layers = []
    for _ in range(CHAIN):
        layers.append([torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02 for _, n, k, _ in SHAPES])
    h = torch.randn(m, 4096, dtype=torch.float16, device="cuda")
    outs = [torch.empty(m, n // 2 if g else n, dtype=torch.float16, device="cuda") for _, n, _, g in SHAPES]
    attn_in = torch.empty(m, 4096, dtype=torch.float16, device="cuda")

    def step(sk: bool):
        fns = [gemm_fn(best[(name, sk)][1], g) for name, _, _, g in SHAPES]

        def run():
            for ws in layers:
                fns[0](h, ws[0], outs[0])
                attn_in.copy_(outs[0][:, :4096])  # (stands in for attention: o reads a [m, 4096] input)
                fns[1](attn_in, ws[1], outs[1])
                fns[2](outs[1], ws[2], outs[2])
                fns[3](outs[2], ws[3], h)
        return run
    results = {False: [], True: []}
    for _ in range(2):
        for sk in (False, True):
            results[sk].append(graph_median_us(step(sk), CHAIN))
    print()
    for name, n, k, _ in SHAPES:
        off, on = best[(name, False)], best[(name, True)]
        print(f"m{m} {name:8s} best without stream-K {off[0]:7.2f} us {str(off[1]):26s} | with {on[0]:7.2f} us "
              f"{str(on[1]):30s} | {off[0] / on[0]:.3f}x")
    per = {r: min(v) for r, v in results.items()}
    print(f"m{m} layer chain (4 GEMMs + a copy, 36 layers): without stream-K {per[False]:.2f} us per layer "
          f"{[round(v, 2) for v in results[False]]} | with {per[True]:.2f} "
          f"{[round(v, 2) for v in results[True]]} | {per[False] / per[True]:.3f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
