"""FMA-route decode attention (the sm_70 / sm_75 / --compat route: no tensor cores) against the tl.dot route (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/micro/attn_decode_fma.py [fp8]

For three head layouts (qwen3-8b: 32 q / 8 kv heads, d128; SmolLM2: 9 / 3, d64; Qwen2.5-0.5B: 14 / 2, d64) and a few
decode batches, times paged_decode from CUDA-graph replays over four rotated caches: the tl.dot route, the FMA per-row
route and the FMA per-lane route at several (BLOCK_N, warps), the default tile also with its next-tile register
prefetch (session 40); then the same for an fp8 e4m3 cache (uint8 codes, the
software decode) at the 8B heads. Prints microseconds, the KV read rate and the relative error against the tl.dot
route's output (fp32 accumulation on both).
"""
import sys

import torch
from graph_timing import graph_us
from paged_decode_case import paged_decode_case
from voltllm.kernels.attention.paged_decode import choose_num_splits, decode_scratch_numel, paged_decode

torch.manual_seed(0)
SHAPES = {"8b": (32, 8, 128), "smollm2": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64)}
CASES = {"8b": ((64, 128, 256), (64, 900, 1100), (8, 8000, 8200), (1, 32000, 32100)),
         "smollm2": ((1, 500, 700), (64, 128, 256), (8, 4000, 4100)),
         "qwen2.5-0.5b": ((1, 8000, 8100), (64, 900, 1100))}
LANE_TILES = ((8, 4), (16, 2), (16, 4), (32, 4), (32, 8))
# (shape, kv cache): the fp8 runs repeat the 8B cases with e4m3 codes
RUNS = [(shape, "fp16") for shape in SHAPES] + [("8b", "fp8_e4m3")]
if sys.argv[1:] == ["fp8"]:  # only the fp8 runs
    RUNS = RUNS[-1:]


rows = []
for shape, kv in RUNS:
    hq, hkv, d = SHAPES[shape]
    fmt = {"fp16": {}, "fp8_e4m3": {"kv_fmt": 0}}[kv]
    for bs, lo, hi in CASES[shape]:
        q, caches, bt, sl, qsl, lens = paged_decode_case(bs, lo, hi, hq, hkv, d, kv)
        kv_bytes = int(lens.sum()) * hkv * d * 2 * caches[0].element_size()
        splits = choose_num_splits(bs, hkv, hi, 132)
        no, nl = decode_scratch_numel(bs, hq, splits, d)
        po, pl = torch.empty(no, device="cuda"), torch.empty(nl, device="cuda")
        out = torch.empty_like(q)
        variants = [("dot", dict(use_dot=True))] + ([("dot hw-e4m3", dict(use_dot=True, kv_fmt=2))] if fmt else [])
        variants += [("fma rows", dict(use_dot=False)),
                    ("fma lanes default", dict(use_dot=False, fma_lanes=True, next_tile=False)),
                    ("fma lanes default, next tile", dict(use_dot=False, fma_lanes=True, next_tile=True))]
        variants += [(f"fma lanes n{bn} w{w}",
                      dict(use_dot=False, fma_lanes=True, block_n=bn, num_warps=w, next_tile=False))
                     for bn, w in LANE_TILES]
        ref = None
        for name, kw in variants:
            def run(i, kw=kw):
                paged_decode(q, caches[i], bt, sl, qsl, d ** -0.5, out, num_splits=splits, part_o=po, part_lse=pl,
                             num_sms=132, **{**fmt, **kw})
            try:
                run(0)
                torch.cuda.synchronize()
                if ref is None:
                    ref = out.float().clone()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = graph_us(lambda i: run(i % 4), reps=8, replays=3)
            except Exception as ex:  # a tile that does not compile for this shape
                print("fail", shape, bs, name, str(ex)[:100])
                continue
            rows.append((f"{shape} {kv}", f"{bs} x {lo}-{hi}", splits, name, us, kv_bytes / us / 1e6, err))
            print(f"{shape:13s} {kv:8s} {bs:3d} x {lo}-{hi:<6d} splits {splits:2d} {name:18s} {us:8.1f} us "
                  f"{kv_bytes / us / 1e6:6.2f} TB/s err {err:.1e}", flush=True)

print("\nshape | batch x context | splits | route | us | TB/s | rel err vs dot")
for r in rows:
    print(f"{r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]:.2f} | {r[6]:.1e}")
