"""Host cost of the GDN prefill conv1d over a batch of many requests: one conv per request vs one conv in all.

    PYTHONPATH=$PWD python3 benchmarks/micro/conv_varlen_ops.py [--requests 64] [--tokens 128] [--channels 16]
        [--device cpu]

`gdn_ref.causal_conv1d_varlen` used to loop over the step's requests (state read, concat, F.conv1d, SiLU, state
write each, and a host sync per request for its slot number); it now stacks every request's [state | tokens] block
and runs one depthwise conv (`gdn_ref.conv_plan`). With few channels the time is the per-op dispatch cost, the
part that grows with the number of requests; the script counts the torch ops each form dispatches
(torch.profiler, CPU) and times both (median of 20 calls, the plan built once per step as the layer does)."""
import argparse
import statistics
import time

import torch

from voltllm.kernels import gdn_ref as R


def per_request(x, w, pool, slots, qsl, init):
    """The loop form (before session 18), kept here for the comparison."""
    out = torch.zeros_like(x)
    flags = init.tolist()
    for i in range(len(qsl) - 1):
        s, e = qsl[i], qsl[i + 1]
        if e == s:
            continue
        slot = int(slots[i])
        y, new = R.causal_conv1d(x[s:e], w, None, pool[slot] if flags[i] else None, "silu")
        out[s:e] = y
        pool[slot] = new.to(pool.dtype)
    return out


def _ms(fn, reps=20):
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _ops(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--kernel", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    n, L, C, K = args.requests, args.tokens, args.channels, args.kernel
    qsl = [i * L for i in range(n + 1)]
    x = torch.randn(n * L, C, device=dev)
    w = torch.randn(C, K, device=dev)
    pool = torch.randn(n, K - 1, C, device=dev)
    slots = torch.arange(n, device=dev)
    init = torch.ones(n, dtype=torch.bool, device=dev)
    a, b = pool.clone(), pool.clone()
    torch.testing.assert_close(per_request(x, w, a, slots, qsl, init),
                               R.causal_conv1d_varlen(x, w, None, b, slots, qsl, init))
    torch.testing.assert_close(a, b)

    def loop():
        return per_request(x, w, pool.clone(), slots, qsl, init)

    def one(plan=R.conv_plan(qsl, K, dev)):
        return R.causal_conv1d_varlen(x, w, None, pool.clone(), slots, qsl, init, plan=plan)

    print(f"{n} requests x {L} tokens, {C} channels, kernel {K}, {dev}")
    print(f"{'form':<22} {'ms per layer':>13} {'aten ops':>9}")
    for name, fn in (("one conv per request", loop), ("one conv for the batch", one)):
        print(f"{name:<22} {_ms(fn):>13.3f} {_ops(fn):>9}")
    print(f"building the plan (once per step): {_ms(lambda: R.conv_plan(qsl, K, dev)):.3f} ms")


if __name__ == "__main__":
    main()
