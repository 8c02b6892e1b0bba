"""Where a speculative round's time goes on the GPU (draft model or n-gram, random weights): per engine step, the
host's phases (bench.profile.HostPhaseTimer: schedule, prepare, launch, wait, collect, update; the draft's proposal
passes timed on their own), the GPU's time from launch to step end and from launch to the next launch
(GpuStepTimer), then one profiled window's kernels grouped by name (calls and us per step).

    PYTHONPATH=$PWD python3 benchmarks/micro/spec_round_profile.py [--target qwen3-8b-shape] \\
        [--draft qwen3-0.6b-shape | --draft none] [-k 4] [--batch 1] [--steps 24] [--out result.json]

`--draft none` profiles the target's plain decode steps at the same batch (the reference for the round).
"""
import argparse
import json
import sys
import tempfile
import time

import torch

from voltllm import LLM, SamplingParams
from voltllm.bench.profile import GpuStepTimer, HostPhaseTimer
from voltllm.bench.shapes import materialize
from voltllm.engine.types import EngineCoreRequest


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _requests(engine, batch: int, max_tokens: int, tag: str) -> list[str]:
    ids = []
    for i in range(batch):
        rid = f"{tag}-{i}"
        prompt = [(37 * i + 11 * j) % (engine.vocab_size - 100) + 50 for j in range(128)]
        engine.add_request(EngineCoreRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=True), arrival_time=time.monotonic()))
        ids.append(rid)
    return ids


def _steps(engine, n: int) -> None:
    for _ in range(n):
        engine.step()


def profile(target: str, spec, batch: int, dtype: str, steps: int) -> dict:
    llm = LLM(target, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=1024,
              gpu_memory_utilization=0.85, speculative_config=spec)
    engine = llm.engine
    llm.generate([{"prompt_token_ids": [7] * 64}] * batch, SamplingParams(temperature=0, max_tokens=16,
                                                                           ignore_eos=True))  # compiles
    ids = _requests(engine, batch, min(10 * steps + 64, 800), "warm")
    _steps(engine, 8)  # prompt step and the first rounds
    _sync()
    draft = engine.runner.draft
    propose_s = [0.0]
    if draft is not None:
        inner = draft.propose

        def timed(sched):
            t = time.perf_counter()
            try:
                return inner(sched)
            finally:
                propose_s[0] += time.perf_counter() - t
        draft.propose = timed
    with HostPhaseTimer(engine) as host, GpuStepTimer(engine) as gpu:
        t0 = time.perf_counter()
        _steps(engine, steps)
        _sync()
        wall = time.perf_counter() - t0
    row = {"batch": batch, "steps": steps, "wall_ms_per_step": 1e3 * wall / steps,
           "host_us_per_step": host.per_step(wall, steps), "propose_us_per_step": 1e6 * propose_s[0] / steps,
           **gpu.per_step()}
    activity = torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        _steps(engine, 8)
        _sync()
    table = sorted(((e.key, e.count / 8, (e.device_time_total if torch.cuda.is_available() else e.self_cpu_time_total)
                     / 8) for e in prof.key_averages()),
                   key=lambda r: -r[2])
    row["kernels"] = [{"name": k[:90], "calls_per_step": c, "us_per_step": us} for k, c, us in table[:25]]
    engine.abort_requests(ids)
    del llm
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3-8b-shape")
    ap.add_argument("--draft", default="qwen3-0.6b-shape")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target = materialize(args.target, tmp)
        spec = None if args.draft == "none" else {"model": materialize(args.draft, tmp),
                                                  "num_speculative_tokens": args.k}
        for b in (int(x) for x in args.batch.split(",")):
            r = profile(target, spec, b, args.dtype, args.steps)
            rows.append(r)
            host = " ".join(f"{k} {v:.0f}" for k, v in r["host_us_per_step"].items())
            print(f"batch {b}: wall {r['wall_ms_per_step']:.2f} ms/step, gpu {r['gpu_us_per_step'] or 0:.0f} us, "
                  f"period {r['gpu_period_us'] or 0:.0f} us; host us: {host}; propose {r['propose_us_per_step']:.0f}")
            for k in r["kernels"][:14]:
                print(f"  {k['us_per_step']:8.0f} us {k['calls_per_step']:6.1f}x  {k['name']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": args.target, "draft": args.draft, "k": args.k, "dtype": args.dtype,
                       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
