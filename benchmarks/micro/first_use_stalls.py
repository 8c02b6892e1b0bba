"""One-time costs inside requests after start-up: the same requests run twice (the second run hits the prefix cache),
then fresh ones; every engine step over --slow-ms is listed with its shape (requests, tokens, drafts) and the Triton
kernels compiled during it (triton.knobs.runtime.jit_cache_hook: a kernel specialization missing from the process's
cache). A warm engine should compile nothing and have no slow step.

    PYTHONPATH=$PWD python3 benchmarks/micro/first_use_stalls.py [--target qwen3-0.6b-shape] \\
        [--draft qwen3-0.6b-shape | --draft none] [-k 4] [--batch 1] [--out result.json]
"""
import argparse
import json
import sys
import tempfile
import time

import torch

from voltllm import LLM, SamplingParams
from voltllm.bench.shapes import materialize


def _compile_log() -> list:
    import triton

    log: list = []

    def hook(*, key=None, repr=None, fn=None, compile=None, is_manual_warmup=False, already_compiled=False,
             **_):
        log.append((time.perf_counter(), getattr(fn, "name", "?"), (repr or "")[:200]))
        return False
    triton.knobs.runtime.jit_cache_hook = hook
    return log


def run(target: str, spec, batch: int, dtype: str, slow_ms: float) -> dict:
    llm = LLM(target, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=1024,
              gpu_memory_utilization=0.85, speculative_config=spec)
    engine = llm.engine
    steps: list = []
    inner = engine.step

    shapes: list = []  # (requests, tokens, drafts) of each launched step
    launch = engine.runner.execute_async

    def launched(sched):
        shapes.append((len(sched.scheduled), sched.total_tokens, sum(len(s.spec_tokens) for s in sched.scheduled)))
        return launch(sched)
    engine.runner.execute_async = launched

    def timed():
        n = len(shapes)
        t0 = time.perf_counter()
        out = inner()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps.append((t0, time.perf_counter(), shapes[n:]))
        return out
    engine.step = timed
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    vocab = engine.vocab_size
    same = [{"prompt_token_ids": [(37 * i + 11 * j) % (vocab - 100) + 50 for j in range(128)]} for i in range(batch)]
    fresh = [{"prompt_token_ids": [(53 * i + 7 * j) % (vocab - 100) + 50 for j in range(128)]} for i in range(batch)]
    log = _compile_log()
    phases = {}
    for name, prompts in (("first", same), ("repeat (prefix hit)", same), ("fresh", fresh),
                          ("fresh repeat", fresh)):
        steps.clear()
        n0 = len(log)
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
        slow = [{"ms": 1e3 * (b - a), "index": i, "launched": shape,
                 "compiled": [c[2] for c in log[n0:] if a <= c[0] <= b]}
                for i, (a, b, shape) in enumerate(steps) if 1e3 * (b - a) > slow_ms]
        phases[name] = {"wall_s": wall, "steps": len(steps), "compiles": len(log) - n0,
                        "compiled": [c[2] for c in log[n0:]], "slow_steps": slow}
        print(f"{name:<20} wall {wall * 1e3:8.1f} ms, {len(steps)} steps, {len(log) - n0} compiles, "
              f"{len(slow)} steps over {slow_ms} ms")
        for s in slow[:6]:
            print(f"    step {s['index']}: {s['ms']:.1f} ms, launched (requests, tokens, drafts) {s['launched']}; "
                  f"compiled {s['compiled'][:3]}")
    del llm
    torch.cuda.empty_cache()
    return phases


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3-0.6b-shape")
    ap.add_argument("--draft", default="qwen3-0.6b-shape")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--slow-ms", type=float, default=30.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = materialize(args.target, tmp)
        spec = None if args.draft == "none" else {"model": materialize(args.draft, tmp),
                                                  "num_speculative_tokens": args.k}
        result = run(target, spec, args.batch, args.dtype, args.slow_ms)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": args.target, "draft": args.draft, "k": args.k, "batch": args.batch,
                       "phases": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
