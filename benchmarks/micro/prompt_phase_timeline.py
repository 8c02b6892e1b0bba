"""Where the time to first token goes when C requests arrive together: host phases and GPU times of the prompt step.

    PYTHONPATH=$PWD python3 benchmarks/micro/prompt_phase_timeline.py [--shape qwen3-8b-shape | --model PATH]
        [--concurrency 64]

Random weights of a named shape (as `voltllm bench --random-weights`) or a model path, C requests of `--input-len` random prompt
tokens, greedy, forced lengths, on an idle GPU (as a bench run starts). One untimed run first (compiles, cuBLAS
heuristics), then `--runs` timed runs. For each: milliseconds from the requests' arrival (t0) to the first
scheduling's end, the prompt step's host launch (prepare + enqueue) end, the GPU's start of the prompt step (a
timing event recorded on the idle GPU at t0 is the reference), the GPU's end of it, the host's first output
(first token) and the engine's first_token_time; then the prompt step's GPU time per decoder layer (timing events
around each layer: min / median / max, and layer 0 apart, whose start waits for the host) and the GPU idle between
layers. No profiler is attached."""
import argparse
import random
import statistics
import tempfile
import time

import torch

from voltllm.bench.inprocess import build_engine, sampling_params
from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs
from voltllm.engine.types import EngineCoreRequest


class _HostEvent:
    """A CUDA timing event's stand-in on the CPU (--device cpu: checks this script, times nothing useful)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "_HostEvent") -> float:
        return (other.t - self.t) * 1e3


class _Marks:
    """Host clocks and CUDA events of one run."""

    def __init__(self) -> None:
        self.host: dict[str, float] = {}
        self.gpu: dict[str, torch.cuda.Event] = {}
        self.layers: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.capture = False

    def event(self, name: str) -> None:
        self.gpu[name] = _event()


_ON_CUDA = True


def _event():
    e = torch.cuda.Event(enable_timing=True) if _ON_CUDA else _HostEvent()
    e.record()
    return e


def _sync() -> None:
    if _ON_CUDA:
        torch.cuda.synchronize()


def main() -> None:
    global _ON_CUDA
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b-shape")
    ap.add_argument("--model", default=None, help="a model path (GGUF file or HF folder) instead of --shape")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="8192: the bench's default")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    _ON_CUDA = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or materialize(args.shape, tmp)
        ea = EngineArgs(model=path, load_format="auto" if args.model else "dummy", dtype="float16", device=args.device, max_model_len=2048,
                        max_num_seqs=max(args.concurrency, 16), max_num_batched_tokens=args.max_num_batched_tokens)
        ea.skip_tokenizer_init = True
        eng = build_engine(ea)
        vocab = eng.config.model.hf_config.vocab_size
        marks = _Marks()
        runner, sched = eng.runner, eng.scheduler
        launch, schedule = runner.execute_async, sched.schedule

        def timed_launch(s):
            first = "launch0" not in marks.host
            if first:
                marks.event("gpu_start")
                marks.capture = True
            try:
                return launch(s)
            finally:
                if first:
                    marks.capture = False
                    marks.event("gpu_end")
                    marks.host["launch0"] = time.monotonic()

        def timed_schedule():
            out = schedule()
            marks.host.setdefault("schedule0", time.monotonic())
            return out

        def pre(_mod, _inp):
            if marks.capture:
                marks.layers.append((_event(), None))

        def post(_mod, _inp, _out):
            if marks.capture:
                marks.layers[-1] = (marks.layers[-1][0], _event())

        runner.execute_async, sched.schedule = timed_launch, timed_schedule
        for layer in runner.model.layers:
            layer.register_forward_pre_hook(pre)
            layer.register_forward_hook(post)
        rows = []
        for run in range(args.runs + 1):
            rng = random.Random(run)
            prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.concurrency)]
            marks.__init__()
            _sync()
            marks.event("ref")
            t0 = time.monotonic()
            for i, ids in enumerate(prompts):
                eng.add_request(EngineCoreRequest(f"t{run}-{i}", ids, sampling_params(args.output_len, 0.0, 1.0, -1, i),
                                                  arrival_time=t0))
            marks.host["added"] = time.monotonic()
            first_tok = None
            while eng.has_unfinished_requests():
                outs = eng.step()
                now = time.monotonic()
                for o in outs:
                    if o.new_token_ids and "first_out" not in marks.host:
                        marks.host["first_out"] = now
                    if o.first_token_time is not None and first_tok is None:
                        first_tok = o.first_token_time
            _sync()
            g = marks.gpu
            layer_ms = [a.elapsed_time(b) for a, b in marks.layers]
            between = [marks.layers[i][1].elapsed_time(marks.layers[i + 1][0]) for i in range(len(marks.layers) - 1)]
            row = {"added": marks.host["added"] - t0, "scheduled": marks.host["schedule0"] - t0,
                   "launched": marks.host["launch0"] - t0, "first_out": marks.host["first_out"] - t0,
                   "first_token_time": first_tok - t0}
            row = {k: v * 1e3 for k, v in row.items()}
            row.update(gpu_start=g["ref"].elapsed_time(g["gpu_start"]), gpu_end=g["ref"].elapsed_time(g["gpu_end"]),
                       layer0=layer_ms[0], layer0_start=g["ref"].elapsed_time(marks.layers[0][0]),
                       layer_med=statistics.median(layer_ms[1:]), layer_min=min(layer_ms[1:]),
                       layer_max=max(layer_ms[1:]), idle_between=sum(between),
                       after_layers=marks.layers[-1][1].elapsed_time(g["gpu_end"]))
            if run:
                rows.append(row)
        print(f"{args.model or args.shape}, {args.concurrency} x {args.input_len} tokens, ms from arrival (t0):")
        keys = list(rows[0])
        print(" ".join(f"{k:>16}" for k in keys))
        for r in rows:
            print(" ".join(f"{r[k]:16.2f}" for k in keys))


if __name__ == "__main__":
    main()
