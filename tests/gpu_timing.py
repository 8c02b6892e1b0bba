"""GPU time of a call from CUDA-graph replays, for the GPU tests' timing prints (tests/gpu)."""
from __future__ import annotations

import torch


def graph_time_us(fn, reps: int = 20) -> float:
    """GPU time of fn() captured `reps` times in one CUDA graph (no host launch overhead), per call: the median of
    5 replays, after an eager warm-up (which also compiles) and one on a side stream, as capture wants."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def replay_with_pdl(run, outs) -> None:
    """run() (a chain of kernel launches writing `outs`) with PDL on: once eagerly, then captured in a CUDA graph and
    replayed onto NaN-poisoned `outs`, so each launch must see its predecessor's writes (kernels/pdl.py)."""
    from voltllm.kernels import pdl

    try:
        pdl.configure(True)
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    finally:
        pdl.configure(False)
