"""Block pool, prefix hashing and the scheduler with toy requests (no model)."""
import random

import pytest

from voltllm.cache.block_pool import BlockPool
from voltllm.cache.kv_manager import KVCacheManager
from voltllm.cache.prefix import extend_block_hashes, hash_block
from voltllm.config import SchedulerConfig
from voltllm.engine.request import Request
from voltllm.engine.scheduler import RunnerOutput, Scheduler
from voltllm.engine.types import EngineCoreRequest
from voltllm.sampling.params import SamplingParams


def test_free_queue_is_lru_and_hits_leave_it():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free_blocks([b, a])  # b freed first -> evicted first
    pool.check_integrity()
    assert pool.get_cached_block(b"ha") is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 3
    new = pool.get_new_blocks(3)  # two never-used blocks, then b (evicted: loses its hash)
    assert b in new and pool.get_cached_block(b"hb") is None and b.block_hash is None
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.free_blocks(new + [a])
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        pool.free_blocks([a])


def test_chained_hashes_depend_on_parent_and_salt():
    h1, h2 = [], []
    extend_block_hashes(h1, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    extend_block_hashes(h2, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(h1) == 2 and h1[1] != h2[1]  # same tokens in block 1, different parents
    salted = []
    extend_block_hashes(salted, [1, 2, 3, 4], 4, cache_salt="tenant")
    assert salted[0] != h1[0]
    assert hash_block(None, [1, 2, 3, 4]) == h1[0]


def _req(rid, n, max_tokens=5, seed=0):
    rng = random.Random(seed)
    prompt = [rng.randrange(100) for _ in range(n)]
    return Request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)), 512)


def _run(sched, reqs, step_limit=500):
    """Drive the scheduler with a fake runner whose next token is a function of the context."""
    for r in reqs:
        sched.add_request(r)
    outputs = {r.request_id: [] for r in reqs}
    for _ in range(step_limit):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.kv.check_integrity()
        assert out.total_tokens <= sched.config.max_num_batched_tokens
        res = RunnerOutput()
        for s in out.scheduled:
            assert s.start + s.num_new_tokens == s.request.num_computed_tokens
            assert s.block_array.dtype.name == "int32" and s.block_array.tolist() == s.block_ids
            if s.samples:
                toks = s.request.all_token_ids
                res.sampled[s.request.request_id] = (sum(toks) * 31 + len(toks)) % 100
        for o in sched.update(out, res):
            outputs[o.request_id] += o.new_token_ids
    assert not sched.has_unfinished()
    sched.kv.check_integrity()
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    return outputs


@pytest.mark.parametrize("blocks", [200, 14])
def test_scheduler_no_leaks_and_same_outputs_under_pressure(blocks):
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=512)
    reqs = lambda: [_req(f"r{i}", 5 + 7 * i, max_tokens=12, seed=i) for i in range(6)]  # noqa: E731
    roomy = _run(Scheduler(cfg, KVCacheManager(200, 4)), reqs())
    sched = Scheduler(cfg, KVCacheManager(blocks, 4))
    tight = _run(sched, reqs())
    assert tight == roomy
    assert all(len(v) == 12 for v in tight.values())
    if blocks == 14:
        assert sched.num_preemptions > 0


def test_block_array_mirrors_the_ids_through_growth_and_free():
    kv = KVCacheManager(400, 4)
    r = _req("a", 3)
    views = []
    for step in range(60):  # 1 + 59 x 5 tokens: the int32 mirror outgrows its capacity several times
        n = 3 if step == 0 else 5
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        views.append((kv.block_array(r), list(kv.block_ids(r))))
        kv.check_integrity()
    assert len(kv.block_ids(r)) == -(-r.num_computed_tokens // 4) == 75
    for arr, ids in views:  # every earlier snapshot still holds the ids it was taken with
        assert arr.tolist() == ids
    kv.free(r)
    kv.check_integrity()
    assert kv.block_array(r).size == 0 and kv.pool.num_free_blocks == 400


def test_prefix_hits_are_counted_and_reused():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512)
    kv = KVCacheManager(50, 4)
    sched = Scheduler(cfg, kv)
    first = _run(sched, [_req("a", 18, seed=5)])
    hits0 = kv.prefix_hits
    r = _req("b", 18, seed=5)
    second = _run(sched, [r])
    assert second["b"] == first["a"]
    assert kv.prefix_hits - hits0 == 16 and r.num_cached_tokens == 16  # 4 full blocks; last token recomputed


def test_abort_frees_everything():
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=512)
    kv = KVCacheManager(40, 4)
    sched = Scheduler(cfg, kv)
    for i in range(3):
        sched.add_request(_req(f"x{i}", 20, seed=i))
    sched.update(sched.schedule(), RunnerOutput())
    sched.abort_requests(["x0", "x1", "x2", "unknown"])
    assert not sched.has_unfinished()
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 40
    outs = sched.update(sched.schedule(), RunnerOutput())
    assert sorted(o.request_id for o in outs) == ["x0", "x1", "x2"] and all(o.finish_reason == "abort" for o in outs)


def test_request_larger_than_cache_is_failed_not_stuck():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512)
    sched = Scheduler(cfg, KVCacheManager(3, 4))
    sched.add_request(_req("big", 30))
    outs = sched.update(sched.schedule(), RunnerOutput())
    assert outs[0].finish_reason == "abort" and not sched.has_unfinished()
