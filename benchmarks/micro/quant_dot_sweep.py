"""Quantized decode batches on the GPU: the tiled dequant-GEMM (voltllm.kernels.quant_dot) against the few-row
dequant-GEMM (quant_gemv.quant_matmul), dequantize + cuBLAS and fp16 cuBLAS, cold L2; and quantized MoE experts
(layers/quant_moe.QuantExperts) per-pair vs grouped vs per-expert dequantize + cuBLAS. GPU only.

    PYTHONPATH=$PWD python3 benchmarks/micro/quant_dot_sweep.py [--configs] [--moe] [--out FILE.json]

Dense part: qwen3-8b projection shapes, Q4_K / Q8_0 (random GGUF blocks) and AWQ group 128 (random int4 planes with
zero points), rows 5-512; times in us from CUDA-graph replays over rotated copies (past the L2, as in decode).
With --configs, the tile candidates and splits of K at 16 / 64 / 256 rows first (Q4_K and AWQ, two shapes). MoE
part: qwen3-30b-a3b experts (128 x 768 x 2048, top 8), AWQ group 128, one layer, 1-512 tokens. The last lines are
tables; --out writes every number as JSON.
"""
import argparse
import json

import torch

from voltllm.kernels.quant_dot import DOT_CONFIGS, quant_dot
from voltllm.kernels.quant_gemv import dequantize, quant_matmul
from voltllm.model.layers.gguf_planes import (Unpacked, int4_kind, map_planes, planes_from_blocks,
                                              random_blocks, to_planes)
from voltllm.worker.skinny_tuning import graph_replay_ms

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
ROWS = (5, 8, 16, 32, 64, 128, 256, 512)
KINDS = ("Q4_K", "Q8_0", "AWQ_G128")
# (BLOCK_M, BLOCK_N, U, num_warps, num_stages) candidates per row class, each at several splits of K (None: the
# default choice, kernels/quant_dot.split_k)
CANDIDATES = {16: [(16, 32, 4, 4, 2), (16, 32, 4, 4, 3), (16, 64, 2, 4, 3), (16, 16, 8, 2, 2)],
              64: [(64, 32, 4, 4, 2), (64, 64, 4, 4, 2), (32, 64, 4, 4, 2)],
              256: [(64, 64, 4, 4, 2), (128, 128, 2, 8, 3)]}
SPLITS = (None, 1, 4, 8, 16)


def random_planes(kind: str, n: int, k: int, g: torch.Generator):
    if kind == "AWQ_G128":
        pk = int4_kind(128, True)
        u = Unpacked(codes=torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                     d=(torch.rand(n, k // 128, generator=g) * 0.01 + 0.001).half(), m=None, sc=None,
                     mn=torch.randint(0, 16, (n, k // 128), dtype=torch.int8, generator=g))
        p = to_planes(u, pk)
        return map_planes(p, lambda t: t.to("cuda"), p.n)
    return planes_from_blocks(random_blocks(kind, n, k, g), kind, k, torch.device("cuda"))


def rotation(kind, n, k, total=400e6):
    g = torch.Generator().manual_seed(n * 7 + k)
    first = random_planes(kind, n, k, g)
    return [first] + [random_planes(kind, n, k, g) for _ in range(min(max(1, int(total // first.nbytes)), 11))]


def us(fn, weights, reps=20):
    return graph_replay_ms(fn, weights, reps=reps) * 1e3


def dense_part(args, results):
    print(f"{'shape':>12} {'kind':>8} rows  {'fma':>7} {'dot':>7} {'deq+mm':>7} {'fp16':>7}  dot GB/s")
    for n, k in SHAPES:
        dense = [torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
                 for _ in range(max(2, int(400e6 // (n * k * 2)) + 1))]
        for kind in KINDS:
            planes = rotation(kind, n, k)
            qbytes = planes[0].nbytes
            if args.configs and kind != "Q8_0" and (n, k) in (SHAPES[0], SHAPES[-1]):
                for m, cands in CANDIDATES.items():
                    x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                    ref = quant_dot(x, planes[0], config=cands[0], split=1).float()
                    timed = []
                    for c in cands:
                        for sp in SPLITS:
                            try:
                                got = quant_dot(x, planes[0], config=c, split=sp).float()
                                assert torch.allclose(got, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
                                timed.append((us(lambda p: quant_dot(x, p, config=c, split=sp), planes), c, sp))
                            except Exception as e:  # noqa: BLE001 - a tile that does not compile / fit is reported
                                print(f"   config {c} split {sp} failed: {type(e).__name__}: {str(e)[:80]}")
                    timed.sort(key=lambda r: r[0])
                    print(f"   configs {n}x{k} {kind} rows {m}: " + ", ".join(f"{c}/{sp}:{t:.1f}"
                                                                            for t, c, sp in timed[:5]), flush=True)
                    results["configs"].append({"n": n, "k": k, "kind": kind, "rows": m,
                                               "us": {f"{c}/{sp}": t for t, c, sp in timed}})
            for m in ROWS:
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                fma = us(lambda p: quant_matmul(x, p), planes) if m <= 16 else float("nan")
                dot = us(lambda p: quant_dot(x, p), planes)
                deq = us(lambda p: x @ dequantize(p).t(), planes, reps=10)
                ref = us(lambda w: x @ w.t(), dense)
                print(f"{n:>6}x{k:<5} {kind:>8} {m:>4}  {fma:7.1f} {dot:7.1f} {deq:7.1f} {ref:7.1f}  "
                      f"{qbytes / dot / 1e3:6.0f}", flush=True)
                results["dense"].append({"n": n, "k": k, "kind": kind, "rows": m, "fma_us": fma, "dot_us": dot,
                                         "dequant_cublas_us": deq, "fp16_cublas_us": ref, "quant_bytes": qbytes})
            del planes
            torch.cuda.empty_cache()
        del dense
    print("\ndot vs dequantize + cuBLAS / vs fp16 cuBLAS (speed-up), summed over the four shapes:")
    for kind in KINDS:
        for m in ROWS:
            rs = [r for r in results["dense"] if r["kind"] == kind and r["rows"] == m]
            dot = sum(r["dot_us"] for r in rs)
            deq = sum(r["dequant_cublas_us"] for r in rs)
            print(f"{kind:>8} rows {m:>3}: dot {dot:8.1f} us  vs deq+mm {deq / dot:5.2f}x"
                  f"  vs fp16 {sum(r['fp16_cublas_us'] for r in rs) / dot:5.2f}x")


def moe_part(args, results):
    from voltllm.model.layers.moe import fused_experts_ref, sorted_experts
    from voltllm.model.layers.quant_moe import QuantExperts

    e, inter, h, top_k = 128, 768, 2048, 8
    g = torch.Generator().manual_seed(5)
    layers = []
    for _ in range(4):  # 4 layers' experts (~0.9 GB at 4 bits) rotate: the L2 stays cold
        qe = QuantExperts(e, inter, h, torch.device("cuda"), torch.float16)
        qe.w13 = random_planes("AWQ_G128", e * 2 * inter, h, g)
        qe.w2 = random_planes("AWQ_G128", e * h, inter, g)
        layers.append(qe)
    qe0 = layers[0]
    w13 = dequantize(qe0.w13).view(e, 2 * inter, h)
    w2 = dequantize(qe0.w2).view(e, h, inter)
    print(f"\nMoE experts (E {e}, I {inter}, H {h}, top {top_k}, AWQ g128): tokens  pairs  grouped  deq+mm (us)")
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 512):
        x = torch.randn(t, h, dtype=torch.float16, device="cuda")
        ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(t)]).to(torch.int32)
        wts = torch.softmax(torch.randn(t, top_k, device="cuda"), -1)
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), wts, ids.long())
        row = {"tokens": t}
        for form, fn in (("pairs", QuantExperts._pair_launches), ("grouped", QuantExperts._grouped)):
            got = fn(qe0, x, wts, ids).float()
            err = float((got - ref).norm() / ref.norm())
            assert err < 5e-3, f"{form} t={t}: rel {err:.2e}"
            row[form] = us(lambda q, fn=fn: fn(q, x, wts, ids), layers, reps=10) if (form == "grouped" or t <= 64) \
                else float("nan")
        # per expert with tokens, its blocks dequantized for cuBLAS (host syncs: timed without a graph)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for q in layers:
            sorted_experts(x, wts, ids, e, lambda i, q=q: q.expert_blocks(i, x.dtype))
        end.record()
        end.synchronize()
        row["dequant_cublas"] = start.elapsed_time(end) * 1e3 / len(layers)
        print(f"{t:>6} {t * top_k:>6} {row['pairs']:8.1f} {row['grouped']:8.1f} {row['dequant_cublas']:8.1f}",
              flush=True)
        results["moe"].append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", action="store_true", help="time the tile candidates first")
    ap.add_argument("--moe", action="store_true", help="the quantized MoE part only")
    ap.add_argument("--quick", action="store_true", help="two shapes, Q4_K and AWQ, 5 / 16 / 64 / 256 rows, no MoE")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = {"configs": [], "dense": [], "moe": [], "default_configs": {str(k): v for k, v in DOT_CONFIGS.items()},
               "gpu": torch.cuda.get_device_name()}
    if args.quick:
        global SHAPES, ROWS, KINDS
        SHAPES, ROWS, KINDS = [SHAPES[0], SHAPES[-1]], (5, 16, 64, 256), ("Q4_K", "AWQ_G128")
    if not args.moe:
        dense_part(args, results)
    if not args.quick:
        moe_part(args, results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
