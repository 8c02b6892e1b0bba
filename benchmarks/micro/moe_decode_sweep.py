"""Tiles of the decode-sized MoE expert GEMVs (voltllm.kernels.moe_decode.fused_experts_small), GPU.

    PYTHONPATH=$PWD python3 benchmarks/micro/moe_decode_sweep.py [--shape 35b|80b] [--tokens 1 2 4 8]
        [--tiles 4:4:2:512,8:8:4:1024,...]

One MoE layer's routed experts plus the shared expert (fp16), per token count: every tile (gate_up columns per
program : down columns per program : warps : gate_up K block) checked against the torch reference, then timed as
CUDA-graph replays of 50 calls with a cold L2 (each call reads other experts: the routing is re-drawn per call), beside the
bytes it must read (k + 1 experts' gate, up and down rows) as GB/s. Then, for the routed experts alone, the
unsorted GEMVs (default tiles) beside the grouped GEMM (voltllm.kernels.moe.fused_experts), the data for
moe_decode.SMALL_MAX_PAIRS (the batch size where SparseMoE switches from one to the other)."""
import argparse

import torch

from graph_timing import graph_us
from voltllm.kernels.moe import fused_experts
from voltllm.kernels.moe_decode import SMALL_MAX_PAIRS, fused_experts_small, moe_route
from voltllm.model.layers.moe import fused_experts_ref

SHAPES = {"35b": (2048, 256, 8, 512, 512), "80b": (2048, 512, 10, 512, 512)}  # H, E, k, I, shared I


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="35b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 2, 4, 8, 16, 24, 32])
    ap.add_argument("--tiles", default="4:4:2:512,4:4:2:256,4:4:2:2048,4:4:4:2048,8:8:4:512,8:8:4:1024,"
                                       "2:4:2:1024,4:8:2:512,16:16:4:256")
    args = ap.parse_args()
    h, e, k, inter, sinter = SHAPES[args.shape]
    dt = torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=g).to(dt) * h ** -0.5
    w2 = torch.randn(e, h, inter, device="cuda", generator=g).to(dt) * inter ** -0.5
    ws13 = torch.randn(2 * sinter, h, device="cuda", generator=g).to(dt) * h ** -0.5
    ws2 = torch.randn(h, sinter, device="cuda", generator=g).to(dt) * sinter ** -0.5
    wsg = torch.randn(1, h, device="cuda", generator=g).to(dt) * h ** -0.5
    for t in args.tokens:
        x = torch.randn(t, h, device="cuda", generator=g).to(dt)
        logits = [torch.randn(t, e, device="cuda", generator=g) for _ in range(50)]
        routes = [moe_route(lg, k, True, shared_gate=(x, wsg)) for lg in logits]
        w, ids = routes[0]
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w[:, :k], ids[:, :k].long())
        nbytes = t * (k * 3 * inter + 3 * sinter) * h * 2
        print(f"T={t}: {nbytes / 1e6:.1f} MB of expert rows per call", flush=True)
        for spec in args.tiles.split(","):
            tiles = tuple(int(v) for v in spec.split(":"))
            try:
                got = fused_experts_small(x, w13, w2, w, ids, shared=(ws13, ws2), tiles=tiles).float()
                gu = x.float() @ ws13.float().t()
                want = ref + torch.sigmoid(x.float() @ wsg.float().t()) * (
                    (torch.nn.functional.silu(gu[:, :sinter]) * gu[:, sinter:]) @ ws2.float().t())
                err = ((got - want).abs().max() / want.abs().max()).item()
                us = graph_us(lambda i: fused_experts_small(x, w13, w2, *routes[i], shared=(ws13, ws2),
                                                            tiles=tiles), reps=50)
                print(f"  tiles {spec:<10} {us:7.1f} us  {nbytes / us / 1e3:6.0f} GB/s  rel err {err:.1e}", flush=True)
            except Exception as ex:  # a tile that does not compile is reported, not fatal
                print(f"  tiles {spec:<10} failed: {type(ex).__name__}: {str(ex)[:100]}", flush=True)
        routed = [moe_route(lg, k, True) for lg in logits]
        small = graph_us(lambda i: fused_experts_small(x, w13, w2, *routed[i]), reps=50)
        grouped = graph_us(lambda i: fused_experts(x, w13, w2, *routed[i]), reps=50)
        print(f"  routed experts only ({t * k} pairs; the layer's switch is at {SMALL_MAX_PAIRS}): unsorted GEMVs "
              f"{small:.1f} us, grouped GEMM {grouped:.1f} us", flush=True)


if __name__ == "__main__":
    main()
