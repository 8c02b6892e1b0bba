"""Where the chunked gated-delta-rule prefill spends its time (GPU): torch chunked form vs the Triton kernels.

    PYTHONPATH=$PWD python3 benchmarks/micro/gdn_chunk_sweep.py [--hk 16 --hv 48 --d 128] [--lens 8192 2048x4]

qwen3.5-27b-shape GDN heads by default, fp16 q/k/v, fp32 state. For each batch (one 8192-token prompt, four of
2048 tokens): the torch chunked form (gdn_ref.gated_delta_rule_varlen), then every Triton variant
(voltllm.kernels.gdn_chunk.gated_delta_rule_chunked with its precision / block_v / num_warps knobs), each checked
against the torch output first (relative error printed) and timed with CUDA events (median of 5 after a warm-up);
one profiled call per variant splits the time between the kernels."""
import argparse

import torch

from _micro_timing import event_ms as _ms, kernel_times_us

from voltllm.kernels import gdn_chunk, gdn_ref


def _inputs(lens, hk, hv, d, dtype=torch.float16):
    t = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, hk, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(t, hk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(t, hv, d, device="cuda", generator=g).to(dtype)
    gate = -torch.rand(t, hv, device="cuda", generator=g) * 0.5  # log decay per token, as the model's g (<= 0)
    beta = torch.rand(t, hv, device="cuda", generator=g)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return q, k, v, gate, beta, qsl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hk", type=int, default=16)
    ap.add_argument("--hv", type=int, default=48)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--lens", nargs="*", default=["8192", "2048x4"])
    ap.add_argument("--variants", default="ieee:64:8,tf32:64:8,tf32:32:4,tf32:32:8,tf32:16:4",
                    help="precision:block_v:num_warps[:num_stages[:prep_warps[:prep_stages]]], a trailing :h for the "
                         "HOIST form (:h2, :h4: with the prep / hoist dots in 2 / 4 pieces of the key dimension); "
                         "comma separated")
    args = ap.parse_args()
    for spec in args.lens:
        n, _, c = spec.partition("x")
        lens = [int(n)] * int(c or 1)
        q, k, v, gate, beta, qsl = _inputs(lens, args.hk, args.hv, args.d)
        slots = torch.arange(len(lens), device="cuda")
        init = torch.zeros(len(lens), dtype=torch.bool, device="cuda")
        states = torch.zeros(len(lens), args.hv, args.d, args.d, device="cuda")

        def ref():
            return gdn_ref.gated_delta_rule_varlen(q, k, v, gate, beta, states, slots, qsl, init)

        want = ref().float()
        print(f"{spec}: torch chunked form {_ms(ref):.2f} ms", flush=True)
        for var in args.variants.split(","):
            prec, bv, warps, *rest = var.split(":")
            hoist = bool(rest) and rest[-1].startswith("h")
            split = int(rest[-1][1:] or 1) if hoist else None
            rest = rest[:-1] if hoist else rest
            stages, pw, ps = (int(x) if x else None for x in (rest + [""] * 3)[:3])

            def tri(prec=prec, bv=int(bv), warps=int(warps), stages=stages, pw=pw, ps=ps, hoist=hoist, split=split):
                return gdn_chunk.gated_delta_rule_chunked(q, k, v, gate, beta, states, slots, qsl, init,
                                                          block_v=bv, precision=prec, num_warps=warps,
                                                          num_stages=stages, prep_warps=pw, prep_stages=ps,
                                                          hoist=hoist, split=split)
            try:
                got = tri().float()
                err = ((got - want).norm() / want.norm()).item()
                ms = _ms(tri)
                ks = {k: t / 1e3 for k, t in kernel_times_us(tri, 40).items()}
                parts = ", ".join(f"{name} {t:.2f}" for name, t in sorted(ks.items(), key=lambda x: -x[1])[:3])
                print(f"  triton {var:<20} {ms:8.2f} ms  rel err {err:.1e}  [{parts}]", flush=True)
            except Exception as e:  # a variant that does not compile or fit is reported, not fatal
                print(f"  triton {var:<20} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
