"""--kv-cache-metrics (cache/residency.py): sampled KV blocks' lifetimes, idle times before eviction and reuse gaps,
through the block pool with a fake clock; sampling; in the engine; the flag's checks."""
import pytest

from voltllm.cache.block_pool import BlockPool
from voltllm.cache.residency import BlockResidency


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _pool(num_blocks=2, sample=1.0):
    clock = Clock()
    pool = BlockPool(num_blocks)
    pool.residency = BlockResidency(num_blocks, sample, clock=clock)
    return pool, clock


def test_lifetime_reuse_gap_and_idle_before_eviction():
    pool, clock = _pool()
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h")
    clock.t += 2.0
    pool.free_blocks([b])  # held 2 s
    clock.t += 3.0
    pool.touch([pool.get_cached_block(b"h")])  # a hit 5 s after the allocation, taken back from the free queue
    clock.t += 1.0
    pool.touch([b])  # a second holder 1 s later
    pool.free_blocks([b, b])  # held 1 s since the hit
    clock.t += 4.0
    other = pool.get_new_blocks(1)  # (the other, never cached, block first: no idle sample)
    assert other[0] is not b
    clock.t += 1.0
    pool.get_new_blocks(1)  # b evicted 5 s after its release
    got = pool.residency.take()
    assert got == {"lifetime": [2.0, 1.0], "idle_before_evict": [5.0], "reuse_gap": [5.0, 1.0]}
    assert pool.residency.take() == {"lifetime": [], "idle_before_evict": [], "reuse_gap": []}


def test_sampling_share_is_seeded():
    def sampled(seed):
        pool = BlockPool(1000)
        pool.residency = BlockResidency(1000, 0.25, seed=seed)
        blocks = pool.get_new_blocks(1000)
        pool.free_blocks(blocks)
        return len(pool.residency.take()["lifetime"])

    assert sampled(0) == sampled(0) and 200 < sampled(0) < 300
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        BlockResidency(4, 0.0)


def test_in_the_engine_and_the_flags_checks(tmp_path):
    from tiny_models import make_model
    from voltllm import LLM, SamplingParams
    from voltllm.config import ConfigError

    path = make_model(str(tmp_path / "m"), "llama")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = list(range(3, 40))
    off = LLM(path, block_size=4)
    off.generate({"prompt_token_ids": ids}, sp)
    assert off.engine.stats().kv_block_samples == {}
    llm = LLM(path, block_size=4, kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    llm.generate({"prompt_token_ids": ids}, sp)
    llm.generate({"prompt_token_ids": ids}, sp)  # (the same prompt: hits on its cached blocks)
    got = llm.engine.stats().kv_block_samples
    assert len(got["lifetime"]) >= 2 * 9 and len(got["reuse_gap"]) >= 9 and all(v >= 0 for v in got["lifetime"])
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="kv-cache-metrics-sample"):
            LLM(path, block_size=4, kv_cache_metrics=True, kv_cache_metrics_sample=bad)
