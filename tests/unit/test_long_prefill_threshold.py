"""--long-prefill-token-threshold (vLLM's per-request cap on a step's tokens) in the scheduler with toy requests: a
long prompt no longer takes a whole step's budget, so a short prompt that arrives behind it starts (and gets its
first token) in the first step instead of waiting for the long prefill to end; the long prompt still completes, in
more steps, and nothing leaks. --max-num-partial-prefills > 1 sets the cap to 4% of --max-model-len, as in vLLM."""
from __future__ import annotations

import pytest

from flag_parsing import parse_engine_flags as _parse
from tiny_models import make_model
from voltllm.cache.kv_manager import KVCacheManager
from voltllm.config import ConfigError, EngineArgs, SchedulerConfig
from voltllm.engine.request import Request
from voltllm.engine.scheduler import RunnerOutput, Scheduler
from voltllm.engine.types import EngineCoreRequest
from voltllm.sampling.params import SamplingParams


def _req(rid: str, n: int, arrival: float, first: int) -> Request:
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    return Request(EngineCoreRequest(rid, [(first + i * 7) % 100 for i in range(n)], sp, arrival_time=arrival), 2048)


def _steps_until_first_tokens(threshold: int) -> tuple[dict[str, int], list[dict[str, int]]]:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=2048,
                          long_prefill_token_threshold=threshold)
    sched = Scheduler(cfg, KVCacheManager(400, 16))
    sched.add_request(_req("long", 1000, 0.0, first=0))
    sched.add_request(_req("short", 20, 1.0, first=3))  # (no prefix in common with the long one)
    first: dict[str, int] = {}
    steps = []
    for step in range(40):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.kv.check_integrity()
        steps.append({s.request.request_id: s.num_new_tokens for s in out.scheduled})
        res = RunnerOutput()
        for s in out.scheduled:
            if s.samples:
                res.sampled[s.request.request_id] = 5
                first.setdefault(s.request.request_id, step)
        sched.update(out, res)
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 400
    return first, steps


def test_a_long_prompt_leaves_room_for_the_next():
    first, steps = _steps_until_first_tokens(0)
    assert steps[0] == {"long": 256}  # no cap: the long prompt takes the whole budget ...
    assert first["short"] >= 3  # ... and the short one waits for its prefill to end
    first, steps = _steps_until_first_tokens(128)
    assert steps[0] == {"long": 128, "short": 20}  # both in the first step
    assert first["short"] == 0
    assert all(n <= 128 for s in steps for n in s.values())
    assert sum(s.get("long", 0) for s in steps) == 1000 + 1  # its whole prompt, then its second token


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_lpt")), "qwen3", max_position_embeddings=1024)


def test_flags(tiny):
    sched = _parse(tiny, "--device", "cpu", "--long-prefill-token-threshold", "512").create_engine_config().scheduler
    assert sched.long_prefill_token_threshold == 512
    sched = _parse(tiny, "--device", "cpu", "--max-num-partial-prefills", "4", "--max-long-partial-prefills", "2",
                   "--max-model-len", "1000").create_engine_config().scheduler
    assert sched.long_prefill_token_threshold == 40  # 4% of --max-model-len
    assert EngineArgs(model=tiny, device="cpu").create_engine_config().scheduler.long_prefill_token_threshold == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"long_prefill_token_threshold": -1}, "--long-prefill-token-threshold must be an integer >= 0"),
    ({"max_num_partial_prefills": 0}, "--max-num-partial-prefills must be an integer >= 1"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "--max-long-partial-prefills 3 must be <="),
    ({"max_num_partial_prefills": 2, "long_prefill_token_threshold": 5000}, "cannot be greater than --max-model-len"),
])
def test_refused(tiny, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=tiny, device="cpu", **kwargs).create_engine_config()
