"""The tiled dequant-GEMM (kernels/quant_dot.py) in its transposed form (W_FIRST: W x^T, the dequantized weight tile
as the tensor cores' first operand, which may stay in registers) against the default form and fp16 cuBLAS, at 8B
projection shapes and decode-batch rows, cold L2 (CUDA-graph replays over rotated copies). GPU only.

    PYTHONPATH=$PWD:$PWD/benchmarks/micro python3 benchmarks/micro/quant_dot_wfirst.py [--budget-s 120] [--moe]

Every candidate's output is checked against the default form's first. Prints one line per (shape, kind, rows): the
candidates' times, fastest first. --moe: the grouped experts kernel instead (one qwen3-30b-a3b layer, AWQ g128, E 128,
I 768, H 2048, top 8; QuantExperts._grouped with each tile for both projections), 4 layers rotated.
"""
import argparse
import time

import torch

from quant_dot_sweep import random_planes, rotation, us
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


# quant_moe_dot tiles (BLOCK_N, U, num_warps, num_stages[, W_FIRST]); None: the default (DOT_CONFIGS')
MOE_TILES = [None, (64, 4, 4, 2, True), (128, 4, 8, 2, True), (64, 4, 4, 3, True), (128, 4, 8, 3, True),
             (64, 4, 8, 3, True)]


def moe_part():
    from voltllm.model.layers.quant_moe import QuantExperts

    e, inter, h, top_k = 128, 768, 2048, 8
    g = torch.Generator().manual_seed(5)
    layers = []
    for _ in range(4):  # ~0.9 GB of 4-bit experts: the L2 stays cold
        qe = QuantExperts(e, inter, h, torch.device("cuda"), torch.float16)
        qe.w13 = random_planes("AWQ_G128", e * 2 * inter, h, g)
        qe.w2 = random_planes("AWQ_G128", e * h, inter, g)
        layers.append(qe)
    for t in (64, 256, 512, 1024, 2048):  # up to 16 tokens the engine takes per-pair launches instead
        x = torch.randn(t, h, dtype=torch.float16, device="cuda")
        ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(t)]).to(torch.int32)
        wts = torch.softmax(torch.randn(t, top_k, device="cuda"), -1)
        ref = layers[0]._grouped(x, wts, ids).float()
        timed = []
        for tile in MOE_TILES:
            try:
                got = layers[0]._grouped(x, wts, ids, tile=tile).float()
                err = float((got - ref).norm() / ref.norm())
                assert err < 1e-3, f"rel err {err:.2e}"
                timed.append((us(lambda q, tile=tile: q._grouped(x, wts, ids, tile=tile), layers, reps=10),
                              str(tile or "default")))
            except Exception as ex:  # noqa: BLE001 - a tile that does not compile / fit is reported
                print(f"   {tile} failed: {type(ex).__name__}: {str(ex)[:100]}", flush=True)
        timed.sort()
        print(f"moe tokens {t} ({t * top_k} pairs): " + ", ".join(f"{c}:{u:.1f}" for u, c in timed), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=120.0, help="start no new shape after this many seconds")
    ap.add_argument("--moe", action="store_true", help="the grouped MoE kernel instead of the dense shapes")
    args = ap.parse_args()
    if args.moe:
        return moe_part()
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
