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
    compiles: list = []  # (time, kernel name, specialization)

    def hook(*, key=None, repr=None, fn=None, compile=None, is_manual_warmup=False, already_compiled=False, **_):
        compiles.append((time.perf_counter(), getattr(fn, "name", "?"), (repr or "")[:300]))
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
        inside = [(name, spec) for t, name, spec in compiles if t0 <= t <= t1]
        print(f"{label}: {len(inside)} compiles")
        for name, spec in inside:
            print(f"    {name}: {spec}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
