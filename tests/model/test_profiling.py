"""vLLM's offline profiling (LLM(profiler_config=...), start_profile / stop_profile) on a tiny model on the CPU: the
trace of the work between them, gzipped or not, and the operators' totals; delay_iterations / max_iterations (the
session's steps counted in its trace); every rank's trace under tensor parallelism; start / stop out of turn and
profiling off are refused with ProfilerError; the config's checks."""
import gzip
import json

import pytest

from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.profiling import ProfilerConfig, ProfilerError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.mark.parametrize("gz", [True, False])
def test_trace_of_the_work_between_start_and_stop(tiny, tmp_path, gz):
    cfg = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": gz,
           "torch_profiler_with_stack": False, "torch_profiler_record_shapes": True}
    llm = LLM(tiny, block_size=4, profiler_config=cfg)
    with pytest.raises(ProfilerError, match="not running"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(ProfilerError, match="already running"):
        llm.start_profile()
    llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    files = llm.stop_profile()
    trace, totals = files
    assert trace.endswith(".pt.trace.json.gz" if gz else ".pt.trace.json") and totals.endswith("-totals.txt")
    with (gzip.open(trace) if gz else open(trace, "rb")) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)
    assert any(e.get("args", {}).get("Input Dims") for e in events)  # (record_shapes)
    with open(totals) as f:
        assert "Self CPU" in f.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.split("/")[-1] for p in files)
    llm.start_profile()  # (a second session, ended by the engine's shutdown)
    llm.engine.shutdown()
    assert len(list(tmp_path.glob("*.pt.trace.json*"))) == 2


def test_profiling_off_and_the_configs_checks(tiny):
    llm = LLM(tiny, block_size=4)
    with pytest.raises(ProfilerError, match="profiling is off"):
        llm.start_profile()
    assert ProfilerConfig.from_dict({}) is None
    assert ProfilerConfig.from_dict({"profiler": "cuda"}).profiler == "cuda"
    for bad, why in (({"profiler": "torch"}, "needs torch_profiler_dir"),
                     ({"profiler": "torch", "torch_profiler_dir": "x"}, "absolute path"),
                     ({"profiler": "torch", "torch_profiler_dir": "/x", "torch_profiler_with_stack": "yes"},
                      "must be true or false"),
                     ({"torch_profiler_dir": "/x"}, "need \"profiler\": \"torch\""),
                     ({"profiler": "torch", "torch_profiler_dir": "/x", "max_iters": 3}, "unknown keys"),
                     ({"profiler": "torch", "torch_profiler_dir": "/x", "delay_iterations": -1}, "integer >= 0"),
                     ({"profiler": "cuda", "max_iterations": 2.0}, "integer >= 0"),
                     ({"profiler": "cuda", "ignore_frontend": 1}, "must be true or false")):
        with pytest.raises(ProfilerError, match=why):
            ProfilerConfig.from_dict(bad)


def _forwards(trace: str, op: str = "aten::embedding") -> int:
    """Calls of `op` in a trace; of the embedding, the engine steps (the tiny model embeds its tokens once a step)."""
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    return sum(e.get("name") == op and e.get("ph") == "X" for e in events)


def test_delay_and_max_iterations(tiny, tmp_path):
    """A session waits delay_iterations steps, records max_iterations steps and ends itself (stop returns what it
    wrote); stopped while still waiting, it writes nothing. Without limits it records every step."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # 8 steps: the prompt's, then 7 decodes
    cfg = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_with_stack": False,
           "torch_profiler_dump_cuda_time_total": False}
    full = LLM(tiny, block_size=4, profiler_config=cfg)
    full.start_profile()
    full.generate(["Hello there"], sp)
    (trace,) = full.stop_profile()
    assert _forwards(trace) == 8
    llm = LLM(tiny, block_size=4, profiler_config=dict(cfg, delay_iterations=2, max_iterations=3))
    llm.start_profile()
    llm.generate(["Hello there"], sp)
    assert len(list(tmp_path.glob("*.pt.trace.json.gz"))) == 2  # (written when the third step ended)
    (trace,) = llm.stop_profile()
    assert _forwards(trace) == 3
    llm.start_profile()
    llm.generate(["Hello there"], sp)
    llm.start_profile()  # (the last session ended itself: a start may follow at once, as in vLLM)
    with pytest.raises(ProfilerError, match="already running"):
        llm.start_profile()
    llm.stop_profile()
    assert len(list(tmp_path.glob("*.pt.trace.json.gz"))) == 3
    llm.start_profile()
    llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))  # (one step: within the delay)
    assert llm.stop_profile() == []
    with pytest.raises(ProfilerError, match="not running"):
        llm.stop_profile()
    assert len(list(tmp_path.glob("*.pt.trace.json.gz"))) == 3


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_every_rank_traces_itself(tiny, tmp_path, parallel):
    cfg = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_with_stack": False,
           "torch_profiler_dump_cuda_time_total": False, "max_iterations": 4}
    llm = LLM(tiny, block_size=4, profiler_config=cfg, **{parallel: 2})
    try:
        llm.start_profile()
        with pytest.raises(ProfilerError, match="already running"):
            llm.start_profile()
        llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        files = llm.stop_profile()
        assert [f.split("/")[-1].split("-")[2] for f in files] == ["rank0", "rank1"]
        # (the same steps on both ranks; a second pipeline stage embeds nothing: it starts from hidden states)
        assert [_forwards(f) for f in files] == ([4, 4] if parallel.startswith("tensor") else [4, 0])
        assert _forwards(files[1], "aten::linear") > 0
        llm.start_profile()  # (a second session: every rank writes it at shutdown)
    finally:
        llm.engine.shutdown()
    assert len(list(tmp_path.glob("*-rank1-*.pt.trace.json.gz"))) == 2
