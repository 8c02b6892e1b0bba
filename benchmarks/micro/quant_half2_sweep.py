"""The packed-fp16 4-bit decode GEMV (voltllm.kernels.quant_half2, both tilings: "h2" = half2_matmul, "rows" =
half2_rows_matmul) and the tensor-core form ("mma" = quant_mma.quant_mma_matmul, sm_80+) against the fp32
dequant-GEMM (quant_gemv.quant_matmul) at 1-8 rows: correctness against the dequantized weight, then times over the
qwen3-8b projection shapes and tile candidates, L2 cold (CUDA-graph replays over rotated copies). GPU only.

    PYTHONPATH=$PWD python3 benchmarks/micro/quant_half2_sweep.py [--kinds AWQ_G128,NVFP4] [--rows 1,4,8]
        [--only I,J,...] [--out FILE.json]

Kinds: AWQ_G128 (int4, zero points), GPTQ_G128 (int4, zero 8), Q4_0 (random GGUF blocks), NVFP4 (random E2M1
codes, E4M3 scales 0.5-4, global 0.002). The last lines are a table: us per call, GB/s of planes read.
"""
import argparse
import json

import torch

from voltllm.kernels.quant_dot import quant_dot
from voltllm.kernels.quant_gemv import dequantize, quant_matmul
from voltllm.kernels.quant_half2 import fits, half2_matmul, half2_rows_matmul
from voltllm.kernels.quant_mma import quant_mma_matmul
from voltllm.model.layers.gguf_planes import (NVFP4_KIND, Unpacked, int4_kind, map_planes, planes_from_blocks,
                                              random_blocks, to_planes)
from voltllm.worker.skinny_tuning import graph_replay_ms

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
# (form, (BLOCK_N, U, num_warps)): the first tiling's best tiles in session 27's s98, the second tiling's candidates
# (U / (32 num_warps) units per thread: 1 up to session 28's s100; 2 and 4 since, for more loads in flight per warp)
CONFIGS = [(half2_matmul, (2, 64, 4)), (half2_matmul, (2, 32, 2)), (half2_matmul, (4, 16, 2)),
           (half2_rows_matmul, (1, 64, 2)), (half2_rows_matmul, (2, 64, 2)), (half2_rows_matmul, (1, 128, 4)),
           (half2_rows_matmul, (2, 128, 4)), (half2_rows_matmul, (1, 32, 1)), (half2_rows_matmul, (2, 32, 1)),
           (half2_rows_matmul, (2, 64, 1)), (half2_rows_matmul, (2, 128, 1)), (half2_rows_matmul, (2, 128, 2)),
           (half2_rows_matmul, (1, 64, 1)), (half2_rows_matmul, (1, 128, 1)), (half2_rows_matmul, (2, 256, 2)),
           # (BLOCK_N, U, num_warps, stages): the loop's loads pipelined through shared memory (session 28)
           (half2_rows_matmul, (2, 32, 1, 2)), (half2_rows_matmul, (2, 32, 1, 3)), (half2_rows_matmul, (2, 32, 1, 4)),
           (half2_rows_matmul, (2, 64, 2, 3)), (half2_rows_matmul, (2, 128, 2, 3)), (half2_rows_matmul, (2, 64, 1, 3)),
           # (KU, num_warps[, stages]): the tensor-core form (kernels/quant_mma.py, sm_80+; 1-8 rows per weight read)
           (quant_mma_matmul, (4, 4)), (quant_mma_matmul, (8, 4)), (quant_mma_matmul, (2, 2)),
           (quant_mma_matmul, (4, 2)), (quant_mma_matmul, (1, 1)), (quant_mma_matmul, (4, 4, 3))]


def random_planes(kind: str, n: int, k: int, g: torch.Generator):
    if kind == "Q4_0":
        return planes_from_blocks(random_blocks(kind, n, k, g), kind, k, torch.device("cuda"))
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    if kind == "NVFP4":
        sc = torch.randint(0x30, 0x49, (n, k // 16), dtype=torch.uint8, generator=g).view(torch.int8)
        u = Unpacked(codes=codes, d=torch.full((n, -(-k // 256)), 0.002), m=None, sc=sc, mn=None)
        pk = NVFP4_KIND
    else:
        zp = kind == "AWQ_G128"
        pk = int4_kind(128, zp)
        u = Unpacked(codes=codes, d=(torch.rand(n, k // 128, generator=g) * 0.01 + 0.001).half(), m=None, sc=None,
                     mn=torch.randint(0, 16, (n, k // 128), dtype=torch.int8, generator=g) if zp else None)
    p = to_planes(u, pk)
    return map_planes(p, lambda t: t.to("cuda"), p.n)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="AWQ_G128,NVFP4,GPTQ_G128,Q4_0")
    ap.add_argument("--rows", default="1,4")  # (the tensor-core form: up to 16 rows per weight read: try 8, 16 too)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="time only these CONFIGS indices (comma-separated)")
    ap.add_argument("--baseline", default="fp32", choices=["fp32", "dot"],
                    help="what the times are compared with: the fp32 dequant-GEMV, or quant_dot (the engine's route "
                         "for 5-64 rows when the tensor-core form is not chosen)")
    args = ap.parse_args()
    baseline = quant_matmul if args.baseline == "fp32" else quant_dot
    kinds = args.kinds.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    results = {"check": [], "time": []}
    # correctness: every row count 1-7, odd N, against the dequantized weight in fp32
    for kind in kinds:
        for n, k in ((4096, 4096), (1000, 1536)):
            p = random_planes(kind, n, k, g)
            assert fits(p)
            w = dequantize(p, torch.float32)
            bias = torch.randn(n, device="cuda", dtype=torch.float16)
            for m in (1, 2, 3, 4, 5, 7):
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = x.float() @ w.T + bias.float()
                for form, cfg in CONFIGS[:1] + CONFIGS[3:5] + CONFIGS[9:11] + CONFIGS[16:17] + CONFIGS[21:23]:
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
                    form(x, p, bias, out=out, config=cfg)
                    old = quant_matmul(x, p, bias)
                    e_new, e_old = rel(out, ref), rel(old, ref)
                    ok = e_new < 3e-3 and not out.isnan().any()
                    results["check"].append({"kind": kind, "n": n, "k": k, "m": m, "form": form.__name__,
                                             "config": cfg, "rel_new": e_new,
                                             "rel_old": e_old, "ok": ok})
                    if not ok:
                        print(f"MISMATCH {kind} {n}x{k} m={m} {form.__name__} {cfg}: rel {e_new:.2e} (fp32 form "
                              f"{e_old:.2e})")
    bad = [c for c in results["check"] if not c["ok"]]
    worst = max(c["rel_new"] for c in results["check"])
    print(f"checks: {len(results['check'])} done, {len(bad)} bad, worst rel err {worst:.2e} (fp32 form "
          f"{max(c['rel_old'] for c in results['check']):.2e})", flush=True)
    table = []
    timed_configs = [CONFIGS[int(i)] for i in args.only.split(",")] if args.only else CONFIGS
    for kind in kinds:
        for n, k in SHAPES:
            first = random_planes(kind, n, k, g)
            copies = min(11, max(1, int(400e6 // first.nbytes)))
            rot = [first] + [map_planes(first, torch.clone, n) for _ in range(copies)]
            for m in rows_list:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                old_us = graph_replay_ms(lambda p: baseline(x, p), rot, reps=20) * 1e3
                timed = []
                for form, cfg in timed_configs:
                    tag = ({half2_rows_matmul: "rows", quant_mma_matmul: "mma"}.get(form, "h2"), *cfg)
                    try:
                        timed.append((graph_replay_ms(lambda p: form(x, p, config=cfg), rot, reps=20) * 1e3, tag))
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile / fit is reported
                        print(f"  {tag} failed: {type(e).__name__}: {str(e)[:100]}")
                timed.sort()
                best_us, best = timed[0]
                gbs = first.nbytes / best_us / 1e3
                h2_us = min((t for t, c in timed if c[0] == "h2"), default=float("nan"))
                rows_us = min((t for t, c in timed if c[0] == "rows"), default=float("nan"))
                mma_us = min((t for t, c in timed if c[0] == "mma"), default=float("nan"))
                row = {"kind": kind, "n": n, "k": k, "m": m, "old_us": old_us, "new_us": best_us, "best": best,
                       "h2_us": h2_us, "rows_us": rows_us, "mma_us": mma_us,
                       "new_GBps": gbs, "old_GBps": first.nbytes / old_us / 1e3,
                       "all": [(t, c) for t, c in timed]}
                results["time"].append(row)
                table.append(row)
                print(f"  {kind} {n}x{k} m{m}: " + ", ".join(f"{c}:{t:.1f}" for t, c in timed[:4]), flush=True)
    print(f"{'kind':>10} {'shape':>12} m   {args.baseline + ' us':>8} {'h2 us':>7} {'rows us':>7} {'mma us':>7}  "
          f"speedup  GB/s ({args.baseline} -> best)  tile")
    for r in table:
        print(f"{r['kind']:>10} {r['n']:>5}x{r['k']:<6} {r['m']:<2} {r['old_us']:8.1f} {r['h2_us']:7.1f} "
              f"{r['rows_us']:7.1f} {r['mma_us']:7.1f}  {r['old_us'] / r['new_us']:6.2f}x"
              f"  {r['old_GBps']:6.0f} -> {r['new_GBps']:6.0f}"
              f"  {r['best']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
