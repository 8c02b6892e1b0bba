"""The sparse-MoE kernels above decode size, GPU: grouped GEMM tiles for prompt-sized batches, the one-launch
`moe_align` vs its torch form, and the router's warps.

    PYTHONPATH=$PWD python3 benchmarks/micro/moe_grouped_sweep.py [--shape 35b|80b] [--tokens 512 2048 8192]
        [--configs 64:128:64:8:3,128:128:64:8:3,...] [--align-pairs 512 1024 2048 4096]

One MoE layer's routed experts (fp16, random weights, softmax top-k routing of random logits). For each token
count: every grouped-GEMM config (BLOCK_M : BLOCK_N : BLOCK_K : warps : stages) of voltllm.kernels.moe.fused_experts,
checked against the torch reference and timed as CUDA-graph replays, as TFLOP/s of the pairs' useful work (2 * 3 * I
* H per pair), beside the config pick_config chooses. Then moe_align per pair count, Triton (one launch) vs torch;
then moe_route at 1 / 2 / 4 warps per token."""
import argparse

import torch

from graph_timing import graph_us
from voltllm.kernels.moe import fused_experts, moe_align, pick_config
from voltllm.kernels.moe_decode import moe_route
from voltllm.model.layers.moe import fused_experts_ref

SHAPES = {"35b": (2048, 256, 8, 512), "80b": (2048, 512, 10, 512)}  # H, E, k, I
CONFIGS = "64:128:64:8:3,64:128:64:4:4,128:128:64:8:3,128:128:32:8:4,64:64:64:4:3,128:64:64:4:3,64:256:64:8:3"


def _config(spec: str) -> dict:
    bm, bn, bk, w, s = (int(v) for v in spec.split(":"))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="35b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=[512, 2048, 8192])
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--align-pairs", nargs="*", type=int, default=[256, 512, 1024, 2048, 4096])
    args = ap.parse_args()
    h, e, k, inter = SHAPES[args.shape]
    dt = torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=g).to(dt) * h ** -0.5
    w2 = torch.randn(e, h, inter, device="cuda", generator=g).to(dt) * inter ** -0.5
    for t in args.tokens:
        x = torch.randn(t, h, device="cuda", generator=g).to(dt)
        w, ids = moe_route(torch.randn(t, e, device="cuda", generator=g), k, True)
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids.long())
        flop = t * k * 2 * 3 * inter * h
        print(f"T={t} ({t * k} pairs; pick_config: {pick_config(t * k, e)})", flush=True)
        for spec in args.configs.split(","):
            try:
                cfg = _config(spec)
                got = fused_experts(x, w13, w2, w, ids, config=cfg).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                us = graph_us(lambda i: fused_experts(x, w13, w2, w, ids, config=cfg), reps=3)
                print(f"  config {spec:<16} {us:8.1f} us  {flop / us / 1e6:6.1f} TFLOP/s  rel err {err:.1e}", flush=True)
            except Exception as ex:  # a config that does not compile or fit is reported, not fatal
                print(f"  config {spec:<16} failed: {type(ex).__name__}: {str(ex)[:100]}", flush=True)
    for p in args.align_pairs:
        ids = torch.randint(0, e, (p // k, k), device="cuda", generator=g, dtype=torch.int32)
        tri = graph_us(lambda i: moe_align(ids, e, 64, use_triton=True), reps=5)
        ref_us = graph_us(lambda i: moe_align(ids, e, 64, use_triton=False), reps=5)
        print(f"moe_align {p:5d} pairs: Triton {tri:7.1f} us, torch {ref_us:7.1f} us", flush=True)
    for t in (1, 16, 64):
        x = torch.randn(t, h, device="cuda", generator=g).to(dt)
        wsg = torch.randn(h, device="cuda", generator=g).to(dt)
        logits = torch.randn(t, e, device="cuda", generator=g)
        times = {nw: graph_us(lambda i: moe_route(logits, k, True, shared_gate=(x, wsg), num_warps=nw), reps=20)
                 for nw in (1, 2, 4)}
        print(f"moe_route T={t}: " + ", ".join(f"{nw} warps {us:.1f} us" for nw, us in times.items()), flush=True)


if __name__ == "__main__":
    main()
