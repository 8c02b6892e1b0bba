"""Paged KV block pool: ref counts, an O(1) LRU of free blocks, and the hash -> block map.

A freed block keeps its hash and goes to the tail of the free queue, so a later request with the same
prefix can take it back (a prefix-cache hit). Blocks are evicted from the head, least recently freed
first, only when a new block is needed.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.prev_free: Optional[Block] = None
        self.next_free: Optional[Block] = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from the middle (cache hits)."""

    def __init__(self, blocks: list[Block]):
        self.num_free = len(blocks)
        self._head = Block(-1)
        self._tail = Block(-1)
        prev = self._head
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> Block:
        b = self._head.next_free
        if b is self._tail or b is None:
            raise RuntimeError("no free KV blocks")
        self.remove(b)
        return b

    def remove(self, b: Block) -> None:
        if b.prev_free is None or b.next_free is None:
            raise RuntimeError(f"{b} is not in the free queue")
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def append(self, b: Block) -> None:
        last = self._tail.prev_free
        last.next_free, b.prev_free = b, last
        b.next_free, self._tail.prev_free = self._tail, b
        self.num_free += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free

    def contains(self, b: Block) -> bool:
        return b.prev_free is not None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        # --kv-offloading-size: told of each cached block about to be reused (its hash still set), so its contents can
        # be saved to the CPU tier first (kv_manager.py)
        self.on_evict: Optional[Callable[[Block], None]] = None
        self.residency = None  # --kv-cache-metrics: a BlockResidency following sampled blocks (cache/residency.py)
        # --kv-events-config: a KVEventRecorder told of each hash leaving the map and of resets (cache/kv_events.py;
        # the manager records the stores, which need the request's tokens)
        self.events = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Optional[Block]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if self.residency is not None:
                self.residency.evicted(b.block_id, b.block_hash is not None)
            self._evict(b)
            b.ref_cnt = 1
            if self.residency is not None:
                self.residency.allocated(b.block_id)
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        if b.block_hash is not None:
            if self.cached.get(b.block_hash) is b:
                if self.on_evict is not None:
                    self.on_evict(b)
                del self.cached[b.block_hash]
                if self.events is not None:
                    self.events.removed((b.block_hash,))
            b.block_hash = None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free queue."""
        for b in blocks:
            if self.residency is not None:
                self.residency.hit(b.block_id, b.ref_cnt == 0)
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; give blocks in eviction order (tail blocks of a request first)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None or not self.enable_caching:
                    b.block_hash = None
                self.free_queue.append(b)
                if self.residency is not None:
                    self.residency.freed(b.block_id)

    def cache_block(self, b: Block, block_hash: bytes) -> bool:
        """Put a full block in the hash map; False when it did not enter (already hashed, or a duplicate)."""
        if not self.enable_caching or b.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; this one stays private
        b.block_hash = block_hash
        self.cached[block_hash] = b
        return True

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def check_integrity(self, expected_refs: Optional[dict[int, int]] = None) -> None:
        """Raise AssertionError when the pool's bookkeeping is inconsistent.

        expected_refs: block_id -> number of requests holding it (from the manager), checked if given.
        """
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == self.free_queue.num_free, "free count drifted from the free list"
        assert len(set(free_ids)) == len(free_ids), "a block is twice in the free list"
        free = set(free_ids)
        for b in self.blocks:
            if b.block_id in free:
                assert b.ref_cnt == 0, f"{b} is free but referenced"
            else:
                assert b.ref_cnt > 0, f"{b} is neither free nor referenced (leaked)"
            if expected_refs is not None:
                assert b.ref_cnt == expected_refs.get(b.block_id, 0), (
                    f"{b}: ref count {b.ref_cnt}, holders {expected_refs.get(b.block_id, 0)}")
        for h, b in self.cached.items():
            assert b.block_hash == h, f"hash map points at {b} with another hash"
