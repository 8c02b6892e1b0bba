"""--kv-offloading-size for hybrid models (Gated DeltaNet + attention) on tiny random Qwen3.5 / Qwen3-Next checkpoints
on the CPU: a KV pool of 14 blocks and a snapshot pool of 4 are so small that a first prompt's blocks and its
recurrent-state snapshots are evicted by the next two prompts, to the CPU tier; the first prompt again resumes at its
deepest snapshot boundary from there (KV blocks loaded, the snapshot restored from its host slot into the request's
state slot), and its greedy tokens and logprobs are bit for bit those of an engine whose larger pools kept both on the
GPU. Async scheduling on and off, a snapshot back from the host beside KV still on the GPU, reset_connector, aborts
and preemption, and -tp 2 on gloo (each rank copies its own heads' states); nothing leaks."""
from __future__ import annotations

import random

import pytest

from voltllm import SamplingParams

transformers = pytest.importorskip("transformers")

from tiny_models import HYBRID_MOE, HYBRID_VOCAB, make_tiny_hybrid  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
_rng = random.Random(0)
# 41 tokens: chunks of 16 end on the snapshot boundaries 16 and 32, the last is cut at 40 (three snapshots a prompt);
# the second run resumes at 40 (10 blocks of 4)
PROMPTS = [[_rng.randrange(HYBRID_VOCAB) for _ in range(41)] for _ in range(3)]
ORDER = [0, 1, 2, 0]
HIT = 40


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {kind: make_tiny_hybrid(str(tmp_path_factory.mktemp(kind)), kind, 300 + i, 400 + i, conv_std=0.4,
                                    **(HYBRID_MOE if kind == "qwen3_next" else {}))
             for i, kind in enumerate(("qwen3_5", "qwen3_next"))}
    if any(p is None for p in paths.values()):
        pytest.skip("this transformers lacks the hybrid architectures")
    return paths


def _llm(path, blocks=14, **kw):
    from voltllm.entrypoints.llm import LLM

    return LLM(path, skip_tokenizer_init=True, block_size=4, mamba_block_size=8, max_num_batched_tokens=16,
               max_num_seqs=2, max_model_len=96, num_gpu_blocks_override=blocks, **kw)


def _run(llm, order=ORDER):
    outs = []
    for i in order:
        outs.append(llm.generate({"prompt_token_ids": PROMPTS[i]}, GREEDY, use_tqdm=False)[0])
        llm.engine.check_integrity()
    return outs


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Without offloading: the first prompt's second run recomputes it (its blocks and snapshots were evicted)."""
    out = {}
    for kind, path in checkpoints.items():
        outs = _run(_llm(path))
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]
        out[kind] = outs
    return out


@pytest.fixture(scope="module")
def gpu_hit(checkpoints):
    """Pools large enough to keep every prompt's blocks and snapshots: the second run is a GPU hit at the same
    boundary, from the same KV and the same snapshot as the CPU tier's copies."""
    from voltllm.cache import state_snapshots as S

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "MIN_SNAPSHOTS", 32)
        for kind, path in checkpoints.items():
            outs = _run(_llm(path, blocks=64))
            assert [o.num_cached_tokens for o in outs] == [0, 0, 0, HIT]
            out[kind] = outs[3]
    return out


def _assert_same(outs, reference):
    for got, want in zip(outs, reference):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            (ta, la), = a.items()
            (tb, lb), = b.items()
            assert ta == tb and la.logprob == pytest.approx(lb.logprob, abs=1e-4)


def _assert_clean(llm) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.step()  # (slots of requests that finished in the last step are released at the next schedule)
    eng.check_integrity()
    assert eng.kv.usage() == 0.0
    assert eng.runner.state_cache.num_free == eng.runner.state_cache.num_slots
    eng.runner.state_snapshots.check_integrity(live_request_ids=set())


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_evicted_blocks_and_snapshot_come_back_from_the_cpu_tier(checkpoints, reference, gpu_hit, kind,
                                                                 async_scheduling):
    llm = _llm(checkpoints[kind], kv_offloading_size=0.001, async_scheduling=async_scheduling)
    snaps = llm.engine.runner.state_snapshots
    assert snaps.capacity == 4 and snaps.host is not None and snaps.host.num_slots == snaps.host_index.num_slots > 3
    # the host memory (KV slots, snapshot slots and the snapshot pool's padding row) stays within the size asked
    host_bytes = llm.engine.runner.kv_offload.nbytes + sum(t.numel() * t.element_size() for t in snaps.host.tensors)
    assert host_bytes <= 0.001 * 2**30
    outs = _run(llm)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, HIT]
    extra = llm.engine.stats().extra
    assert extra["external_prefix_cache_hits"] == HIT  # every block from the CPU tier
    assert llm.engine.stats().prefix_cache_hits == 0
    assert snaps.num_offloaded > 0 and snaps.num_host_restored == 1
    _assert_same(outs, reference[kind])
    assert outs[3].outputs[0].logprobs == gpu_hit[kind].outputs[0].logprobs
    _assert_clean(llm)


def test_a_snapshot_from_the_host_beside_kv_on_the_gpu(checkpoints, gpu_hit):
    """A KV pool that keeps every block but a snapshot pool of 4: the hit's blocks are the GPU's, its snapshot the
    host's."""
    llm = _llm(checkpoints["qwen3_5"], blocks=64, kv_offloading_size=0.001)
    outs = _run(llm)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, HIT]
    assert llm.engine.stats().extra["external_prefix_cache_hits"] == 0
    assert llm.engine.runner.state_snapshots.num_host_restored == 1
    assert outs[3].outputs[0].logprobs == gpu_hit["qwen3_5"].outputs[0].logprobs
    _assert_clean(llm)


def test_reset_prefix_cache_keeps_the_host_snapshots_unless_asked(checkpoints, reference):
    llm = _llm(checkpoints["qwen3_5"], kv_offloading_size=0.001)
    snaps = llm.engine.runner.state_snapshots
    _run(llm, [0, 1, 2])
    assert llm.reset_prefix_cache() is True and len(snaps) == 0 and len(snaps.host_index) > 0
    again = _run(llm, [0])[0]
    assert again.num_cached_tokens == HIT and snaps.num_host_restored == 1
    assert llm.reset_prefix_cache(reset_connector=True) is True
    assert len(snaps.host_index) == 0 and len(llm.engine.kv.cpu) == 0
    fresh = _run(llm, [0])[0]
    assert fresh.num_cached_tokens == 0
    _assert_same([again, fresh], [reference["qwen3_5"][3]] * 2)
    _assert_clean(llm)


def test_aborts_and_preemption_leave_nothing_behind(checkpoints, reference):
    """Requests resuming from the CPU tier next to one that is aborted mid-prompt and others preempted by a pool too
    small for all of them: pools, host slots and state slots stay consistent, and a later hit is still exact."""
    from voltllm.engine.types import EngineCoreRequest

    llm = _llm(checkpoints["qwen3_5"], blocks=24, kv_offloading_size=0.001)
    _run(llm, [0, 1, 2])
    core = llm.engine
    core.add_request(EngineCoreRequest("x", PROMPTS[0] + [5] * 8, SamplingParams(max_tokens=24, ignore_eos=True)))
    core.add_request(EngineCoreRequest("y", PROMPTS[1][:20], SamplingParams(max_tokens=40, ignore_eos=True)))
    core.add_request(EngineCoreRequest("z", PROMPTS[2] + [7] * 3, SamplingParams(max_tokens=30, ignore_eos=True)))
    for _ in range(12):
        core.step()
        core.check_integrity()
    core.abort_requests(["z"])
    while core.has_unfinished_requests():
        core.step()
        core.check_integrity()
    snaps = core.runner.state_snapshots
    assert core.scheduler.num_preemptions > 0 and core.kv.cpu_hit_tokens > 0 and snaps.num_host_restored > 0
    _assert_clean(llm)
    _assert_same(_run(llm, [0]), [reference["qwen3_5"][3]])


def test_tensor_parallel_ranks_copy_their_own_heads_states(checkpoints, reference):
    llm = _llm(checkpoints["qwen3_5"], kv_offloading_size=0.002, tensor_parallel_size=2)
    try:
        outs = _run(llm)
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0, HIT]
        assert llm.engine.runner.state_snapshots.num_host_restored == 1
        _assert_same(outs, reference["qwen3_5"])
    finally:
        llm.engine.shutdown()


def test_a_size_without_room_for_a_block_beside_a_snapshot_is_refused(checkpoints):
    with pytest.raises(RuntimeError, match=r"holds no KV block next to 1 recurrent-state snapshot\(s\)"):
        _llm(checkpoints["qwen3_5"], kv_offloading_size=2e-6)


def test_a_hybrid_without_gpu_snapshots_is_refused():
    """No GPU memory for snapshots (build_state_snapshots gave none): no prefix cache for the CPU tier to extend."""
    from types import SimpleNamespace

    from voltllm.worker.kv_offload import _host_snapshot_slots

    with pytest.raises(RuntimeError, match="no recurrent-state snapshots on the GPU"):
        _host_snapshot_slots(SimpleNamespace(is_hybrid=True, state_snapshots=None, tp=None), 2**20)


def test_an_mtp_drafters_kv_moves_with_the_blocks(tmp_path_factory):
    """MTP on a hybrid: its layer's KV shares the target's blocks, so it goes to the CPU tier and back with them: the
    first prompt's blocks hold the same target and MTP KV after their trip as when it was computed, and the run after
    the CPU-tier hit gives the tokens of plain decoding (no logprobs: they take no drafts)."""
    import torch

    from mtp_models import make_mtp_target

    made = make_mtp_target(tmp_path_factory, "qwen3_5")
    if made is None:
        pytest.skip("this transformers has no qwen3_5")
    path, _ = made
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = _llm(path, blocks=20, kv_offloading_size=0.002, speculative_config={"method": "mtp",
                                                                               "num_speculative_tokens": 2})
    runner, kv = llm.engine.runner, llm.engine.kv
    caches = runner.kv_caches + runner.draft.kv_caches
    assert len(runner.kv_offload.parts) == len(caches) > len(runner.kv_caches)  # the MTP layer's KV too

    def blocks_of_first_prompt():
        from voltllm.cache.prefix import extend_block_hashes

        hashes: list = []
        extend_block_hashes(hashes, PROMPTS[0], 4, None)
        return [kv.pool.cached[h].block_id for h in hashes[:HIT // 4]]

    outs = [llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]]
    before = [c[:, blocks_of_first_prompt()].clone() for c in caches]
    outs += [llm.generate({"prompt_token_ids": PROMPTS[i]}, params, use_tqdm=False)[0] for i in ORDER[1:]]
    llm.engine.check_integrity()
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, HIT]
    assert llm.engine.stats().extra["external_prefix_cache_hits"] > 0
    assert runner.state_snapshots.num_host_restored == 1
    after = [c[:, blocks_of_first_prompt()] for c in caches]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    plain = _llm(path, blocks=20)
    assert outs[3].outputs[0].token_ids == plain.generate({"prompt_token_ids": PROMPTS[0]}, params,
                                                          use_tqdm=False)[0].outputs[0].token_ids
    _assert_clean(llm)
