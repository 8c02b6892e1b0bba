"""A decode batch over a paged KV cache for the attention micros (GPU): random context lengths, pages handed out in
a random permutation (page 0 unused), four caches to rotate through so the L2 stays cold.

    from paged_decode_case import paged_decode_case  # (the scripts run as `python3 benchmarks/micro/<name>.py`)
"""
import torch

PAGE = 16


def paged_decode_case(bs, lo, hi, hq, hkv, d, kv="fp16", page=PAGE):
    """(q [bs, hq, d], caches (4 x [2, blocks, page, hkv, d]), block tables, seq_lens int32, query_start_loc, seq_lens
    on the CPU); kv "fp8_e4m3": the caches hold the uint8 codes torch's float8 conversion gives (the software codec
    is bit-exact with it)."""
    lens = torch.randint(lo, hi + 1, (bs,))
    nblk = int(sum((n + page - 1) // page for n in lens.tolist())) + 1
    caches = [torch.randn(2, nblk, page, hkv, d, dtype=torch.float16, device="cuda") for _ in range(4)]
    if kv == "fp8_e4m3":
        caches = [c.to(torch.float8_e4m3fn).view(torch.uint8) for c in caches]
    perm = torch.randperm(nblk - 1) + 1
    width = int(max((n + page - 1) // page for n in lens.tolist()))
    bt = torch.zeros(bs, width, dtype=torch.int32)
    i = 0
    for r, n in enumerate(lens.tolist()):
        pages = (n + page - 1) // page
        bt[r, :pages] = perm[i:i + pages]
        i += pages
    q = torch.randn(bs, hq, d, dtype=torch.float16, device="cuda")
    qsl = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
    return q, caches, bt.cuda(), lens.to(torch.int32).cuda(), qsl, lens
