"""Shared by the micro scripts beside it (run as `python3 benchmarks/micro/X.py`, so this folder is on sys.path):
time to first token through an in-process engine, and GPU kernel time by kernel name from a profiler trace."""
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Callable

import torch

from voltllm.bench.inprocess import sampling_params
from voltllm.engine.types import EngineCoreRequest


def first_tokens_ms(eng, vocab: int, n: int, c: int, tag: str) -> float:
    """Milliseconds until C fresh requests of n random tokens (greedy, one output token) all have their first
    token; then the engine is drained."""
    sp = sampling_params(1, temperature=0.0, top_p=1.0, top_k=0, seed=None)
    reqs = [EngineCoreRequest(f"{tag}-{i}", [random.randrange(vocab) for _ in range(n)], sp) for i in range(c)]
    t0 = time.perf_counter()
    for r in reqs:
        eng.add_request(r)
    done = 0
    while done < c:
        done += sum(1 for o in eng.step() if o.new_token_ids)
    ms = (time.perf_counter() - t0) * 1e3
    while eng.has_unfinished_requests():
        eng.step()
    return ms


def kernel_times_us(fn: Callable[[], object], width: int = 70) -> dict[str, float]:
    """GPU time (us) by kernel name over one call of fn, from torch.profiler's chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    from voltllm.bench.profile import gpu_events, shorten

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    out: dict[str, float] = defaultdict(float)
    for e in gpu_events(trace):
        out[shorten(e["name"], width)] += e["dur"]
    return dict(out)


def event_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Median milliseconds of fn() on the current CUDA stream (CUDA events, one warm-up call first); NaN when CUDA is
    unavailable (the scripts' CPU logic checks)."""
    fn()
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)
