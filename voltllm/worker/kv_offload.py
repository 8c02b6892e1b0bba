"""The CPU tier's memory and copies (--kv-offloading-size): a fixed number of host slots, each one KV block of every
cache the runner's blocks address (every attention layer's K and V, and a drafter's layers where its KV shares the
blocks), copied as the scheduler's KVTransfers say (cache/cpu_offload.py keeps which slot holds what).

Layout: one uint8 host buffer [slots, slot_bytes], slot-major, each cache's block at an aligned offset, so that a
block moves in one copy of all its layers (consecutive slots in one copy). Page-locked on CUDA (cudaHostRegister, at
its exact size), so the copies are asynchronous. Per step and per cache, a save gathers its blocks on the device
into a staging buffer of the same row layout (one index_select per cache) and copies the rows to their slots; a
load copies the slots' rows into the staging buffer and scatters them into the blocks (one index_copy_ per cache).

Ordering: everything runs on the runner's current stream before the step's forward (and a drafter's), so a save
reads a block after every earlier step wrote it and before this step (or its loads) rewrites it, and a host slot is
read or rewritten only after the copies planned before. Under async scheduling the step still in flight was launched
before this step's copies: a block it writes (even one freed since, its request aborted) is saved after those writes,
and it never reads a block reused now (its blocks were its requests' when it launched), so stream order is enough;
no host sync. The host never touches the slots itself.

Hybrid models: the recurrent-state snapshots their prefix hits resume from (cache/state_snapshots.py) get host slots
of their own beside the KV blocks': SNAPSHOT_MEMORY_SHARE of the tier's bytes (the share the GPU pool takes of the KV
cache), at least one snapshot; a host StateCache of the pool's layout (page-locked on CUDA). The snapshot pool copies
to and from it itself, on the same stream (its docstring says when).
"""
from __future__ import annotations

import logging

import torch

from voltllm.cache.cpu_offload import KVTransfers, host_available_bytes
from voltllm.host_memory import page_lock_for
from voltllm.host_to_device import to_device
from voltllm.model.state_cache import StateCache

logger = logging.getLogger("voltllm")

_ALIGN = 16  # each cache's share of a slot starts 16-byte aligned (its rows are viewed in the cache's dtype)
_STAGING_BYTES = 64 << 20  # the device staging buffer (at most 64 rows), reserved before the KV cache is sized
_MAX_STAGING_ROWS = 64
_PART_SLACK = 16 * 4096  # alignment padding bound for up to 4,096 caches (layers)


def staging_bytes(block_bytes: int) -> int:
    """The staging buffer for blocks of `block_bytes` (every cache's share, unpadded): at least one padded row."""
    row = block_bytes + _PART_SLACK
    return row * max(1, min(_MAX_STAGING_ROWS, _STAGING_BYTES // row))


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, first row, length) of the runs of consecutive slots in `slots` (row i holds slots[i])."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][2] == slot:
            first, at, n = runs[-1]
            runs[-1] = (first, at, n + 1)
        else:
            runs.append((slot, row, 1))
    return runs


def slot_layout(caches: list[torch.Tensor]) -> tuple[list[tuple[torch.Tensor, int, int]], int]:
    """([(cache, offset in a slot, bytes of one block)], slot bytes)."""
    parts, offset = [], 0
    for cache in caches:
        nbytes = cache[:, 0].numel() * cache.element_size()
        parts.append((cache, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return parts, offset


class HostKVStore:
    def __init__(self, caches: list[torch.Tensor], num_slots: int, staging: torch.Tensor, pin: bool):
        """caches: tensors [2, num_blocks, block_size, heads, dim] addressed by the same block ids; staging: a flat
        uint8 device buffer (staging_bytes)."""
        self.parts, self.slot_bytes = slot_layout(caches)
        self.num_slots = num_slots
        rows = staging.numel() // self.slot_bytes
        if rows < 1:
            raise ValueError("the staging buffer holds no block")
        self.staging = staging[: rows * self.slot_bytes].view(rows, self.slot_bytes)
        self.host = torch.empty((num_slots, self.slot_bytes), dtype=torch.uint8)
        self.pinned = False
        if pin:
            page_lock_for(self, self.host)
            self.pinned = True
        self.device = staging.device
        self.blocks_saved = self.blocks_loaded = 0  # (the acceleration report's counters)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def _views(self, k: int):
        """Each cache with the first k staging rows seen as its blocks [k, 2, block_size, heads, dim]."""
        for cache, offset, nbytes in self.parts:
            rows = self.staging[:k, offset:offset + nbytes].view(cache.dtype)
            yield cache, rows.view(k, cache.shape[0], *cache.shape[2:])

    def apply(self, transfers: KVTransfers) -> None:
        """Run a step's copies (saves, then loads) on the current stream."""
        rows = self.staging.shape[0]
        self.blocks_saved += len(transfers.saves)
        self.blocks_loaded += len(transfers.loads)
        for at in range(0, len(transfers.saves), rows):
            self._save(transfers.saves[at:at + rows])
        for at in range(0, len(transfers.loads), rows):
            self._load(transfers.loads[at:at + rows])

    def _save(self, pairs: list[tuple[int, int]]) -> None:
        idx = to_device([block for block, _ in pairs], torch.long, self.device)
        for cache, view in self._views(len(pairs)):
            view.copy_(cache.index_select(1, idx).transpose(0, 1))
        for slot, row, n in _runs([slot for _, slot in pairs]):
            self.host[slot:slot + n].copy_(self.staging[row:row + n], non_blocking=True)

    def _load(self, pairs: list[tuple[int, int]]) -> None:
        for slot, row, n in _runs([slot for slot, _ in pairs]):
            self.staging[row:row + n].copy_(self.host[slot:slot + n], non_blocking=True)
        idx = to_device([block for _, block in pairs], torch.long, self.device)
        for cache, view in self._views(len(pairs)):
            cache.index_copy_(1, idx, view.transpose(0, 1))


def reserve_staging(runner) -> torch.Tensor:
    """The device staging buffer, taken before the KV cache is sized (so the budget is charged for it)."""
    return torch.empty(staging_bytes(runner.kv_block_bytes()), dtype=torch.uint8, device=runner.device)


def _host_snapshot_slots(runner, per_rank: int) -> tuple[int, int]:
    """(host snapshot slots, bytes of one) for a hybrid model's state snapshots; (0, 0) for an attention-only model."""
    if not runner.is_hybrid:
        return 0, 0
    from voltllm.cache.state_snapshots import SNAPSHOT_MEMORY_SHARE
    from voltllm.model.state_cache import StateCache

    if runner.state_snapshots is None:  # (build_state_snapshots found no GPU memory for them)
        raise RuntimeError("--kv-offloading-size: this hybrid model has no recurrent-state snapshots on the GPU (no "
                           "memory left for them next to the KV cache), so no prefix cache for the CPU tier to "
                           "extend; drop --kv-offloading-size or give the KV cache more memory")
    snap_bytes = StateCache.bytes_per_slot(runner.model.state_spec)  # (this rank's heads)
    # (a StateCache holds one padding row beside its slots: the host copy pays for it too)
    num = max(1, int(SNAPSHOT_MEMORY_SHARE * per_rank) // snap_bytes - 1)
    if runner.tp is not None:
        num = runner.tp.min_int(num)
    return num, snap_bytes


def build_host_store(runner, staging: torch.Tensor) -> HostKVStore:
    """The CPU tier of a runner whose KV cache (and drafter's) is allocated: --kv-offloading-size GiB in all, split over
    the tensor-parallel ranks as vLLM splits it (each rank its own heads), the slot count every rank can hold. A hybrid
    model's snapshot pool gets its host slots here too (attached to it)."""
    config = runner.config
    size_gib = config.cache.kv_offloading_size
    tp = config.parallel.tensor_parallel_size
    caches = list(runner.kv_caches)
    if runner.draft is not None:  # a drafter's KV lives in the same blocks: it moves with them
        drafts = getattr(runner.draft, "block_kv_caches", getattr(runner.draft, "kv_caches", []))
        caches += [c for c in drafts if not any(c is t for t in caches)]  # (not a DFlash drafter's rings)
    _, slot_bytes = slot_layout(caches)
    per_rank = int(size_gib * 2**30 / tp)
    num_snaps, snap_bytes = _host_snapshot_slots(runner, per_rank)
    snaps_bytes = (num_snaps + 1) * snap_bytes if num_snaps else 0  # (the host pool's padding row included)
    num = max(0, per_rank - snaps_bytes) // slot_bytes
    if runner.tp is not None:  # rank 0's index addresses every rank's slots
        num = runner.tp.min_int(num)
    if num < 1:
        snaps = (f" next to {num_snaps} recurrent-state snapshot(s) of {snap_bytes / 2**20:.2f} MiB"
                 if num_snaps else "")
        raise RuntimeError(f"--kv-offloading-size {size_gib:g} GiB holds no KV block{snaps}: one block takes "
                           f"{slot_bytes / 2**20:.2f} MiB" + (f" per rank ({size_gib:g} GiB over {tp} ranks)"
                                                              if tp > 1 else "") + "; raise it")
    need = num * slot_bytes + snaps_bytes
    available = host_available_bytes()
    if available is not None and need > available:
        raise RuntimeError(f"--kv-offloading-size {size_gib:g} GiB: this host has {available / 2**30:.1f} GiB of "
                           f"memory available (MemAvailable in /proc/meminfo), less than the {need / 2**30:.2f} GiB "
                           "this rank's CPU KV blocks need; lower --kv-offloading-size")
    pin = runner.device.type == "cuda"
    try:
        store = HostKVStore(caches, num, staging, pin)
        if num_snaps:
            runner.state_snapshots.attach_host(_host_state_cache(runner.state_snapshots.store, num_snaps, pin))
    except RuntimeError as e:  # (the host refused the allocation, or to lock that much)
        raise RuntimeError(f"--kv-offloading-size {size_gib:g} GiB: allocating {need / 2**30:.2f} GiB of "
                           f"{'pinned ' if pin else ''}host memory failed ({e}); lower --kv-offloading-size") from None
    bs = config.cache.block_size
    logger.info("KV offloading: %d CPU blocks of %d tokens = %d tokens, %.2f GiB of %shost memory%s", num, bs,
                num * bs, store.nbytes / 2**30, "page-locked " if pin else "",
                f" on each of {tp} ranks" if tp > 1 else "")
    if num_snaps:
        logger.info("KV offloading: %d CPU recurrent-state snapshots, %.2f GiB%s", num_snaps, snaps_bytes / 2**30,
                    f" on each of {tp} ranks" if tp > 1 else "")
    return store


def _host_state_cache(pool: StateCache, num: int, pin: bool) -> StateCache:
    """Host slots for snapshots of the GPU pool's layout (every GDN layer's conv and SSM state), page-locked where
    `pin`, so the pool's copies to and from them are asynchronous."""
    host = pool.like(num, "cpu")
    if pin:
        for t in host.tensors:
            page_lock_for(host, t)
    return host

