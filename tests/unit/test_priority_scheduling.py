"""--scheduling-policy priority in the scheduler (toy requests, no model): admission by (priority, arrival), the
lowest-priority running request as the preemption victim, preempted requests back in the queue by their own key,
fcfs unchanged, and no block leaked or request lost through preemptions (sync and async-style stepping)."""
from __future__ import annotations

import random

import pytest

from voltllm.cache.kv_manager import KVCacheManager
from voltllm.config import SchedulerConfig
from voltllm.engine.request import Request, RequestStatus
from voltllm.engine.request_queue import FcfsQueue, PriorityQueue
from voltllm.engine.scheduler import RunnerOutput, Scheduler
from voltllm.engine.types import EngineCoreRequest
from voltllm.sampling.params import SamplingParams


def _req(rid: str, priority: int, arrival: float, n: int = 4, max_tokens: int = 3, seed: int = 0) -> Request:
    rng = random.Random(seed)
    prompt = [rng.randrange(100) for _ in range(n)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(EngineCoreRequest(rid, prompt, sp, arrival_time=arrival, priority=priority), 512)


def _sched(policy: str, blocks: int = 200, max_num_seqs: int = 4, budget: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=512, policy=policy)
    return Scheduler(cfg, KVCacheManager(blocks, 4))


def _token(req: Request) -> int:
    """The fake model's next token: a function of the context, so a recomputed request gives the same output."""
    toks = req.all_token_ids
    return (sum(toks) * 31 + len(toks)) % 100


def _sampled(out) -> RunnerOutput:
    res = RunnerOutput()
    for s in out.scheduled:
        if s.samples:
            res.sampled[s.request.request_id] = _token(s.request)
    return res


def _step(sched: Scheduler) -> list[str]:
    """One synchronous step; the ids scheduled in it."""
    out = sched.schedule()
    sched.kv.check_integrity()
    sched.update(out, _sampled(out))
    return [s.request.request_id for s in out.scheduled]


def _admission_order(policy: str, reqs: list[Request]) -> list[str]:
    sched = _sched(policy, max_num_seqs=1)
    for r in reqs:
        sched.add_request(r)
    order: list[str] = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        for rid in _step(sched):
            if rid not in order:
                order.append(rid)
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    return order


def _mixed() -> list[Request]:
    # added in this order; arrival times not in the order they are added (the key reads the arrival time)
    return [_req("late-p1", 1, 3.0), _req("p5", 5, 1.0), _req("early-p1", 1, 2.0), _req("p0", 0, 4.0),
            _req("neg", -2, 5.0)]


def test_priority_admits_by_priority_then_arrival():
    assert _admission_order("priority", _mixed()) == ["neg", "p0", "early-p1", "late-p1", "p5"]


def test_fcfs_ignores_priority_and_keeps_the_queue_order():
    assert _admission_order("fcfs", _mixed()) == ["late-p1", "p5", "early-p1", "p0", "neg"]


def test_equal_keys_go_in_creation_order():
    reqs = [_req(f"r{i}", 0, 1.0) for i in range(4)]  # n > 1 children share their parent's arrival time
    assert _admission_order("priority", reqs) == ["r0", "r1", "r2", "r3"]


def _three_then_pressure(policy: str) -> Scheduler:
    """Three 4-token prompts fill 3 of 5 blocks; their next tokens need one block each: one request must go."""
    sched = _sched(policy, blocks=5)
    for r in (_req("a", 0, 1.0, seed=1), _req("b", 5, 2.0, seed=2), _req("c", 1, 3.0, seed=3)):
        sched.add_request(r)
    assert sorted(_step(sched)) == ["a", "b", "c"]
    return sched


def test_priority_preempts_the_lowest_priority_running_request():
    sched = _three_then_pressure("priority")
    assert [r.request_id for r in sched.running] == ["a", "c", "b"]  # kept in (priority, arrival) order
    assert _step(sched) == ["a", "c"]
    assert sched.num_preemptions == 1 and sched.requests["b"].status is RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_fcfs_preempts_the_newest_running_request():
    sched = _three_then_pressure("fcfs")
    assert _step(sched) == ["a", "b"]
    assert sched.num_preemptions == 1 and sched.requests["c"].status is RequestStatus.PREEMPTED


def test_a_preempted_request_keeps_its_place_by_its_own_key():
    sched = _three_then_pressure("priority")
    _step(sched)  # b (priority 5) preempted
    sched.add_request(_req("d", 2, 9.0))  # arrives later, but with a higher priority than b
    sched.add_request(_req("e", 7, 0.5))  # arrived before everyone, with a lower one
    assert [r.request_id for r in sched.waiting] == ["d", "b", "e"]
    fcfs = _three_then_pressure("fcfs")
    _step(fcfs)  # c preempted: back at the head of the queue
    fcfs.add_request(_req("d", 2, 9.0))
    assert [r.request_id for r in fcfs.waiting] == ["c", "d"]


def test_a_waiting_request_does_not_preempt_a_running_one():
    """vLLM's priority policy preempts only when a running request needs blocks: a higher-priority arrival waits
    for a free sequence slot."""
    sched = _sched("priority", max_num_seqs=1)
    sched.add_request(_req("low", 9, 1.0, max_tokens=4))
    assert _step(sched) == ["low"]
    sched.add_request(_req("high", 0, 2.0))
    assert _step(sched) == ["low"] and sched.num_preemptions == 0
    for _ in range(3):
        _step(sched)
    assert "low" not in sched.requests and _step(sched) == ["high"]


def test_queues_remove_and_membership():
    reqs = [_req(f"r{i}", p, float(i)) for i, p in enumerate([3, 1, 2])]
    for q in (FcfsQueue(), PriorityQueue()):
        for r in reqs:
            q.add(r)
        q.remove(reqs[1])
        assert reqs[1] not in q and reqs[0] in q and len(q) == 2
    assert q.peek() is reqs[2] and q.pop() is reqs[2] and q.pop() is reqs[0] and not q


def _drive(sched: Scheduler, reqs: list[Request], overlap: bool, step_limit: int = 2000) -> dict[str, list[int]]:
    """Run to the end. overlap: as the engine's async scheduling, step N+1 is scheduled before step N's tokens are
    back (a sampled token is the context's function at the time it arrives, as the device would compute it)."""
    for r in reqs:
        sched.add_request(r)
    outputs = {r.request_id: [] for r in reqs}
    inflight = None
    preempt = sched._preempt

    def checked_preempt(victim: Request) -> None:
        if sched.config.policy == "priority":  # vLLM's victim: the largest (priority, arrival) running
            assert victim.priority_key == max(r.priority_key for r in sched.running)
        preempt(victim)

    sched._preempt = checked_preempt
    for _ in range(step_limit):
        if not sched.has_unfinished() and inflight is None:
            break
        out = sched.schedule()
        sched.kv.check_integrity()
        assert out.total_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        for s in out.scheduled:
            assert s.start + s.num_new_tokens == s.request.num_computed_tokens
        done = []
        if overlap:
            if inflight is not None:
                done = sched.update(inflight, _sampled(inflight))
            inflight = None if out.empty else out
        else:
            done = sched.update(out, _sampled(out))
        for o in done:
            outputs[o.request_id] += o.new_token_ids
        if sched.config.policy == "priority":
            keys = [r.priority_key for r in sched.running]
            assert keys == sorted(keys)
    assert not sched.has_unfinished() and not sched.requests
    sched.kv.check_integrity()
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    return outputs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_no_leaks_and_same_outputs_under_pressure(policy, overlap):
    def reqs():
        rng = random.Random(7)
        return [_req(f"r{i}", rng.randrange(-2, 3), float(rng.randrange(5)), n=5 + 4 * i, max_tokens=12, seed=i)
                for i in range(8)]

    roomy = _drive(_sched(policy, blocks=400, budget=16), reqs(), overlap)
    tight_sched = _sched(policy, blocks=14, budget=16)
    tight = _drive(tight_sched, reqs(), overlap)
    assert tight == roomy and all(len(v) == 12 for v in tight.values())
    assert tight_sched.num_preemptions > 0


def test_abort_of_a_preempted_request_frees_it():
    sched = _three_then_pressure("priority")
    _step(sched)
    sched.abort_requests(["b"])
    assert sched.requests.keys() == {"a", "c"} and not sched.waiting
    while sched.has_unfinished():
        _step(sched)
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


# -- the flag ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_model

    return make_model(str(tmp_path_factory.mktemp("tiny_policy")), "llama", max_position_embeddings=256)


def test_the_flag_sets_the_scheduler_policy(tiny):
    from flag_parsing import parse_engine_flags
    from voltllm.config import EngineArgs

    assert parse_engine_flags(tiny, "--device", "cpu").create_engine_config().scheduler.policy == "fcfs"
    args = parse_engine_flags(tiny, "--device", "cpu", "--scheduling-policy", "priority")
    assert args.create_engine_config().scheduler.policy == "priority"
    offline = EngineArgs(model=tiny, device="cpu", scheduling_policy="priority")  # LLM(scheduling_policy=...)
    assert offline.create_engine_config().scheduler.policy == "priority"


def test_other_policies_are_refused(tiny, capsys):
    from voltllm.cli import main
    from voltllm.config import ConfigError, EngineArgs

    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", tiny, "--device", "cpu", "--scheduling-policy", "lifo"])
    assert e.value.code == 2 and "--scheduling-policy: invalid choice: 'lifo'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--scheduling-policy lifo: not a scheduling policy; use fcfs"):
        EngineArgs(model=tiny, device="cpu", scheduling_policy="lifo").create_engine_config()
