"""Decode attention tile sweep (voltllm.kernels.attention.paged_decode) at decode batch shapes (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/micro/attn_decode_sweep.py [short | long]

qwen3-8b heads (32 q / 8 kv, d128, page 16), random contexts, four caches rotated, CUDA-graph replays;
prints the default tile and the five fastest (split count, BLOCK_N, warps, stages) per shape.
"""
import itertools
import sys

import torch
from graph_timing import graph_us
from paged_decode_case import paged_decode_case
from voltllm.kernels.attention.paged_decode import paged_decode, decode_scratch_numel, choose_num_splits
torch.manual_seed(0)
HQ, HKV, D = 32, 8, 128
# (BLOCK_N, warps, stages); `short` (argument): page-sized and deeper pipelines at the short-context shapes
TILES = list(itertools.product((32, 64), (4, 8), (1, 2, 3)))
CASES = ((64, 128, 256), (64, 900, 1100), (16, 128, 256), (1, 500, 700), (1, 8000, 8200))
if sys.argv[1:] == ["short"]:
    TILES = list(itertools.product((16, 32, 64), (2, 4), (2, 3, 4, 6)))
    CASES = ((64, 128, 256), (16, 128, 256), (64, 900, 1100))
if sys.argv[1:] == ["long"]:  # fewer, longer contexts (split-KV)
    TILES = list(itertools.product((32, 64), (2, 4, 8), (2, 3, 4)))
    CASES = ((1, 500, 700), (1, 8000, 8200), (4, 2000, 4000))
for bs, lo, hi in CASES:
    q, caches, bt, sl, qsl, lens = paged_decode_case(bs, lo, hi, HQ, HKV, D)
    kvbytes = int(lens.sum()) * HKV * D * 2 * 2
    out = torch.empty_like(q)
    ref = None
    res = []
    base_splits = choose_num_splits(bs, HKV, 40960, 132)
    for splits in sorted({1, 2, 4, base_splits}):
        no, nl = decode_scratch_numel(bs, HQ, splits, D)
        po = torch.empty(no, device="cuda"); pl = torch.empty(nl, device="cuda")
        for bn, nw, ns in TILES:
            try:
                f = lambda i: paged_decode(q, caches[i], bt, sl, qsl, 0.088, out, num_splits=splits, part_o=po, part_lse=pl,
                                           block_n=bn, num_warps=nw, num_stages=ns)
                f(0); torch.cuda.synchronize()
                if ref is None: ref = out.clone()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 5e-3: print("bad", bs, splits, bn, nw, ns, err); continue
                t = graph_us(lambda i: f(i % 4), reps=20, replays=2)
            except Exception as ex:
                print("fail", bs, splits, bn, nw, ns, str(ex)[:80]); continue
            res.append((t, splits, bn, nw, ns))
    res.sort()
    default = [r for r in res if r[1] == base_splits and r[2] == 64 and r[3] == 4 and r[4] == 3]
    print(f"bs={bs} ctx {lo}-{hi} KV {kvbytes/1e6:.1f}MB | default {default[0] if default else None} {kvbytes/default[0][0]/1e6 if default else 0:.2f}TB/s")
    for r in res[:5]:
        print(f"   {r[0]:7.1f}us {kvbytes/r[0]/1e6:5.2f}TB/s splits={r[1]} block_n={r[2]} warps={r[3]} stages={r[4]}")
