"""The greedy LM head at decode rows (GPU): cuBLAS + row_argmax, the decode-batch Triton tile + row_argmax, and the
same tiles with the argmax in their epilogue (batch_gemm's argmax_out: no logits written; argmax_of_partials
combines the tiles), replayed from CUDA graphs with PDL on, as the engine runs them after its decode graph.

    PYTHONPATH=$PWD python3 benchmarks/micro/head_argmax.py [--vocab 151936] [--hidden 4096] [--rows 16,32,64]

One head weight of the 8B's shape (1.2 GB: each call reads it from DRAM, the L2 holds 50-60 MB). Every epilogue
tile's tokens are checked against its plain tile's argmax first; prints one line per row count and tile.
"""
import argparse

import torch

from voltllm.kernels import pdl
from voltllm.kernels.batch_gemm import CONFIGS, TMA_CONFIGS, batch_gemm, tma_supported
from voltllm.sampling.sampler import greedy_tokens
from voltllm.worker.skinny_tuning import graph_replay_ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", default="16,32,64")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    args = p.parse_args()
    dt = getattr(torch, args.dtype)
    torch.manual_seed(0)
    w = torch.randn(args.vocab, args.hidden, dtype=dt, device="cuda") / args.hidden ** 0.5
    configs = [c for c in CONFIGS + (TMA_CONFIGS if tma_supported(w.device) else ()) if c[4] == 1]
    pdl.configure(True)
    print(f"head {args.vocab} x {args.hidden} {args.dtype}, {w.numel() * w.element_size() / 1e9:.2f} GB", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.hidden, dtype=dt, device="cuda")
        out = torch.empty(rows, dtype=torch.long, device="cuda")
        t_lib = graph_replay_ms(lambda w_: greedy_tokens(torch.nn.functional.linear(x, w_)), [w], reps=8) * 1e3
        print(f"M={rows:<3} cuBLAS + argmax kernel {t_lib:7.1f} us", flush=True)
        for cfg in configs:
            try:
                same = torch.equal(batch_gemm(x, w, config=cfg, argmax_out=out),
                                   batch_gemm(x, w, config=cfg).argmax(dim=-1))
            except Exception as e:  # noqa: BLE001 - a tile this card cannot hold
                print(f"  {cfg}: skipped ({type(e).__name__})", flush=True)
                continue
            t_sep = graph_replay_ms(lambda w_: greedy_tokens(batch_gemm(x, w_, config=cfg)), [w], reps=8) * 1e3
            t_fused = graph_replay_ms(lambda w_: batch_gemm(x, w_, config=cfg, argmax_out=out), [w], reps=8) * 1e3
            print(f"  {str(cfg):<26} tile + argmax kernel {t_sep:7.1f} us, argmax epilogue {t_fused:7.1f} us"
                  f"{'' if same else '  TOKENS DIFFER'}", flush=True)
    pdl.configure(False)


if __name__ == "__main__":
    main()
