"""Where the engine's host time goes in steady decoding: cProfile over an EngineCore's decode steps.

    PYTHONPATH=$PWD python3 benchmarks/micro/host_step_profile.py [--shape smollm2-135m-shape] [--concurrency 64]

Random weights of a named shape (as `voltllm bench --random-weights`), C requests of 128 random prompt tokens,
greedy with forced lengths; after the prompt phase and a warm-up, `--steps` engine steps run under cProfile.
Prints the step time with and without the profiler, then the functions by own time and by cumulative time.
cProfile slows Python down (each call costs more), so read the shares, not the absolute times."""
import argparse
import cProfile
import io
import pstats
import random
import tempfile
import time

from voltllm.bench.inprocess import build_engine, sampling_params
from voltllm.bench.profile import GpuStepTimer
from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs
from voltllm.engine.types import EngineCoreRequest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m-shape")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = materialize(args.shape, tmp)
        ea = EngineArgs(model=path, load_format="dummy", dtype="float16", device=args.device, max_model_len=2048,
                        max_num_seqs=max(args.concurrency, 16))
        ea.skip_tokenizer_init = True
        eng = build_engine(ea)
        vocab = eng.config.model.hf_config.vocab_size
        rng = random.Random(0)
        total = 64 + 2 * args.steps + 64
        for i in range(args.concurrency):
            ids = [rng.randrange(vocab) for _ in range(128)]
            eng.add_request(EngineCoreRequest(f"r{i}", ids, sampling_params(total, 0.0, 1.0, -1, i),
                                              arrival_time=time.monotonic()))
        for _ in range(64):  # prompt phase and warm-up
            eng.step()

        def run(n):
            t = time.perf_counter()
            for _ in range(n):
                eng.step()
            return (time.perf_counter() - t) / n * 1e6

        plain = run(args.steps // 2)
        graphs = getattr(eng.runner, "graphs", None)
        if graphs is not None and graphs.graphs:  # the host time of the steady state's graph replays
            from voltllm.worker.cuda_graphs import CapturedGraph

            import torch

            spent = []
            real = CapturedGraph.replay

            def timed(self):
                t = time.perf_counter()
                try:
                    return real(self)
                finally:
                    spent.append(time.perf_counter() - t)
            CapturedGraph.replay = timed
            try:
                with GpuStepTimer(eng) as gpu:
                    run(args.steps // 2)
                torch.cuda.synchronize()
            finally:
                CapturedGraph.replay = real
            print(f"graph replay in steady decoding: {sum(spent) / len(spent) * 1e6:.0f} us on the host per call")
            per = gpu.per_step()  # the GPU's side, no profiler attached
            print(f"GPU per step: launch -> step end median {per['gpu_us_per_step']:.0f} us; "
                  f"launch -> next launch median {per['gpu_period_us']:.0f} us")
        prof = cProfile.Profile()
        prof.enable()
        profiled = run(args.steps)
        prof.disable()
        print(f"{args.shape} x {args.concurrency}: {plain:.0f} us per step, {profiled:.0f} us under cProfile")
        graphs = getattr(eng.runner, "graphs", None)
        g = graphs.graphs.get(max(graphs.graphs)) if graphs is not None and graphs.graphs else None
        if g is not None:  # the host cost of one cudaGraphLaunch of the largest decode graph, on an idle GPU
            import torch

            times = []
            for _ in range(30):
                torch.cuda.synchronize()
                t = time.perf_counter()
                g.graph.replay()
                times.append((time.perf_counter() - t) * 1e6)
            torch.cuda.synchronize()
            times.sort()
            print(f"graph of {g.batch_size} rows: replay() returns after {times[len(times) // 2]:.0f} us on the host "
                  f"(median of 30; min {times[0]:.0f})")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
            print(f"--- by {key} (per {args.steps} steps) ---")
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
