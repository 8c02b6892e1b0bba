"""Decode attention at one KV volume spread over more or fewer programs (GPU only): what a program's fixed cost is.

    PYTHONPATH=$PWD python3 benchmarks/micro/attn_decode_programs.py

qwen3-8b heads (32 q / 8 kv, d128, page 16). The same ~11K context tokens as 32 x ~344, 64 x ~172 (#4's step), 128 x
~86 and 256 x ~43 sequences (256 / 512 / 1024 / 2048 programs at one split), and 64 x ~172 at 2 and 4 splits (with the
reduce launch); four caches rotated (cold L2), CUDA-graph replays, outputs checked against an fp32 reference. If the
time stays flat across the rows the launch is bandwidth-bound; if it grows with the program count, each program's
start (its first loads) and end cost what a persistent kernel would save.
"""
import importlib

import torch
from attn_decode_ab import HKV, HQ, D, checked_us, reference
from paged_decode_case import paged_decode_case

pd = importlib.import_module("voltllm.kernels.attention.paged_decode")  # (the package exports the function)


def main():
    scale = D ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'sequences x context':>22} {'splits':>6} {'programs':>8} {'KV MB':>6} {'us':>7} {'TB/s':>6} "
          f"{'us/program-wave':>15}")
    for bs, mid, splits in ((32, 344, 1), (64, 172, 1), (128, 86, 1), (256, 43, 1), (64, 172, 2), (64, 172, 4)):
        torch.manual_seed(bs * mid + splits)
        lo, hi = mid - mid // 12, mid + mid // 12
        q, caches, bt, sl, qsl, _ = paged_decode_case(bs, lo, hi, HQ, HKV, D)
        kv_bytes = int(sl.sum()) * HKV * D * 2 * 2
        ref = reference(q, caches[0], bt, sl, scale)
        no, nl = pd.decode_scratch_numel(bs, HQ, splits, D)
        po, pl = torch.empty(no, device="cuda"), torch.empty(nl, device="cuda")
        out = torch.empty_like(q)

        def f(i):
            return pd.paged_decode(q, caches[i], bt, sl, qsl, scale, out, num_splits=splits, part_o=po, part_lse=pl,
                                   num_sms=sms)
        timed = checked_us(f, out, ref, f"{bs} x {lo}-{hi}")
        if timed is None:
            continue
        t, err = timed
        programs = bs * HKV * splits
        print(f"{bs:>12} x {lo}-{hi:<5} {splits:>6} {programs:>8} {kv_bytes / 1e6:6.1f} {t:7.1f} "
              f"{kv_bytes / t / 1e6:6.2f} {t / max(1.0, programs / sms):15.2f}" + ("" if err < 2e-3 else " WRONG"),
              flush=True)


if __name__ == "__main__":
    main()
