"""Decode attention after a short predecessor, with PDL: does prefetching the KV into L2 before the wait pay?

    PYTHONPATH=$PWD python3 benchmarks/micro/attn_prefetch_chain.py

In a decode step the paged decode kernel follows RoPE (a ~3 us latency-bound kernel that leaves HBM idle). This
replays, from a CUDA graph with PDL on, 36 pairs (RMSNorm of a [64, 4096] fp16 tensor standing in for RoPE, then
paged decode over its own layer's cache: qwen3-8b heads, 32 q / 8 kv, d128, page 16, L2 cold between layers) and
prints us per pair for each prefetch size, and the predecessor alone. Outputs are checked against the run without
prefetch (bit-equal: the hint changes no arithmetic).
"""
import torch

from graph_timing import graph_us
from voltllm.kernels import pdl
from voltllm.kernels.attention.paged_decode import choose_num_splits, decode_scratch_numel, paged_decode
from voltllm.kernels.fused import rms_norm

HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 16, 36


def layer_cache(lens, g):
    nblk = int(sum((n + PAGE - 1) // PAGE for n in lens)) + 1
    cache = torch.randn(2, nblk, PAGE, HKV, D, dtype=torch.float16, device="cuda", generator=g)
    perm = torch.randperm(nblk - 1, generator=torch.Generator().manual_seed(nblk)) + 1
    width = max((n + PAGE - 1) // PAGE for n in lens)
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    i = 0
    for r, n in enumerate(lens):
        k = (n + PAGE - 1) // PAGE
        bt[r, :k] = perm[i:i + k]
        i += k
    return cache, bt.cuda()


def run_case(bs, lo, hi, prefetches):
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.randint(lo, hi + 1, (bs,), generator=torch.Generator().manual_seed(bs + lo)).tolist()
    layers = [layer_cache(lens, g) for _ in range(LAYERS)]
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(bs, HQ, D, dtype=torch.float16, device="cuda", generator=g)
    x = torch.randn(bs, 4096, dtype=torch.float16, device="cuda", generator=g)
    w = torch.ones(4096, dtype=torch.float16, device="cuda")
    xo = torch.empty_like(x)
    outs = [torch.empty_like(q) for _ in range(LAYERS)]
    splits = choose_num_splits(bs, HKV, max(lens), 132)
    no, nl = decode_scratch_numel(bs, HQ, splits, D)
    po, pl = torch.empty(no, device="cuda"), torch.empty(nl, device="cuda")
    kv_bytes = sum(lens) * HKV * D * 2 * 2

    def chain(prefetch, attn=True):
        for (cache, bt), out in zip(layers, outs):
            rms_norm(x, w, 1e-6, out=xo)
            if attn:
                paged_decode(q, cache, bt, sl, qsl, 0.088, out, num_splits=splits, part_o=po, part_lse=pl,
                             prefetch_tokens=prefetch)

    pdl.configure(True)
    try:
        t_pred = graph_us(lambda i: chain(0, attn=False)) / LAYERS
        rows, ref = [], None
        for p in prefetches:
            t = graph_us(lambda i: chain(p)) / LAYERS
            got = torch.stack(outs).clone()
            if ref is None:
                ref = got
            same = torch.equal(got, ref)
            rows.append((p, t, same))
    finally:
        pdl.configure(False)
    print(f"bs={bs} ctx {lo}-{hi} splits={splits} KV/layer {kv_bytes / 1e6:.1f} MB | predecessor alone {t_pred:.1f} us")
    for p, t, same in rows:
        print(f"   prefetch {p:4d}: {t:6.1f} us per pair, attention ~{t - t_pred:5.1f} us "
              f"({kv_bytes / (t - t_pred) / 1e6:.2f} TB/s){'' if same else '  OUTPUT DIFFERS'}")


if __name__ == "__main__":
    for bs, lo, hi in ((64, 128, 256), (16, 128, 256), (64, 900, 1100), (1, 500, 700)):
        run_case(bs, lo, hi, (0, 64, 128, 256, 512))
