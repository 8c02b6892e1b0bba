"""KV cache events (vLLM's `--kv-events-config`): what the prefix cache gained and lost, for an outside router.

The wire types are msgspec structs laid out as vLLM's (array-like, defaults omitted, events tagged by class name),
which consumers such as llm-d and Dynamo decode: a batch is [ts, [event, ...], data_parallel_rank], an event
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
["BlockRemoved", block_hashes, medium] or ["AllBlocksCleared"]. Block hashes are the prefix cache's own digests
(cache/prefix.py: bytes, msgpack bin).

`KVEventRecorder` collects them while the block pool works (block_pool.py, kv_manager.py, cpu_offload.py call it
only when one is attached); the engine takes the list once per step and publishes it as one batch
(engine/kv_event_publisher.py).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # the --kv-offloading-size tier


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float  # seconds since the epoch (time.time())
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """An event's first element is its class name (the tag)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: consecutive blocks of one chain, the first one's parent given (None:
    the chain starts here), their tokens in order (block_size per block)."""

    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    """reset_prefix_cache: the GPU pool forgot every block."""


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


class KVEventRecorder:
    """The events of the pool's actions since the last take(), in order. Consecutive removals (and CPU-tier stores)
    of one medium join one event, as an eviction run of one allocation is one action."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hashes: Sequence[bytes], parent: Optional[bytes], token_ids: Sequence[int],
               lora_id: Optional[int] = None, medium: str = MEDIUM_GPU) -> None:
        self._events.append(BlockStored(list(block_hashes), parent, list(token_ids), self.block_size, lora_id,
                                        medium))

    def stored_elsewhere(self, block_hash: bytes, medium: str) -> None:
        """A block copied to another tier (the CPU tier knows its hash only: no parent, no tokens, as vLLM's
        offloading tier reports it)."""
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.medium == medium and not last.token_ids:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockStored([block_hash], None, [], self.block_size, None, medium))

    def removed(self, block_hashes: Sequence[bytes], medium: str = MEDIUM_GPU) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.extend(block_hashes)
        else:
            self._events.append(BlockRemoved(list(block_hashes), medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
