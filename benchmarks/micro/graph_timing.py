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


def graph_median_us(step, calls: int, replays: int = 5) -> float:
    """step() (which makes `calls` kernel calls, e.g. a chain of layers) captured once into a graph with Python's
    cyclic GC paused (after one eager call, which also compiles); the median over `replays` timed replays, in
    microseconds per call."""
    from voltllm.worker.cuda_graphs import replay_median_ms

    return replay_median_ms(step, torch.device("cuda", torch.cuda.current_device()), replays) * 1e3 / calls
