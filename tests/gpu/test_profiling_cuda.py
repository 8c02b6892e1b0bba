"""Profiling on the GPU (--profiler-config torch): the trace of the steps between start_profile and stop_profile holds
the GPU's kernels (CUDA graph replays included) and the totals table is sorted by device time."""
import gzip
import json

import pytest

from tiny_models import make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_trace_holds_the_gpus_kernels(tmp_path):
    path = make_model(str(tmp_path / "m"), "qwen3")
    llm = LLM(path, device="cuda", dtype="float16", gpu_memory_utilization=0.2,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces")})
    llm.generate(["warm up"], SamplingParams(max_tokens=4))
    llm.start_profile()
    llm.generate(["Hello there", "Hi"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    trace, totals = llm.stop_profile()
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    with open(totals) as f:
        head = f.read(4000)
    assert "Self CUDA" in head or "Self Device" in head or "Self XPU" in head


def test_iteration_limits_with_graph_replays(tmp_path):
    """delay_iterations 1 / max_iterations 3 over decode steps that replay CUDA graphs: the trace holds at most three
    steps' graph launches (one per step, with another replayed graph a step may launch two) and the session ends
    itself, so a start may follow."""
    path = make_model(str(tmp_path / "m"), "qwen3")
    llm = LLM(path, device="cuda", dtype="float16", gpu_memory_utilization=0.2,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces"),
                               "delay_iterations": 1, "max_iterations": 3, "torch_profiler_with_stack": False})
    llm.generate(["warm up"], SamplingParams(max_tokens=4))
    llm.start_profile()
    llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    trace, _ = llm.stop_profile()
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    launches = sum(e.get("name") == "cudaGraphLaunch" for e in events)
    assert 3 <= launches <= 6, launches
    llm.start_profile()
    llm.stop_profile()
