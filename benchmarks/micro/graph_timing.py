"""GPU time per call of a function, from CUDA-graph replays (no host launch cost), for the micro benchmarks here.

    from graph_timing import graph_us  # (the scripts run as `python3 benchmarks/micro/<name>.py`)
"""
import torch


def graph_us(fn, reps: int = 1, replays: int = 5) -> float:
    """fn(i) for i in range(reps) captured into one graph (after one eager warm-up call fn(0), which also compiles);
    returns microseconds per fn call over `replays` replays, after one untimed replay."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * reps)
