"""Prefill attention tile sweep (voltllm.kernels.attention.paged_prefill) for batches of short prompts (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/micro/attn_prefill_sweep.py

qwen3-8b heads (32 q / 8 kv, d128, page 16), fp16; each case is N prompts of L tokens with no prefix (the 64 x 128
prompt phase of the concurrency benchmark, and others), CUDA-graph replays. Prints the default tile, the five
fastest (BLOCK_M, BLOCK_N, warps, stages) and torch SDPA (flash) on the same prompts as dense [N, H, L, D] tensors,
as causal TFLOP/s (the causal half of the QK^T and PV products).
"""
import itertools

import torch
import torch.nn.functional as F

from graph_timing import graph_us
from voltllm.kernels.attention.paged_prefill import paged_prefill, prefill_config

HQ, HKV, D, PAGE = 32, 8, 128, 16


def case(n, length):
    nblk = n * (length // PAGE) + 1
    cache = torch.randn(2, nblk, PAGE, HKV, D, dtype=torch.float16, device="cuda")
    bt = (torch.arange(n * (length // PAGE), dtype=torch.int32, device="cuda") + 1).view(n, length // PAGE)
    q = torch.randn(n * length, HQ, D, dtype=torch.float16, device="cuda")
    sl = torch.full((n,), length, dtype=torch.int32, device="cuda")
    qsl = torch.arange(n + 1, dtype=torch.int32, device="cuda") * length
    return q, cache, bt, sl, qsl


def main():
    for n, length in ((64, 128), (16, 128), (8, 512), (1, 8192)):
        q, cache, bt, sl, qsl = case(n, length)
        out = torch.empty_like(q)
        flop = n * HQ * D * 4 * length * (length + 1) / 2
        res, ref = [], None
        for cfg in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3)):
            try:
                f = lambda i: paged_prefill(q, cache, bt, sl, qsl, 0.088, out, max_query_len=length,  # noqa: E731
                                            config=cfg, capability=(9, 0))
                f(0)
                torch.cuda.synchronize()
                if ref is None:
                    ref = out.clone()
                if ((out.float() - ref.float()).norm() / ref.float().norm()).item() > 5e-3:
                    print("bad", cfg)
                    continue
                res.append((graph_us(f, reps=10, replays=1), cfg))
            except Exception as ex:  # a tile this GPU cannot hold
                print("fail", cfg, str(ex)[:60])
        res.sort()
        default = prefill_config(D, HQ // HKV, length, (9, 0))
        t_def = next(t for t, c in res if c == default)
        # SDPA on dense per-prompt tensors (K/V expanded to the q heads): what a vendor flash kernel does
        qd = torch.randn(n, HQ, length, D, dtype=torch.float16, device="cuda")
        kd = torch.randn(n, HQ, length, D, dtype=torch.float16, device="cuda")
        vd = torch.randn_like(kd)
        t_sdpa = graph_us(lambda i: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True), reps=10, replays=1)
        print(f"{n} x {length}: default {default} {t_def:.1f} us ({flop / t_def / 1e6:.0f} TFLOP/s); "
              f"SDPA {t_sdpa:.1f} us ({flop / t_sdpa / 1e6:.0f} TFLOP/s)")
        for t, c in res[:5]:
            print(f"   {t:8.1f} us {flop / t / 1e6:5.0f} TFLOP/s  (BLOCK_M, BLOCK_N, warps, stages) = {c}")


if __name__ == "__main__":
    main()
