"""Which Triton kernels compile inside a bench's measured runs: runs `voltllm bench` with the given arguments and
lists, per run (cold, warm1, ...), every kernel specialization that was missing from the process's cache
(triton.knobs.runtime.jit_cache_hook) while the run's requests were in flight. A warm run should list none; one
that does pays the compile inside a step (~70-90 ms per kernel on the H200 machine's host).

    PYTHONPATH=$PWD python3 benchmarks/micro/bench_compiles.py --random-weights smollm2-135m-shape --compat sm70 \\
        --scenario concurrency --concurrency 64 --random-range-ratio 0.5 --num-warm 2 --no-limits
"""
import sys
import time

import triton

from voltllm.bench import inprocess
from voltllm.bench.cli import main as bench_main


def main(argv: list) -> int:
    compiles: list = []  # (time, kernel name, {argument or option: its specialization})

    def hook(*, key=None, repr=None, fn=None, compile=None, is_manual_warmup=False, already_compiled=False, **_):
        jit = getattr(fn, "jit_function", None)
        spec = {"options": (repr or "").split("](")[0]}
        try:  # key[1]: one (type, specialization) per parameter
            spec.update({p.name: str(ty) for p, ty in zip(jit.params, key[1])})
        except Exception:  # another Triton's key layout: keep the printed form
            spec["repr"] = repr or ""
        compiles.append((time.perf_counter(), getattr(fn, "name", "?"), spec))
        return False
    triton.knobs.runtime.jit_cache_hook = hook

    runs: list = []  # (label, start, end)
    inner = inprocess.InProcessRunner.__call__

    def timed(self, plan, run, work):
        t0 = time.perf_counter()
        try:
            return inner(self, plan, run, work)
        finally:
            runs.append((f"{plan.scenario} c={plan.concurrency} {run}", t0, time.perf_counter()))
    inprocess.InProcessRunner.__call__ = timed

    rc = bench_main(argv + ["--output-dir", "/tmp/bench-compiles", "--name", "bench-compiles"])
    first = runs[0][1] if runs else float("inf")
    print(f"\nstart-up: {sum(1 for t, _, _ in compiles if t < first)} compiles before the first run")
    for label, t0, t1 in runs:
        inside = [(t, name, spec) for t, name, spec in compiles if t0 <= t <= t1]
        print(f"{label}: {len(inside)} compiles")
        for t, name, spec in inside:
            print(f"    {name}: {_difference(spec, [s for u, n, s in compiles if n == name and u < t])}")
    return rc


def _difference(spec: dict, earlier: list) -> str:
    """The arguments / options whose specialization sets this variant apart from the closest earlier one of the
    same kernel, or the whole of it when it is the kernel's first."""
    if not earlier:
        return "first variant: " + ", ".join(f"{k}: {v}" for k, v in spec.items())[:600]
    closest = min(earlier, key=lambda e: sum(e.get(k) != v for k, v in spec.items()))
    return "; ".join(f"{k}: {closest.get(k)} -> {v}" for k, v in spec.items() if closest.get(k) != v)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
