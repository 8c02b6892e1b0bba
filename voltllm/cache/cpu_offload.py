"""The CPU tier of the prefix cache (vLLM's `--kv-offloading-size GiB`, backend `native`): rank 0's bookkeeping.

A cached block the GPU pool evicts (block_pool.py `get_new_blocks` reusing a free block that still has its hash) is
saved to a host slot first; a later request whose prefix continues past its GPU hits into hashes held here gets
fresh GPU blocks, which the step loads from their slots before its forward. This module only decides: which slot
holds which block hash (an LRU keyed by the prefix.py hash), and the step's copies (`KVTransfers`). The host memory
and the copies themselves are the runner's (worker/kv_offload.py); under tensor parallelism every rank holds its
own heads' share of each slot, at the same slot numbers.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence


@dataclass
class KVTransfers:
    """One step's copies between the GPU blocks and the host slots, run before its forward: saves first (the blocks
    they read may be rewritten by the loads or the forward), then loads."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (GPU block id, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, GPU block id)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class CpuBlockIndex:
    """Which host slot holds which block hash, least recently used first. Slots with a load planned in the step
    being scheduled are pinned (not evicted by a later save of the same step, whose copy runs before the loads)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the CPU KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._free: deque[int] = deque(range(num_slots))  # in order: consecutive saves get consecutive slots
        self._pinned: set[int] = set()
        self.events = None  # --kv-events-config: a KVEventRecorder told of hashes entering and leaving (medium CPU)

    def __len__(self) -> int:
        return len(self._by_hash)

    def hashes(self) -> list[bytes]:
        """The blocks held, oldest first."""
        return list(self._by_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def count_run(self, hashes: Iterable[bytes]) -> int:
        """How many of the leading hashes are held here (up to the first that is not), touching none."""
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def lookup_run(self, hashes: Iterable[bytes]) -> list[int]:
        """The slots of the leading hashes held here (up to the first that is not); each becomes the most recent."""
        slots = []
        for h in hashes:
            slot = self._by_hash.get(h)
            if slot is None:
                break
            self._by_hash.move_to_end(h)
            slots.append(slot)
        return slots

    def pin(self, slots: Sequence[int]) -> None:
        self._pinned.update(slots)

    def unpin_all(self) -> None:
        self._pinned.clear()

    @property
    def pinned(self) -> frozenset[int]:
        return frozenset(self._pinned)

    def store(self, block_hash: bytes) -> Optional[int]:
        """The slot to save a block of this hash into, or None: held already (it becomes the most recent), or every
        slot is pinned. The least recently used unpinned slot is evicted when none is free."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.popleft()
        else:
            victim = next((h for h, s in self._by_hash.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._by_hash.pop(victim)
            if self.events is not None:
                self.events.removed((victim,), "CPU")
        self._by_hash[block_hash] = slot
        if self.events is not None:
            self.events.stored_elsewhere(block_hash, "CPU")
        return slot

    def reset(self) -> None:
        """Forget every block (the memory is left as it is: no slot is read before it is saved into again)."""
        if self._pinned:
            raise RuntimeError("the CPU KV tier cannot be reset while a step's loads are being planned")
        if self.events is not None and self._by_hash:
            self.events.removed(list(self._by_hash), "CPU")
        self._by_hash.clear()
        self._free = deque(range(self.num_slots))

    def check_integrity(self) -> None:
        used = list(self._by_hash.values())
        assert len(set(used)) == len(used), "a host slot holds two block hashes"
        free = list(self._free)
        assert len(set(free)) == len(free), "a host slot is twice in the free list"
        assert not set(used) & set(free), "a host slot is both free and holding a block"
        assert len(used) + len(free) == self.num_slots, "host slots leaked"
        assert all(0 <= s < self.num_slots for s in used + free), "a host slot out of range"
        assert not self._pinned, "host slots still pinned after the step was scheduled"


def host_available_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (the memory the host can give without swapping), None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
