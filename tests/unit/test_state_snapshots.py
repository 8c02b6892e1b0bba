"""Prefix caching for hybrid models: recurrent-state snapshots at --mamba-block-size boundaries
(voltllm/cache/state_snapshots.py). The pool alone (hits, chunk caps, LRU, integrity), then through the
whole engine on tiny random Qwen3.5 / Qwen3-Next checkpoints (CPU, fp32): requests sharing a long prefix get
prefix-cache hits and exactly the greedy tokens of a cold run (prefix caching off), with chunked prefill,
preemption and async scheduling in the mix; nothing leaks."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from voltllm.cache.state_snapshots import StateSnapshots, resolve_mamba_block_size
from voltllm.model.state_cache import StateCache


# ---------------------------------------------------------------------------------------------
# the pool alone
# ---------------------------------------------------------------------------------------------
def _req(rid: str, tokens: list[int], salt=None):
    return SimpleNamespace(request_id=rid, all_token_ids=list(tokens), block_hashes=[], cache_salt=salt,
                           lora_key=None, content_spans=())


def _sched(req, start: int, n: int):
    return SimpleNamespace(request=req, start=start, num_new_tokens=n, spec_tokens=())


def _cache(slots: int = 3) -> StateCache:
    return StateCache(2, slots, (3, 8), (2, 4, 4), torch.float32)


def _fill(cache: StateCache, slot: int, value: float) -> None:
    for c, s in zip(cache.conv, cache.ssm):
        c[slot].fill_(value)
        s[slot].fill_(value + 0.5)


def test_save_restore_and_lru():
    cache = _cache()
    snaps = StateSnapshots(cache, num_snapshots=2, mamba_block_size=8, block_size=4)
    a = _req("a", range(40))
    slot = cache.allocate("a")
    _fill(cache, slot, 1.0)
    snaps.after_forward([_sched(a, 0, 13)], [slot])  # ends off-boundary: nothing
    assert len(snaps) == 0
    snaps.after_forward([_sched(a, 13, 3)], [slot])  # ends at 16
    _fill(cache, slot, 2.0)
    snaps.after_forward([_sched(a, 16, 8)], [slot])  # ends at 24
    assert len(snaps) == 2 and snaps.num_saved == 2
    snaps.check_integrity()

    # a new request with the same first 20 tokens: KV blocks 0..4 cached -> deepest snapshot boundary 16
    b = _req("b", list(range(20)) + [99] * 10)
    assert snaps.limit_hit(b, 5) == 4  # blocks, i.e. 16 tokens
    slot_b = cache.allocate("b")
    snaps.before_forward([_sched(b, 16, 4)], [slot_b])
    assert cache.num_tokens[slot_b] == 16 and snaps.num_restored == 1
    assert torch.all(cache.conv[0][slot_b] == 1.0) and torch.all(cache.ssm[1][slot_b] == 1.5)
    # a request resuming normally is left alone
    cache.num_tokens[slot_b] = 20
    _fill(cache, slot_b, 7.0)
    snaps.before_forward([_sched(b, 20, 4)], [slot_b])
    assert torch.all(cache.conv[0][slot_b] == 7.0)

    # LRU: 16 was used last, so saving a third boundary evicts 24
    c = _req("c", [5] * 40)
    slot_c = cache.allocate("c")
    snaps.after_forward([_sched(c, 0, 8)], [slot_c])
    assert snaps.num_evicted == 1 and len(snaps) == 2
    assert snaps.limit_hit(_req("a2", range(40)), 6) == 4  # 24 is gone, 16 is still there
    snaps.check_integrity()
    snaps.reset()
    assert len(snaps) == 0
    snaps.check_integrity()


def test_limit_hit_targets_and_chunk_caps():
    cache = _cache()
    snaps = StateSnapshots(cache, num_snapshots=4, mamba_block_size=8, block_size=4)
    a = _req("a", range(64))
    slot = cache.allocate("a")
    snaps.after_forward([_sched(a, 0, 16)], [slot])  # snapshot at 16

    # no snapshot boundary inside the chunk -> unchanged; crossing 24 (no snapshot) -> cut at 24
    assert snaps.cap_new_tokens(a, 16, 5) == 5
    assert snaps.cap_new_tokens(a, 16, 12) == 8
    assert snaps.cap_new_tokens(a, 16, 30) == 24  # the last boundary crossed (40), one cut per chunk
    assert snaps.cap_new_tokens(a, 0, 20) == 20  # 16 has a snapshot already
    assert snaps.cap_new_tokens(a, 16, 16) == 16  # ends on a boundary
    # a boundary past the tokens known on the host (async pending token) is not a cut point
    short = _req("s", range(23))
    assert snaps.cap_new_tokens(short, 17, 7) == 7

    # the KV hit reaches 36 tokens but the deepest snapshot is at 16: first chunk is cut at 32
    b = _req("b", list(range(36)) + [7] * 20)
    assert snaps.limit_hit(b, 9) == 4
    with pytest.raises(AssertionError, match="targets"):  # a target of a request that is gone is a leak
        snaps.check_integrity(live_request_ids=set())
    snaps.check_integrity(live_request_ids={"b"})
    assert snaps.cap_new_tokens(b, 16, 40) == 16
    assert snaps.cap_new_tokens(b, 32, 20) == 16  # target reached: back to the last-boundary rule (48)
    assert "b" not in snaps._targets
    assert snaps.limit_hit(b, 9) == 4
    snaps.forget("b")
    snaps.check_integrity(live_request_ids=set())

    # the cache salt is part of the key
    salted = _req("x", range(64), salt="tenant-2")
    assert snaps.limit_hit(salted, 8) == 0


def test_mamba_block_size_rules():
    assert resolve_mamba_block_size(None, 16) == 512
    assert resolve_mamba_block_size(None, 48) == 528
    assert resolve_mamba_block_size(32, 16) == 32
    with pytest.raises(ValueError, match="multiple of --block-size"):
        resolve_mamba_block_size(24, 16)


# ---------------------------------------------------------------------------------------------
# through the engine
# ---------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")

from tiny_models import HYBRID_MOE as MOE, HYBRID_VOCAB as VOCAB, make_tiny_hybrid  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {kind: make_tiny_hybrid(tmp_path_factory.mktemp(kind), kind, 300 + i, 400 + i, conv_std=0.4,
                                   **(MOE if kind == "qwen3_next" else {}))
            for i, kind in enumerate(("qwen3_5", "qwen3_next"))}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(0, VOCAB, (45,), generator=g).tolist()
    tails = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (15, 8, 19)]
    other = torch.randint(0, VOCAB, (33,), generator=g).tolist()
    return [shared + tails[0], shared + tails[1], shared + tails[2], other]


def _generate(llm, prompts, n=20):
    from voltllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))  # (min_tokens would
    # make every step wait for the previous one's token: no async overlap)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _assert_clean(llm) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.step()  # slots of requests that finished in the last step are released at the next schedule
    eng.check_integrity()
    assert eng.kv.usage() == 0.0
    assert eng.runner.state_cache.num_free == eng.runner.state_cache.num_slots
    snaps = eng.runner.state_snapshots
    if snaps is not None:
        snaps.check_integrity(live_request_ids=set())
        assert not snaps._targets


@pytest.fixture(scope="module")
def cold_tokens(checkpoints):
    """Greedy tokens with prefix caching off (--mamba-cache-mode none), one request at a time."""
    from voltllm import LLM

    out = {}
    for kind, path in checkpoints.items():
        llm = LLM(path, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16, mamba_cache_mode="none")
        assert llm.engine.runner.state_snapshots is None and not llm.engine.kv.enable_caching
        out[kind] = [_generate(llm, [p])[0][0] for p in _prompts()]
        _assert_clean(llm)
    return out


@pytest.fixture
def roomy_pool(monkeypatch):
    """Tests fix the KV blocks (--num-gpu-blocks-override), which sizes the pool at its minimum: raise it."""
    from voltllm.cache import state_snapshots as S

    monkeypatch.setattr(S, "MIN_SNAPSHOTS", 32)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_shared_prefix_hits_equal_cold_run(checkpoints, cold_tokens, roomy_pool, kind, async_scheduling):
    from voltllm import LLM

    prompts = _prompts()
    llm = LLM(checkpoints[kind], skip_tokenizer_init=True, block_size=4, mamba_block_size=8,
              max_num_batched_tokens=16, num_gpu_blocks_override=36, async_scheduling=async_scheduling)
    snaps = llm.engine.runner.state_snapshots
    assert snaps is not None and llm.engine.kv.state_prefix is snaps
    # request 0 alone: chunks of 16 end on boundaries (16, 32, 48), the last chunk is cut at 56
    toks, cached = _generate(llm, prompts[:1])
    assert toks[0] == cold_tokens[kind][0] and cached == [0]
    assert snaps.num_saved >= 4
    # the other three together, in a KV cache small enough to preempt: 1 and 2 share 45 tokens with 0
    toks, cached = _generate(llm, prompts[1:])
    assert toks == cold_tokens[kind][1:]
    assert cached[0] > 0 and cached[1] > 0 and cached[2] == 0
    assert all(c % 8 == 0 for c in cached)
    assert snaps.num_restored >= 2
    assert llm.engine.stats().num_preemptions > 0
    _assert_clean(llm)
    # the same prompt again: a hit up to the deepest snapshot boundary before its last token
    toks, cached = _generate(llm, prompts[:1])
    assert toks[0] == cold_tokens[kind][0] and cached[0] > 0  # its KV blocks may be evicted past 32
    _assert_clean(llm)


def test_identical_prompts_in_one_batch_and_tiny_pool(checkpoints, cold_tokens):
    """Snapshots evicted (pool of 4), identical prompts admitted in the same step (the second cannot use a
    snapshot the first saves in that step): still the cold tokens."""
    from voltllm import LLM
    from voltllm.cache import state_snapshots as S

    prompts = _prompts()
    llm = LLM(checkpoints["qwen3_5"], skip_tokenizer_init=True, block_size=4, mamba_block_size=4,
              max_num_batched_tokens=24, num_gpu_blocks_override=200)
    snaps = llm.engine.runner.state_snapshots
    assert snaps.capacity == S.MIN_SNAPSHOTS
    toks, cached = _generate(llm, [prompts[0], prompts[0], prompts[1], prompts[3]])
    assert toks == [cold_tokens["qwen3_5"][i] for i in (0, 0, 1, 3)]
    assert snaps.num_evicted > 0
    toks, cached = _generate(llm, [prompts[2], prompts[0]])
    assert toks == [cold_tokens["qwen3_5"][i] for i in (2, 0)]
    assert cached[1] > 0
    _assert_clean(llm)


def test_mode_none_says_so(checkpoints, caplog):
    from voltllm import LLM

    with caplog.at_level(logging.WARNING, logger="voltllm"):
        llm = LLM(checkpoints["qwen3_5"], skip_tokenizer_init=True, mamba_cache_mode="none")
    assert "prefix caching is off for this hybrid model" in caplog.text
    assert "--mamba-cache-mode none" in caplog.text
    assert llm.engine.runner.state_snapshots is None


def test_bad_mamba_block_size(checkpoints):
    from voltllm import LLM

    with pytest.raises(ValueError, match="multiple of --block-size"):
        LLM(checkpoints["qwen3_5"], skip_tokenizer_init=True, block_size=4, mamba_block_size=6)


def test_verification_steps_save_no_snapshot():
    """A speculative verification that ends on a boundary holds its drafts' state, accepted or not: no snapshot
    (the hash would even name the drafts as if they were the prefix, were they on the host)."""
    cache = _cache()
    snaps = StateSnapshots(cache, num_snapshots=2, mamba_block_size=8, block_size=4)
    a = _req("a", range(40))
    slot = cache.allocate("a")
    verify = SimpleNamespace(request=a, start=5, num_new_tokens=3, spec_tokens=(6, 7))
    snaps.after_forward([verify], [slot])
    assert len(snaps) == 0
    snaps.after_forward([_sched(a, 5, 3)], [slot])
    assert len(snaps) == 1


def test_evicted_snapshots_go_to_host_slots_and_come_back_from_there():
    """--kv-offloading-size: a snapshot the pool evicts is copied to a host slot first (before its row is rewritten,
    even by two saves in one step), found by limit_hit, and restored from the host straight into a slot."""
    cache = _cache()
    snaps = StateSnapshots(cache, num_snapshots=1, mamba_block_size=8, block_size=4)
    snaps.attach_host(StateCache(2, 2, (3, 8), (2, 4, 4), torch.float32))
    a, c = _req("a", range(40)), _req("c", [5] * 40)
    slot_a, slot_c = cache.allocate("a"), cache.allocate("c")
    _fill(cache, slot_a, 1.0)
    snaps.after_forward([_sched(a, 0, 8)], [slot_a])  # a@8 in the pool
    _fill(cache, slot_a, 2.0)
    _fill(cache, slot_c, 3.0)
    # one step saves a@16 and c@8 into the pool's only row: a@8, then a@16, go to the host, each with its contents
    saves = snaps.plan_saves([_sched(a, 8, 8), _sched(c, 0, 8)], [slot_a, slot_c])
    assert [(s, r) for s, r, _ in saves] == [(slot_a, 0), (slot_c, 0)] and all(h >= 0 for _, _, h in saves)
    snaps.apply_saves(saves)
    assert snaps.num_offloaded == 2 and len(snaps) == 1 and len(snaps.host_index) == 2
    snaps.check_integrity()
    # a request sharing a's first 20 tokens resumes at 16, from the host
    b = _req("b", list(range(20)) + [99] * 10)
    assert snaps.limit_hit(b, 5) == 4
    slot_b = cache.allocate("b")
    done = snaps.before_forward([_sched(b, 16, 4)], [slot_b])
    assert done == [(saves[1][2], slot_b, 16, True)] and snaps.num_host_restored == 1
    assert torch.all(cache.conv[0][slot_b] == 2.0) and torch.all(cache.ssm[1][slot_b] == 2.5)
    # the host keeps its snapshots over a reset of the pool; reset_host drops them
    snaps.reset()
    assert snaps.limit_hit(_req("b2", list(range(20))), 5) == 4
    snaps.reset_host()
    assert snaps.limit_hit(_req("b3", list(range(20))), 5) == 0
    snaps.check_integrity()
