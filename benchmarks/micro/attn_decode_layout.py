"""Decode attention over two KV-cache layouts, same kernel, same call (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/micro/attn_decode_layout.py

The engine's cache is token-major per page, [2, blocks, PAGE, kv heads, D] ("NHD": a program reading one kv head
gets 256-byte pieces 2 KB apart at the 8B's heads). "HND" stores each page head-major, [2, blocks, kv heads, PAGE, D]
(one kv head's page is one contiguous 4 KB run), and hands the kernel the permuted view, so only the strides differ.
qwen3-8b heads (32 q / 8 kv, d128), random contexts and permuted pages, four caches rotated (cold L2), CUDA-graph
replays; every output is checked against an fp32 gather reference. Pages of 16 and 32 tokens. Prints per shape,
layout and tile the time and KV read rate; "default" is the backend's own tile for the card's SM count.
"""
import importlib

import torch
from attn_decode_ab import HKV, HQ, D, checked_us, reference
from paged_decode_case import paged_decode_case

pd = importlib.import_module("voltllm.kernels.attention.paged_decode")  # (the package exports the function)


def main():
    torch.manual_seed(0)
    scale = D ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = [(None, None, None), (32, 2, 3), (64, 2, 3), (64, 4, 3), (16, 2, 3)]
    table = []
    for bs, lo, hi in ((64, 128, 256), (64, 160, 190), (16, 128, 256), (64, 900, 1100), (1, 8000, 8200)):
        for page in (16, 32):
            torch.manual_seed(bs * lo + page)
            q, caches, bt, sl, qsl, _ = paged_decode_case(bs, lo, hi, HQ, HKV, D, page=page)
            kv_bytes = int(sl.sum()) * HKV * D * 2 * 2
            ref = reference(q, caches[0], bt, sl, scale)
            layouts = {f"NHD{page}": caches,
                       f"HND{page}": [c.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for c in caches]}
            splits = pd.choose_num_splits(bs, HKV, hi, sms)
            no, nl = pd.decode_scratch_numel(bs, HQ, splits, D)
            po, pl = torch.empty(no, device="cuda"), torch.empty(nl, device="cuda")
            out = torch.empty_like(q)
            print(f"bs={bs} ctx {lo}-{hi}, page {page}, {splits} split(s), KV {kv_bytes / 1e6:.1f} MB", flush=True)
            for name, cs in layouts.items():
                for bn, nw, ns in tiles:
                    kw = {"num_sms": sms} if bn is None else {"block_n": bn, "num_warps": nw, "num_stages": ns}

                    def f(i, cs=cs, kw=kw):
                        return pd.paged_decode(q, cs[i], bt, sl, qsl, scale, out, num_splits=splits, part_o=po,
                                               part_lse=pl, **kw)
                    timed = checked_us(f, out, ref, f"{name} {bn, nw, ns}")
                    if timed is None:
                        continue
                    t, err = timed
                    tile = "default" if bn is None else (bn, nw, ns)
                    print(f"  {name} {tile}: {t:.1f} us {kv_bytes / t / 1e6:.2f} TB/s rel. error {err:.1e}"
                          + ("" if err < 2e-3 else " WRONG"), flush=True)
                    table.append((bs, lo, hi, name, tile, t))
    print("\nshape            layout default   best (tile)")
    for bs, lo, hi in dict.fromkeys((r[0], r[1], r[2]) for r in table):
        for name in ("NHD16", "HND16", "NHD32", "HND32"):
            rows = [r for r in table if r[:4] == (bs, lo, hi, name)]
            if not rows:
                continue
            dflt = next((r[5] for r in rows if r[4] == "default"), float("nan"))
            best = min(rows, key=lambda r: r[5])
            print(f"{bs:3d} x {lo}-{hi:<6d} {name}  {dflt:7.1f}   {best[5]:7.1f} {best[4]}")


if __name__ == "__main__":
    main()
