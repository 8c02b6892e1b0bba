"""vLLM's --kv-cache-metrics: how long sampled KV blocks stay, as three histograms (GET /metrics).

A block freshly allocated is sampled with probability --kv-cache-metrics-sample (a seeded generator: runs repeat)
and followed until it is evicted (its cached content dropped for new content):
- lifetime: from being taken (allocated, or taken back from the free queue by a prefix-cache hit) to the release of
  its last reference;
- idle before eviction: from that release to the eviction of its cached content;
- reuse gap: from its previous access (allocation or hit) to a prefix-cache hit on it.
Samples gather here and leave with the engine's stats (`take`), so the API process observes each once.
"""
from __future__ import annotations

import random
import time
from typing import Callable, Optional


class BlockResidency:
    def __init__(self, num_blocks: int, sample: float, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"--kv-cache-metrics-sample must be in (0, 1], got {sample}")
        self.sample = sample
        self._rng = random.Random(seed)
        self._clock = clock
        self._taken: list[Optional[float]] = [None] * num_blocks  # a sampled block's current hold start
        self._access: list[Optional[float]] = [None] * num_blocks  # its last access (allocation or hit)
        self._freed: list[Optional[float]] = [None] * num_blocks  # its last release
        self.lifetimes: list[float] = []
        self.idle_before_evict: list[float] = []
        self.reuse_gaps: list[float] = []

    def allocated(self, block_id: int) -> None:
        """A block allocated for new content (after evicted(), which closes its former sample)."""
        if self._rng.random() < self.sample:
            now = self._clock()
            self._taken[block_id] = self._access[block_id] = now
            self._freed[block_id] = None

    def hit(self, block_id: int, was_free: bool) -> None:
        """A prefix-cache hit took a reference on the block (was_free: it came back from the free queue)."""
        last = self._access[block_id]
        if last is None:
            return
        now = self._clock()
        self.reuse_gaps.append(now - last)
        self._access[block_id] = now
        if was_free:
            self._taken[block_id], self._freed[block_id] = now, None

    def freed(self, block_id: int) -> None:
        """The block's last reference went (it joins the free queue, cached content kept)."""
        taken = self._taken[block_id]
        if taken is None:
            return
        now = self._clock()
        self.lifetimes.append(now - taken)
        self._taken[block_id], self._freed[block_id] = None, now

    def evicted(self, block_id: int, cached: bool) -> None:
        """The block leaves the free queue for new content (cached: its cached content is dropped)."""
        freed = self._freed[block_id]
        if freed is not None and cached:
            self.idle_before_evict.append(self._clock() - freed)
        self._taken[block_id] = self._access[block_id] = self._freed[block_id] = None

    def take(self) -> dict:
        """The samples since the last take (cleared)."""
        out = {"lifetime": self.lifetimes, "idle_before_evict": self.idle_before_evict, "reuse_gap": self.reuse_gaps}
        self.lifetimes, self.idle_before_evict, self.reuse_gaps = [], [], []
        return out
