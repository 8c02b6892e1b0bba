"""The CPU tier of the prefix cache (--kv-offloading-size): the host-slot LRU, the KV manager's saves on eviction and
loads on a later hit, the scheduler's step copies under pressure (preemption, aborts) against a simulated KV memory,
and the runner's copies on real tensors."""
from __future__ import annotations

import random

import pytest
import torch

from voltllm.cache.cpu_offload import CpuBlockIndex, KVTransfers
from voltllm.cache.kv_manager import KVCacheManager
from voltllm.config import SchedulerConfig
from voltllm.engine.request import Request
from voltllm.engine.scheduler import RunnerOutput, Scheduler
from voltllm.engine.types import EngineCoreRequest
from voltllm.sampling.params import SamplingParams
from voltllm.worker.kv_offload import HostKVStore, slot_layout


# -- the host-slot index -------------------------------------------------------------------------------------------
def test_index_is_an_lru_keyed_by_hash():
    idx = CpuBlockIndex(3)
    assert [idx.store(h) for h in (b"a", b"b", b"c")] == [0, 1, 2]
    assert idx.store(b"a") is None  # held: not saved again, and now the most recent
    assert idx.store(b"d") == 1  # evicts b, the least recently used
    assert b"b" not in idx and b"d" in idx and len(idx) == 3
    assert idx.lookup_run([b"c", b"a", b"b", b"d"]) == [2, 0]  # stops at the first miss
    assert idx.store(b"e") == 1  # d is now the oldest (c and a were looked up)
    idx.check_integrity()


def test_pinned_slots_are_not_evicted():
    idx = CpuBlockIndex(2)
    idx.store(b"a"), idx.store(b"b")
    idx.pin(idx.lookup_run([b"a"]))
    assert idx.store(b"c") == 1  # b, not the pinned a (b became the oldest unpinned)
    idx.pin([1])
    assert idx.store(b"d") is None  # every slot pinned: the block is not saved
    with pytest.raises(RuntimeError):
        idx.reset()
    with pytest.raises(AssertionError, match="pinned"):
        idx.check_integrity()
    idx.unpin_all()
    idx.reset()
    assert len(idx) == 0 and idx.store(b"x") == 0
    idx.check_integrity()


# -- the KV manager ------------------------------------------------------------------------------------------------
def _req(rid, tokens, max_tokens=4):
    return Request(EngineCoreRequest(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True)), 512)


def _admit(kv, req):
    hits, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def test_evicted_cached_blocks_are_saved_and_hit_again_from_the_cpu():
    kv = KVCacheManager(6, 4, cpu_blocks=8)
    a = _req("a", range(100, 117))  # 4 full blocks + 1 token
    assert _admit(kv, a) == 0 and kv.take_transfers() is None
    a_blocks = kv.block_ids(a)[:4]
    kv.free(a)
    b = _req("b", range(200, 221))  # 6 blocks: every block, a's 4 full ones among them
    _admit(kv, b)
    t = kv.take_transfers()
    assert not t.loads and sorted(g for g, _ in t.saves) == sorted(a_blocks)
    assert len({s for _, s in t.saves}) == 4
    kv.free(b)
    kv.check_integrity()
    again = _req("a2", range(100, 117))
    hit = _admit(kv, again)
    assert hit == 16  # every full block of the prompt from the CPU tier (one token left to compute)
    t = kv.take_transfers()
    assert [g for _, g in t.loads] == kv.block_ids(again)[:4]
    assert kv.cpu_hit_tokens == 16 and kv.cpu_queries == 17 + 21 + 17  # (every lookup: its prompt tokens)
    # the loaded blocks are registered: a third request hits them on the GPU
    third = _req("a3", range(100, 117))
    hits, n = kv.get_computed_blocks(third)
    assert [b.block_id for b in hits] == kv.block_ids(again)[:4] and n == 16
    kv.take_transfers()
    kv.check_integrity()


def test_cpu_hits_are_cut_to_the_free_gpu_blocks():
    kv = KVCacheManager(8, 4, cpu_blocks=8)
    a = _req("a", range(100, 125))  # 6 full blocks + 1 token
    _admit(kv, a)
    kv.free(a)
    hog = _req("hog", range(300, 332))  # 8 blocks: every cached block of a is evicted to the CPU tier
    _admit(kv, hog)
    kv.take_transfers()
    kv.free(hog)
    busy = _req("busy", range(400, 420))  # holds 5 blocks: 3 free
    _admit(kv, busy)
    kv.take_transfers()
    again = _req("a2", range(100, 125))
    hits, n = kv.get_computed_blocks(again)
    assert not hits and n == 2 * 4  # 3 free blocks: 2 hits, one block left for what is computed
    assert kv.allocate_slots(again, 4, hits) is not None
    assert len(kv.take_transfers().loads) == 2
    kv.check_integrity()


def test_a_failed_allocation_leaves_nothing_pinned_or_planned():
    kv = KVCacheManager(6, 4, cpu_blocks=8)
    a = _req("a", range(100, 117))
    _admit(kv, a)
    kv.free(a)
    b = _req("b", range(200, 221))
    _admit(kv, b)  # every block: a's saved
    kv.take_transfers()
    kv.free(b)
    c = _req("c", range(500, 509))  # 3 blocks held: 3 free
    _admit(kv, c)
    kv.take_transfers()
    again = _req("a2", range(100, 117))
    hits, n = kv.get_computed_blocks(again)
    assert n == 8
    assert kv.allocate_slots(again, 100, hits) is None  # far more than is free
    assert kv.take_transfers() is None
    kv.check_integrity()


def test_prompt_logprobs_requests_take_no_cpu_hits():
    kv = KVCacheManager(6, 4, cpu_blocks=8)
    a = _req("a", range(100, 117))
    _admit(kv, a)
    kv.free(a)
    _admit(kv, _req("b", range(200, 221)))
    kv.take_transfers()
    r = Request(EngineCoreRequest("p", list(range(100, 117)), SamplingParams(max_tokens=1, prompt_logprobs=1)), 512)
    assert kv.get_computed_blocks(r) == ([], 0)


# -- the scheduler with a simulated KV memory ----------------------------------------------------------------------
class _Memory:
    """What each GPU block and host slot holds: the tokens of the prefix whose last block it is (a stand-in for its
    K / V, which depend on the whole prefix); None: never written."""

    def __init__(self, kv: KVCacheManager):
        self.gpu: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}
        self.kv = kv
        self.loaded = 0

    def step(self, out) -> None:
        t = out.kv_transfers
        if t is not None:
            for g, s in t.saves:  # saves first: the loads may land in the blocks they read
                assert g in self.gpu, f"block {g} saved before anything was written to it"
                self.host[s] = self.gpu[g]
            for s, g in t.loads:
                self.gpu[g] = self.host[s]
                self.loaded += 1
        bs = self.kv.block_size
        for s in out.scheduled:  # the forward: every computed block before the step holds its prefix
            toks = s.request.all_token_ids
            for i in range(s.start // bs):
                assert self.gpu.get(s.block_ids[i]) == tuple(toks[:(i + 1) * bs]), (
                    f"{s.request.request_id}: block {i} ({s.block_ids[i]}) holds another prefix")
            for i in range(s.start // bs, (s.start + s.num_new_tokens) // bs):
                self.gpu[s.block_ids[i]] = tuple(toks[:(i + 1) * bs])


@pytest.mark.parametrize("blocks,cpu_blocks", [(24, 64), (14, 6), (40, 3)])
def test_scheduler_copies_keep_every_prefix_hit_exact(blocks, cpu_blocks):
    """Conversations that return to earlier prompts under a pool that evicts them, with preemptions and aborts: every
    block a step reads holds its prefix, the CPU tier serves hits, nothing leaks."""
    rng = random.Random(blocks)
    kv = KVCacheManager(blocks, 4, cpu_blocks=cpu_blocks)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=512), kv)
    mem = _Memory(kv)
    bases = [[rng.randrange(1000) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    n = 0
    for _ in range(300):
        if len(sched.requests) < 4 and rng.random() < 0.5:
            base = rng.choice(bases)
            tail = [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
            sched.add_request(_req(f"r{n}", base + tail, max_tokens=rng.randrange(1, 8)))
            n += 1
        if sched.requests and rng.random() < 0.05:
            sched.abort_requests([rng.choice(sorted(sched.requests))])
        out = sched.schedule()
        mem.step(out)
        res = RunnerOutput()
        for s in out.scheduled:
            if s.samples:
                res.sampled[s.request.request_id] = sum(s.request.all_token_ids) % 1000
        sched.update(out, res)
        kv.check_integrity()
    while sched.has_unfinished():
        out = sched.schedule()
        mem.step(out)
        sched.update(out, RunnerOutput(sampled={s.request.request_id: 7 for s in out.scheduled if s.samples}))
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert mem.loaded > 0 and kv.cpu_hit_tokens > 0
    assert sched.stats().extra["external_prefix_cache_hits"] == kv.cpu_hit_tokens


# -- the runner's copies ---------------------------------------------------------------------------------------------
def test_host_store_moves_blocks_of_every_cache():
    """Caches of several dtypes and shapes (a model's layers, fp8 codes, a drafter's), chunked by a small staging
    buffer, consecutive and scattered slots: a block saved and loaded elsewhere is bit-exact, others are untouched."""
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 10, 4, 2, 8, generator=gen) for _ in range(2)]
    caches.append(torch.randint(0, 256, (2, 10, 4, 1, 6), generator=gen, dtype=torch.uint8))
    caches.append(torch.randn(2, 10, 4, 3, 4, generator=gen).half())
    _, slot_bytes = slot_layout(caches)
    store = HostKVStore(caches, 8, torch.empty(3 * slot_bytes, dtype=torch.uint8), pin=False)
    assert store.staging.shape[0] == 3
    before = [c.clone() for c in caches]
    saves = [(7, 0), (2, 1), (5, 2), (9, 3), (1, 6)]
    store.apply(KVTransfers(saves=saves))
    assert all(torch.equal(c, b) for c, b in zip(caches, before))  # a save reads only
    loads = [(6, 0), (3, 4), (0, 8), (1, 9)]  # slots 6, 3, 0, 1 held blocks 1, 9, 7, 2
    store.apply(KVTransfers(loads=loads))
    for c, b in zip(caches, before):
        for src, dst in ((1, 0), (9, 4), (7, 8), (2, 9)):
            assert torch.equal(c[:, dst], b[:, src])
        for untouched in (1, 2, 3, 5, 6, 7):
            assert torch.equal(c[:, untouched], b[:, untouched])


def test_metrics_export_the_cpu_tier_under_vllms_names():
    from voltllm.engine.types import SchedulerStats
    from voltllm.entrypoints.openai.metrics import ServerMetrics

    stats = SchedulerStats(extra={"external_prefix_cache_queries": 400, "external_prefix_cache_hits": 96})
    text = ServerMetrics("m", lambda: stats, lambda: True, lambda: 0, max_model_len=64).render().decode()
    for prefix in ("voltllm", "vllm"):
        assert f'{prefix}:external_prefix_cache_queries_total{{engine="0",model_name="m"}} 400.0' in text
        assert f'{prefix}:external_prefix_cache_hits_total{{engine="0",model_name="m"}} 96.0' in text
    plain = ServerMetrics("m", SchedulerStats, lambda: True, lambda: 0, max_model_len=64).render().decode()
    assert "external_prefix_cache" not in plain


# -- hybrid models: a hit ends at a snapshot boundary, its blocks and snapshot from either tier ---------------------
def test_hybrid_hits_resume_at_a_snapshot_boundary_across_both_tiers():
    from types import SimpleNamespace

    from voltllm.cache.state_snapshots import StateSnapshots
    from voltllm.model.state_cache import StateCache

    cache = StateCache(1, 2, (3, 4), (2, 2, 2), torch.float32)
    snaps = StateSnapshots(cache, num_snapshots=1, mamba_block_size=8, block_size=4)
    snaps.attach_host(StateCache(1, 4, (3, 4), (2, 2, 2), torch.float32))
    kv = KVCacheManager(8, 4, cpu_blocks=8)
    kv.state_prefix = snaps
    a = _req("a", range(100, 125))  # 6 full blocks + 1 token
    _admit(kv, a)
    slot = cache.allocate("a")
    for start in (0, 8, 16):  # snapshots at 8, 16 and 24: a pool of one sends 8 and 16 to the host
        snaps.after_forward([SimpleNamespace(request=a, start=start, num_new_tokens=8, spec_tokens=())], [slot])
    assert len(snaps) == 1 and len(snaps.host_index) == 2 and snaps.num_offloaded == 2
    kv.free(a)
    hog = _req("hog", range(300, 332))  # 8 blocks: every cached block of a goes to the CPU tier
    _admit(kv, hog)
    kv.take_transfers()
    kv.free(hog)
    # every block from the CPU tier, up to the pool's snapshot at 24
    again = _req("a2", range(100, 125))
    hits, n = kv.get_computed_blocks(again)
    assert not hits and n == 24 and kv.cpu_hit_tokens == 0  # (counted when a lookup admits its request)
    kv.take_transfers()
    # without it, the host's snapshot at 16 limits the CPU-tier hit (the blocks past it stay unpinned, not loaded)
    snaps.reset()
    hits, n = kv.get_computed_blocks(again)
    assert not hits and n == 16
    assert kv.allocate_slots(again, again.num_tokens - n, hits) is not None
    assert len(kv.take_transfers().loads) == 4
    again.num_computed_tokens = again.num_tokens
    kv.free(again)
    # GPU hits past the deepest snapshot are cut back to it too (the host's at 16: no CPU block needed)
    third = _req("a3", range(100, 125))
    hits, n = kv.get_computed_blocks(third)
    assert len(hits) == 4 and n == 16
    kv.take_transfers()
    kv.check_integrity()
    snaps.check_integrity()


def test_a_request_waiting_for_blocks_is_counted_once():
    """The prefix-cache counters (GPU and CPU tier) count the lookup that admits a request, not each step's retry
    while it waits for free blocks: the hit rates stay true under memory pressure."""
    kv = KVCacheManager(6, 4, cpu_blocks=8)
    a = _req("a", range(100, 117))  # 5 blocks of prompt
    _admit(kv, a)
    kv.free(a)
    hog = _req("hog", range(300, 320))  # 5 blocks: 4 of a's cached blocks go to the CPU tier
    _admit(kv, hog)
    kv.take_transfers()
    again = _req("again", range(100, 117))
    for _ in range(3):  # the hog holds the pool: the lookup finds the hits, the allocation fails, it waits
        hits, n = kv.get_computed_blocks(again)
        assert n > 0 and kv.allocate_slots(again, again.num_tokens - n, hits) is None
        kv.take_transfers()
    assert (kv.prefix_queries, kv.cpu_queries) == (17 + 20, 17 + 20) and kv.cpu_hit_tokens == 0
    kv.free(hog)
    hits, n = kv.get_computed_blocks(again)
    assert kv.allocate_slots(again, again.num_tokens - n, hits) is not None
    assert (kv.prefix_queries, kv.cpu_queries) == (17 + 20 + 17,) * 2  # (its three waits not counted)
    assert kv.prefix_hits + kv.cpu_hit_tokens == n and kv.cpu_hit_tokens > 0
    kv.take_transfers()
