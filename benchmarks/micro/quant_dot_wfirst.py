"""The tiled dequant-GEMM (kernels/quant_dot.py) in its transposed form (W_FIRST: W x^T, the dequantized weight tile
as the tensor cores' first operand, which may stay in registers) against the default form and fp16 cuBLAS, at 8B
projection shapes and decode-batch rows, cold L2 (CUDA-graph replays over rotated copies). GPU only.

    PYTHONPATH=$PWD:$PWD/benchmarks/micro python3 benchmarks/micro/quant_dot_wfirst.py [--budget-s 120]

Every candidate's output is checked against the default form's first. Prints one line per (shape, kind, rows): the
candidates' times, fastest first.
"""
import argparse
import time

import torch

from quant_dot_sweep import rotation, us
from voltllm.kernels.quant_dot import pick_config, quant_dot

SHAPES = [(6144, 4096), (4096, 12288), (24576, 4096)]
KINDS = ("AWQ_G128", "Q4_K")
# (BLOCK_M, BLOCK_N, U, num_warps, num_stages, W_FIRST) per row count; the default form's config comes first
CANDIDATES = {
    16: [(16, 64, 4, 4, 2, True), (16, 128, 4, 4, 2, True), (16, 64, 4, 4, 3, True)],
    32: [(32, 64, 4, 4, 2, True), (32, 128, 4, 4, 2, True)],
    64: [(64, 32, 4, 4, 2, True), (64, 64, 4, 4, 2, True), (64, 64, 4, 4, 3, True), (64, 128, 4, 8, 2, True),
         (64, 64, 8, 4, 2, True)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=120.0, help="start no new shape after this many seconds")
    args = ap.parse_args()
    t0 = time.time()
    for n, k in SHAPES:
        dense = [torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
                 for _ in range(max(2, int(400e6 // (n * k * 2)) + 1))]
        for kind in KINDS:
            if time.time() - t0 > args.budget_s:
                print(f"budget spent: {n}x{k} {kind} not timed", flush=True)
                continue
            planes = rotation(kind, n, k)
            for m, cands in CANDIDATES.items():
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                base = pick_config(m)
                ref = quant_dot(x, planes[0], config=base).float()
                timed = [(us(lambda p: quant_dot(x, p, config=base), planes), "default " + str(base))]
                for c in cands:
                    try:
                        got = quant_dot(x, planes[0], config=c).float()
                        err = float((got - ref).norm() / ref.norm())
                        assert err < 1e-3, f"rel err {err:.2e}"
                        timed.append((us(lambda p: quant_dot(x, p, config=c), planes), str(c)))
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile / fit is reported
                        print(f"   {c} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                fp16 = us(lambda w: x @ w.t(), dense)
                timed.sort()
                print(f"{n}x{k} {kind} rows {m}: fp16 cuBLAS {fp16:.1f} | "
                      + ", ".join(f"{c}:{t:.1f}" for t, c in timed), flush=True)
            del planes
            torch.cuda.empty_cache()
        del dense


if __name__ == "__main__":
    main()
