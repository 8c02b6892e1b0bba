"""Tiles of the Gated DeltaNet decode step (voltllm.kernels.gdn_decode.gated_delta_rule_decode), GPU.

    PYTHONPATH=$PWD python3 benchmarks/micro/gdn_decode_sweep.py [--shape 35b|27b] [--batch 1 16 64]
        [--tiles 32:4,16:2,16:4,64:4,64:8,128:8]

One GDN layer's decode step (fp16 q / k / v, raw gate projections, fp32 state pool) per batch size: every tile
(value columns per program : warps) checked against the torch reference (gdn_ref, decode rows), then timed as
CUDA-graph replays of 20 calls over different slots of a pool larger than L2, beside the bytes the step must move
(each request's [Hv, Dk, Dv] fp32 state read and written) as GB/s. The default tile is the first listed."""
import argparse

import torch
import torch.nn.functional as F

from graph_timing import graph_us
from voltllm.kernels import gdn_ref
from voltllm.kernels.gdn_decode import gated_delta_rule_decode

SHAPES = {"35b": (16, 32, 128), "27b": (16, 48, 128)}  # key heads, value heads, head dim


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="35b", choices=sorted(SHAPES))
    ap.add_argument("--batch", nargs="*", type=int, default=[1, 16, 64])
    ap.add_argument("--tiles", default="32:4,16:2,16:4,64:4,64:8,128:8")
    args = ap.parse_args()
    hk, hv, d = SHAPES[args.shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    a_log = torch.randn(hv, device="cuda", generator=g)
    dt_bias = torch.randn(hv, device="cuda", generator=g)
    for bsz in args.batch:
        reps = 20
        pool = torch.randn(reps * bsz, hv, d, d, device="cuda", generator=g) * 0.1
        q, k = (torch.randn(bsz, hk, d, device="cuda", generator=g).half() for _ in range(2))
        v = torch.randn(bsz, hv, d, device="cuda", generator=g).half()
        a, b = (torch.randn(bsz, hv, device="cuda", generator=g).half() for _ in range(2))
        init = torch.ones(bsz, dtype=torch.bool, device="cuda")
        slot_sets = [torch.arange(i * bsz, (i + 1) * bsz, device="cuda") for i in range(reps)]
        gl = -a_log.exp() * F.softplus(a.float() + dt_bias)
        ref_pool = pool.clone()
        ref = gdn_ref.gated_delta_rule_varlen(q, k, v, gl, torch.sigmoid(b.float()), ref_pool, slot_sets[0],
                                              list(range(bsz + 1)), init, decode_only=True)
        nbytes = 2 * bsz * hv * d * d * 4
        print(f"B={bsz}: {nbytes / 1e6:.1f} MB of state read + written per step", flush=True)
        for spec in args.tiles.split(","):
            bv, warps = (int(x) for x in spec.split(":"))
            try:
                trial = pool.clone()
                out = gated_delta_rule_decode(q, k, v, a, b, trial, slot_sets[0], init, gate_params=(a_log, dt_bias),
                                              block_v=bv, num_warps=warps)
                err = max(((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item(),
                          ((trial - ref_pool).abs().max() / ref_pool.abs().max()).item())
                us = graph_us(lambda i: gated_delta_rule_decode(q, k, v, a, b, trial, slot_sets[i], init,
                                                                gate_params=(a_log, dt_bias), block_v=bv,
                                                                num_warps=warps), reps=reps)
                print(f"  tile {spec:<6} {us:7.1f} us  {nbytes / us / 1e3:6.0f} GB/s  rel err {err:.1e}", flush=True)
            except Exception as ex:  # a tile that does not compile is reported, not fatal
                print(f"  tile {spec:<6} failed: {type(ex).__name__}: {str(ex)[:100]}", flush=True)


if __name__ == "__main__":
    main()
