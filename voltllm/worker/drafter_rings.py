"""Per-request ring buffers for a DFlash drafter's sliding-window layers.

A drafter's context K / V live in cache tensors addressed by the target's blocks (worker/dflash_runner.py), so they
cost bytes for every token of every context. A sliding-window layer (Qwen3.6's drafters: four of five, window 2,048)
only ever reads a block row's last W positions, so its K / V need not outlive them: each running request gets a ring
of C = R x block_size positions of its own (position p at ring slot p mod C), C >= W + k + 1, so the positions a
block reads (from its first row's window start to its last row, W + k of them) never share a slot, and a write
longer than C (a prompt chunk) keeps its last C positions. The ring's blocks are laid out as paged blocks, so the
attention kernels read them through an ordinary block table (logical block i of a request -> ring block
r x R + i mod R) and slot mapping, given to the windowed layers as their own metadata (ForwardContext.extra
["window_meta"], model/layers/paged_attention.py).

A ring holds only what the request's own steps wrote, so a prefix-cache hit must leave the window's positions to be
computed again (KVCacheManager.recompute_tail: the target recomputes them, their context K / V go into the ring),
and a preempted request, recomputed whole, takes any free ring. Rings are kept for --max-num-seqs requests and
freed when a request finishes, aborts or is preempted (DFlashRunner.forget).
"""
from __future__ import annotations

from typing import Optional

import numpy as np


class DrafterRings:
    def __init__(self, window: int, max_drafts: int, block_size: int, max_seqs: int):
        """window: the largest window of the drafter's layers; max_drafts: k, the most drafts of a block."""
        self.window = window
        self.block_size = block_size
        self.blocks = -(-(window + max_drafts + 1) // block_size)  # R
        self.capacity = self.blocks * block_size  # C positions per ring
        self.num_rings = max_seqs
        self._of: dict[str, int] = {}  # request id -> its ring
        self._free = list(range(max_seqs - 1, -1, -1))  # (popped from the end: ring 0 first)

    @property
    def num_blocks(self) -> int:
        """Blocks of each windowed layer's cache tensor (all rings)."""
        return self.num_rings * self.blocks

    @property
    def recompute_tail(self) -> int:
        """Tokens a prefix-cache hit leaves to compute: a block's first row reads the window before it."""
        return self.window

    def ring(self, request_id: str) -> int:
        r = self._of.get(request_id)
        if r is None:
            if not self._free:
                raise RuntimeError(f"DFlash drafter: no ring free for request {request_id!r} "
                                   f"({self.num_rings} rings, one per --max-num-seqs request)")
            r = self._of[request_id] = self._free.pop()
        return r

    def release(self, request_id: str) -> None:
        r = self._of.pop(request_id, None)
        if r is not None:
            self._free.append(r)

    @property
    def in_use(self) -> int:
        return len(self._of)

    def slots(self, ring: int, positions: np.ndarray) -> np.ndarray:
        """Ring slots of positions written together, in order (int64); -1 for those a later position of the same
        write takes the slot of (only the last C are kept)."""
        out = ring * self.capacity + positions % self.capacity
        if positions.size > self.capacity:
            out[:positions.size - self.capacity] = -1
        return out.astype(np.int64, copy=False)

    def table(self, ring: int, width: int, out: Optional[np.ndarray] = None, first: int = 0) -> np.ndarray:
        """A request's block-table row of `width` logical blocks: logical block i -> ring block ring x R + i mod R.
        first: only blocks first.. are filled (a window reads none before it; out keeps what it has there)."""
        row = ring * self.blocks + np.arange(first, width, dtype=np.int32) % self.blocks
        if out is not None:
            out[first:width] = row
            return out
        return np.concatenate([np.zeros(first, dtype=np.int32), row]) if first else row

    def first_block(self, position: int) -> int:
        """The first logical block a row at `position` reads (its window's start)."""
        return max(0, position - self.window + 1) // self.block_size
