"""Which Triton kernels compile inside a bench's measured runs: runs `voltllm bench` with the given arguments and
lists, per run (cold, warm1, ...), every kernel specialization that was missing from the process's cache
(triton.knobs.runtime.jit_cache_hook; the bench records each run's, bench/compiles.py). A warm run should list none; one
that does pays the compile inside a step (~70-90 ms per kernel on the H200 machine's host).

    PYTHONPATH=$PWD python3 benchmarks/micro/bench_compiles.py --random-weights smollm2-135m-shape --compat sm70 \\
        --scenario concurrency --concurrency 64 --random-range-ratio 0.5 --num-warm 2 --no-limits
"""
import json
import sys

import triton

from voltllm.bench.cli import main as bench_main


def main(argv: list) -> int:
    compiles: list = []  # (kernel name, {argument or option: its specialization}), in compile order

    def hook(*, key=None, fn=None, signature=None, constants=None, configs=None, options=None, **_):
        try:
            spec = _specialization(getattr(fn, "jit_function", None), signature, constants, configs, options)
        except Exception as e:  # another Triton's hook arguments: say so rather than stop the bench
            spec = {"unreadable": repr(e)}
        spec["cache key"] = str(key)  # the in-memory cache's key: what the rest may not show
        compiles.append((getattr(fn, "name", "?"), spec))
        return False
    triton.knobs.runtime.jit_cache_hook = hook

    out_dir, name = "/tmp/bench-compiles", "bench-compiles"
    rc = bench_main(argv + ["--output-dir", out_dir, "--name", name])
    with open(f"{out_dir}/{name}.json") as f:
        runs = json.load(f)["metrics"]["runs"]
    # the bench's own log (bench/compiles.py) chains this hook, so both see the same compiles in the same order:
    # start-up's, then each run's (triton_compiles), nothing between runs
    per_run = [len(r["triton_compiles"] or []) for r in runs]
    at = len(compiles) - sum(per_run)
    print(f"\nstart-up: {at} compiles before the first run")
    for r, n in zip(runs, per_run):
        print(f"{r['scenario']} c={r['concurrency']} {r['run']}: {n} compiles")
        for k in range(at, at + n):
            name_k, spec = compiles[k]
            print(f"    {name_k}: {_difference(spec, [s for m, s in compiles[:k] if m == name_k])}")
        at += n
    return rc


def _specialization(jit, signature, constants, configs, options) -> dict:
    """{parameter: "type [= constant] [attributes]", "opt.<field>": value} of one compile request."""
    names = [p.name for p in jit.params] if jit is not None else []

    def name_of(k):
        i = k[0] if isinstance(k, tuple) and k else k
        return names[i] if isinstance(i, int) and i < len(names) else str(k)
    spec = {str(n): str(t) for n, t in (signature or {}).items()}
    for k, v in (constants or {}).items():
        spec[name_of(k)] = f"{spec.get(name_of(k), '')} = {v}"
    for k, v in ((configs or [{}])[0] or {}).items():
        spec[name_of(k)] = f"{spec.get(name_of(k), '')} {v}"
    for k, v in (getattr(options, "__dict__", None) or {}).items():
        spec[f"opt.{k}"] = str(v)
    return spec


def _difference(spec: dict, earlier: list) -> str:
    """The arguments / options whose specialization sets this variant apart from the closest earlier one of the
    same kernel, or the whole of it when it is the kernel's first."""
    if not earlier:
        return "first variant: " + ", ".join(f"{k}: {v}" for k, v in spec.items())[:600]
    closest = min(earlier, key=lambda e: sum(e.get(k) != v for k, v in spec.items() if k != "cache key"))
    out = [f"{k}: {closest.get(k)} -> {v}" for k, v in spec.items() if closest.get(k) != v and k != "cache key"]
    if not out:  # the same arguments: show where the cache keys differ
        a, b = closest.get("cache key", ""), spec.get("cache key", "")
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lo = max(0, i - 80)
        out = [f"same arguments; cache keys differ at {i}: ...{a[lo:i + 120]} -> ...{b[lo:i + 120]}"]
    return "; ".join(out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
