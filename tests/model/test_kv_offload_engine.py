"""--kv-offloading-size on a tiny random llama on the CPU: a GPU pool so small that a first prompt's blocks are evicted
by the next ones; the first prompt again takes them from the CPU tier (its hit counter, num_cached_tokens), and its
greedy tokens and their logprobs are those of the engine without offloading (which recomputes them): the copied KV
is the real KV. With async scheduling on and off, and at tensor parallelism 2 (gloo), whose ranks each copy their
own heads."""
from __future__ import annotations

import random

import pytest

from tiny_models import make_model
from voltllm import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 200) for _ in range(100)] for _ in range(3)]  # 6 full blocks of 16 each
# the first prompt, its blocks evicted by two others (14 blocks: 7 per prompt), then again
ORDER = [0, 1, 2, 0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_kvo")), "llama")


def _llm(path, blocks=14, **kw):
    from voltllm.entrypoints.llm import LLM

    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=2, block_size=16,
               num_gpu_blocks_override=blocks, max_model_len=200, **kw)


def _run(llm, order=ORDER, params=GREEDY):
    outs = []
    for i in order:
        outs.append(llm.generate({"prompt_token_ids": PROMPTS[i]}, params, use_tqdm=False)[0])
        llm.engine.check_integrity()
    return outs


@pytest.fixture(scope="module")
def reference(tiny):
    """The engine without offloading: the first prompt's second run recomputes it."""
    outs = _run(_llm(tiny))
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]
    return outs


@pytest.fixture(scope="module")
def gpu_hit(tiny):
    """A pool large enough to keep every prompt: the first prompt's second run hits the GPU pool, whose blocks hold
    the same KV as the CPU tier's copies, so that run's logprobs are the same bits."""
    outs = _run(_llm(tiny, blocks=64))
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 96]
    return outs[3]


def _assert_same(outs, reference):
    for got, want in zip(outs, reference):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            (ta, la), = a.items()
            (tb, lb), = b.items()
            assert ta == tb and la.logprob == pytest.approx(lb.logprob, abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_evicted_prefix_comes_back_from_the_cpu_tier(tiny, reference, gpu_hit, async_scheduling):
    llm = _llm(tiny, kv_offloading_size=0.001, async_scheduling=async_scheduling)
    assert llm.engine.kv.cpu.num_slots == llm.engine.runner.kv_offload.num_slots > 0
    outs = _run(llm)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 96]
    extra = llm.engine.stats().extra
    assert extra["external_prefix_cache_hits"] == 96 and extra["external_prefix_cache_queries"] == 400
    assert llm.engine.stats().prefix_cache_hits == 0  # none of it from the GPU pool
    _assert_same(outs, reference)
    assert outs[3].outputs[0].logprobs == gpu_hit.outputs[0].logprobs


def test_reset_prefix_cache_keeps_the_cpu_tier_unless_asked(tiny, reference):
    """vLLM's reset_prefix_cache(reset_connector=False) leaves its connector's blocks; True drops them."""
    llm = _llm(tiny, kv_offloading_size=0.001)
    _run(llm, [0, 1, 2])
    assert llm.reset_prefix_cache() is True
    again = _run(llm, [0])[0]
    assert again.num_cached_tokens == 96
    assert llm.reset_prefix_cache(reset_connector=True) is True and len(llm.engine.kv.cpu) == 0
    fresh = _run(llm, [0])[0]
    assert fresh.num_cached_tokens == 0
    _assert_same([again, fresh], [reference[3], reference[3]])


def test_aborts_and_preemption_leave_nothing_behind(tiny, reference):
    """Requests aborted mid-prompt and preempted by a pool too small for all of them, beside CPU-tier hits: the
    block pool and the host slots stay consistent, and the hits are still exact."""
    from voltllm.engine.types import EngineCoreRequest

    llm = _llm(tiny, kv_offloading_size=0.001)
    _run(llm, [0, 1, 2])
    core = llm.engine
    # x: the first prompt's blocks from the CPU tier, 12 blocks at its end; y: 9 blocks at its end
    core.add_request(EngineCoreRequest("x", PROMPTS[0] + [5] * 20, SamplingParams(max_tokens=60, ignore_eos=True)))
    core.add_request(EngineCoreRequest("y", PROMPTS[1][:40], SamplingParams(max_tokens=100, ignore_eos=True)))
    for _ in range(30):
        core.step()
        core.check_integrity()
    core.abort_requests(["x"])
    while core.has_unfinished_requests():
        core.step()
        core.check_integrity()
    assert core.scheduler.num_preemptions > 0 and core.kv.cpu_hit_tokens > 0
    assert core.kv.pool.num_free_blocks == core.kv.num_blocks
    _assert_same(_run(llm, [0]), [reference[3]])


def test_tensor_parallel_ranks_copy_their_own_heads(tiny, reference):
    llm = _llm(tiny, kv_offloading_size=0.002, tensor_parallel_size=2)
    try:
        outs = _run(llm)
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 96]
        _assert_same(outs, reference)
    finally:
        llm.engine.shutdown()


def test_a_draft_models_kv_moves_with_the_blocks(tiny):
    """A draft model's KV shares the target's blocks: the CPU tier saves and loads its layers too, so the drafts
    after a CPU-tier hit are those after a GPU-pool hit (the target as its own draft: every draft accepted)."""
    spec = {"model": tiny, "num_speculative_tokens": 2}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)  # (no logprobs: they take no drafts)
    llm = _llm(tiny, blocks=16, kv_offloading_size=0.002, speculative_config=spec)
    assert len(llm.engine.runner.kv_offload.parts) == 2 * 3  # the target's 3 layers and the draft's
    outs = _run(llm, params=params)
    kept = _llm(tiny, blocks=64, speculative_config=spec)
    want = _run(kept, params=params)
    assert [o.num_cached_tokens for o in outs] == [o.num_cached_tokens for o in want] == [0, 0, 0, 96]
    assert llm.engine.stats().extra["external_prefix_cache_hits"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    got, ref = llm.engine.stats().extra, kept.engine.stats().extra
    assert got["spec_accepted_tokens"] == ref["spec_accepted_tokens"] == ref["spec_draft_tokens"] > 0
