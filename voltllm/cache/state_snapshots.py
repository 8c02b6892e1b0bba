"""Prefix caching for hybrid models: snapshots of the recurrent (GDN) state at aligned token boundaries.

A hybrid model's attention layers keep paged KV, which prefix caching shares block by block; its Gated
DeltaNet layers keep one fixed-size state per request (voltllm.model.state_cache) that covers *all* tokens
so far and cannot be cut at an arbitrary block. `--mamba-cache-mode align` keeps copies of that state
(conv + SSM, every GDN layer) taken when a request's computed tokens end exactly at a multiple of
`--mamba-block-size` M (a multiple of the KV block size), in a bounded pool keyed by the chained hash of
the KV block that ends at that boundary (voltllm.cache.prefix: the hash names the whole prefix, cache salt
included). A new request resumes at the deepest boundary B such that
  * every KV block before B is cached (the usual prefix hit), and
  * the snapshot keyed by the hash of block B/block_size - 1 exists;
its slot gets a copy of the snapshot and its num_computed_tokens starts at B.

Who does what (one object, `StateSnapshots`, shared by the KV manager and the runner, same process):
  scheduler side (through KVCacheManager.state_prefix)
    limit_hit(req, n_blocks)        the KV prefix hit cut down to the deepest boundary with a snapshot
    cap_new_tokens(req, start, n)   chunked prefill ends at boundaries so snapshots can be taken there:
                                    a chunk that crosses a boundary without a snapshot is cut to end at
                                    the last such boundary it crosses (at most one cut per chunk); a
                                    request whose KV prefix hit reached past its snapshot hit is first cut
                                    at the deepest boundary of that KV hit (the point where another request's
                                    prompt diverged, e.g. the end of a shared system prompt)
    forget(request_id)              (KV free: finish / abort / preemption)
  runner side, each step, eager or a CUDA-graph replay (after the slots are allocated)
    before_forward(scheduled, slots)   a request starting at B > 0 whose slot does not cover B tokens is a
                                       prefix hit: copy the snapshot into its slot (num_tokens[slot] = B)
    after_forward(scheduled, slots)    a request whose step ended at a boundary whose tokens are all known on
                                       the host: copy its slot into the pool (LRU eviction when full)
Ordering: lookups happen at schedule time and see only snapshots saved by earlier steps; the runner enqueues
restores before the forward and saves after it, on one stream, so a restore always reads a snapshot whose
copy was enqueued before, and a save that evicts a row is ordered after any restore that read it.
A decode step under async scheduling computes a token that is not on the host yet, so its boundary hash is
unknown and no snapshot is taken there (prompt boundaries and synchronous decode are covered).

CPU tier (--kv-offloading-size, cache/cpu_offload.py): a snapshot the pool evicts is saved to a host slot first
(its own host slots, SNAPSHOT_MEMORY_SHARE of the tier's bytes, LRU, keyed by the same hash: `host_index`), and a
lookup counts a snapshot held there as one the pool holds: limit_hit resumes at the deepest boundary whose snapshot is
in either and whose KV blocks are on the GPU or in the CPU tier (kv_manager.py); before_forward restores a host
snapshot straight into the request's slot. The host index changes only in plan_saves (at launch, after the step's
restores were enqueued), so a snapshot limit_hit found at schedule time is still where it was when the step
restores it. Ordering: an eviction's copy (row -> host slot) runs in apply_saves just before the row is rewritten,
after the forward, on the same stream: after every restore of this step or an earlier one that read the row or the
host slot, and before any later step's restore reads the host slot. Under async scheduling the step in flight was
enqueued before all of this step's copies, so it sees no slot, row or host slot change under it; no host sync.

Memory: the pool is carved out of the KV cache budget (`build_state_snapshots`): about
SNAPSHOT_MEMORY_SHARE of the KV bytes, at least MIN_SNAPSHOTS snapshots, fewer KV blocks in exchange.
`--mamba-cache-mode none` (or prefix caching off) builds no pool, and prefix caching is then off for the
hybrid model (EngineCore says so at start).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Optional, Sequence

from voltllm.cache.cpu_offload import CpuBlockIndex
from voltllm.cache.prefix import DEFAULT_HASH_ALGO, extend_request_hashes
from voltllm.model.state_cache import StateCache

logger = logging.getLogger("voltllm")

SNAPSHOT_MEMORY_SHARE = 0.1  # of the KV cache bytes, given to snapshots instead of KV blocks
MIN_SNAPSHOTS = 4
DEFAULT_MAMBA_BLOCK_TOKENS = 512  # --mamba-block-size default: this, rounded up to a multiple of --block-size


def resolve_mamba_block_size(mamba_block_size: Optional[int], block_size: int) -> int:
    if mamba_block_size is None:
        return -(-DEFAULT_MAMBA_BLOCK_TOKENS // block_size) * block_size
    if mamba_block_size < 1 or mamba_block_size % block_size:
        raise ValueError(f"--mamba-block-size {mamba_block_size} must be a positive multiple of --block-size "
                         f"{block_size}")
    return mamba_block_size


class StateSnapshots:
    hash_algo = DEFAULT_HASH_ALGO  # the KV manager's --prefix-caching-hash-algo (EngineCore sets it on attaching)

    def __init__(self, cache: StateCache, num_snapshots: int, mamba_block_size: int, block_size: int):
        if mamba_block_size % block_size:
            raise ValueError(f"mamba block size {mamba_block_size} is not a multiple of block size {block_size}")
        self.cache = cache
        self.mamba_block_size = mamba_block_size
        self.block_size = block_size
        dev = cache.ssm[0].device if cache.ssm else "cpu"
        # the pool's storage is a StateCache of its own (its slot bookkeeping is unused; rows are ours)
        self.store = cache.like(num_snapshots, dev)
        self.capacity = num_snapshots
        self._index: OrderedDict[bytes, int] = OrderedDict()  # block hash -> row; oldest use first
        self._free: list[int] = list(range(num_snapshots - 1, -1, -1))
        self._targets: dict[str, int] = {}
        self.num_saved = 0
        self.num_restored = 0
        self.num_evicted = 0
        # the CPU tier's snapshots (attach_host): host storage with the pool's layout, and which hash each slot holds
        self.host: Optional[StateCache] = None
        self.host_index: Optional[CpuBlockIndex] = None
        self.num_offloaded = 0  # evicted snapshots saved to host slots
        self.num_host_restored = 0

    def attach_host(self, host: StateCache) -> None:
        """Give the pool host slots for the snapshots it evicts (--kv-offloading-size; worker/kv_offload.py)."""
        self.host = host
        self.host_index = CpuBlockIndex(host.num_slots)

    def has(self, block_hash: Optional[bytes]) -> bool:
        """Whether a snapshot of this hash can be restored: in the pool or in its host slots."""
        return block_hash is not None and (block_hash in self._index or (
            self.host_index is not None and block_hash in self.host_index))

    # -- lookups ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def _hash_at(self, req: Any, boundary: int) -> Optional[bytes]:
        """The hash of the KV block ending at `boundary`, if all its tokens are known on the host."""
        if boundary <= 0 or boundary > len(req.all_token_ids):
            return None
        i = boundary // self.block_size - 1
        if i >= len(req.block_hashes):
            # (the adapter's key too, as the KV manager's: whichever hashes first, the chain is the same)
            extend_request_hashes(req, self.block_size, self.hash_algo)
        return req.block_hashes[i] if i < len(req.block_hashes) else None

    # -- scheduler side --------------------------------------------------------------------------
    def limit_hit(self, req: Any, num_hit_blocks: int) -> int:
        """How many of the request's `num_hit_blocks` cached KV blocks it may use: up to the deepest
        boundary with a snapshot (0 if none)."""
        m, bs = self.mamba_block_size, self.block_size
        kv_tokens = num_hit_blocks * bs
        deepest = kv_tokens // m * m
        found = 0
        for b in range(deepest, 0, -m):
            if self.has(self._hash_at(req, b)):
                found = b
                break
        if deepest > found:
            self._targets[req.request_id] = deepest  # worth a snapshot: another prompt shared this far
        else:
            self._targets.pop(req.request_id, None)
        return found // bs

    def cap_new_tokens(self, req: Any, start: int, num_new: int) -> int:
        """num_new, or fewer so that this chunk ends at a boundary where a snapshot is wanted."""
        m = self.mamba_block_size
        end = start + num_new
        target = self._targets.get(req.request_id)
        if target is not None:
            if start < target < end:
                return target - start
            if target <= start:
                del self._targets[req.request_id]
        if end % m == 0:
            return num_new
        b = min(end, len(req.all_token_ids)) // m * m  # its hash must be computable now
        if b <= start:
            return num_new
        h = self._hash_at(req, b)
        if h is None or self.has(h):
            return num_new
        return b - start

    def forget(self, request_id: str) -> None:
        self._targets.pop(request_id, None)

    # -- runner side -----------------------------------------------------------------------------
    def before_forward(self, scheduled: Sequence[Any], slots: Sequence[int]) -> list[tuple[int, int, int, bool]]:
        """Restore snapshots into the slots of requests that start this step at a prefix-cache hit. Returns the
        restores as (snapshot row or host slot, slot, tokens, from host): tensor parallelism's other ranks replay
        them (apply_restores)."""
        done = []
        for s, slot in zip(scheduled, slots):
            start = s.start
            if slot < 0 or start == 0 or self.cache.num_tokens[slot] == start or start % self.mamba_block_size:
                continue
            h = self._hash_at(s.request, start)
            if h is None:
                continue
            row = self._index.get(h)
            if row is not None:
                self._index.move_to_end(h)
                done.append((row, slot, start, False))
            elif self.host_index is not None and h in self.host_index:
                done.append((self.host_index.lookup_run([h])[0], slot, start, True))
                self.num_host_restored += 1
            else:
                continue  # not a hit of ours: the model's note_step check raises
            self.num_restored += 1
        self.apply_restores(done)
        return done

    def apply_restores(self, restores: Sequence[tuple[int, int, int, bool]]) -> None:
        """Copy snapshots into state slots: (snapshot row, or host slot where the last is True, slot, tokens it covers)
        each (before_forward's result; a tensor-parallel rank other than 0 gets rank 0's, since only rank 0 schedules
        and keeps the indexes: every rank's pool and host slots hold its own heads of the same snapshots at the same
        rows and slots)."""
        for row, slot, tokens, from_host in restores:
            self._copy(self.host if from_host else self.store, row, self.cache, slot)
            self.cache.num_tokens[slot] = tokens

    def after_forward(self, scheduled: Sequence[Any], slots: Sequence[int]) -> None:
        """Snapshot the slots of requests whose computed tokens now end at a boundary."""
        self.apply_saves(self.plan_saves(scheduled, slots))

    def plan_saves(self, scheduled: Sequence[Any], slots: Sequence[int]) -> list[tuple[int, int, int]]:
        """after_forward's decisions, (slot, snapshot row, host slot) each, with the indexes updated as if they were
        done (host data only, so the runner plans before the forward and ships them to the other tensor-parallel
        ranks); apply_saves copies after the forward. The host slot (-1: none) is where the row's evicted snapshot
        goes first (the CPU tier's)."""
        saves = []
        for s, slot in zip(scheduled, slots):
            end = s.start + s.num_new_tokens
            # (a verification's end is past its unverified drafts: its state is not the prefix's)
            if slot < 0 or end % self.mamba_block_size or s.spec_tokens:
                continue
            h = self._hash_at(s.request, end)
            if h is None:
                continue
            if h in self._index:
                self._index.move_to_end(h)
                continue
            host_slot = -1
            if self._free:
                row = self._free.pop()
            else:
                evicted, row = self._index.popitem(last=False)
                self.num_evicted += 1
                if self.host_index is not None:  # (None: the host holds that hash already)
                    saved = self.host_index.store(evicted)
                    if saved is not None:
                        host_slot = saved
                        self.num_offloaded += 1
            self._index[h] = row
            self.num_saved += 1
            saves.append((slot, row, host_slot))
        return saves

    def apply_saves(self, saves: Sequence[tuple[int, int, int]]) -> None:
        """Copy state slots into snapshot rows, (slot, row, host slot) each (plan_saves' result), after the step's
        forward; a row's evicted snapshot first goes to its host slot (in plan order: a row evicted twice in one step
        is saved with the contents the first save gave it)."""
        for slot, row, host_slot in saves:
            if host_slot >= 0:
                self._copy(self.store, row, self.host, host_slot)
            self._copy(self.cache, slot, self.store, row)

    @staticmethod
    def _copy(src: StateCache, src_row: int, dst: StateCache, dst_row: int) -> None:
        for sc, dc in zip(src.conv, dst.conv):
            dc[dst_row].copy_(sc[src_row], non_blocking=True)
        for ss, ds in zip(src.ssm, dst.ssm):
            ds[dst_row].copy_(ss[src_row], non_blocking=True)
        for name, st in src.extra.items():  # (a model's extra per-slot states: Qwen4-Exp's PLE context)
            dst.extra[name][dst_row].copy_(st[src_row], non_blocking=True)

    # -- upkeep ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every snapshot of the pool (rows return to the free list); the host's stay (reset_host)."""
        self._free = list(range(self.capacity - 1, -1, -1))
        self._index.clear()
        self._targets.clear()

    def reset_host(self) -> None:
        """Drop the CPU tier's snapshots (reset_prefix_cache(reset_connector=True))."""
        if self.host_index is not None:
            self.host_index.reset()

    def stats(self) -> dict:
        out = {"snapshots": len(self._index), "capacity": self.capacity, "saved": self.num_saved,
               "restored": self.num_restored, "evicted": self.num_evicted}
        if self.host_index is not None:
            out.update(host_snapshots=len(self.host_index), host_capacity=self.host_index.num_slots,
                       offloaded=self.num_offloaded, host_restored=self.num_host_restored)
        return out

    def check_integrity(self, live_request_ids: Optional[set] = None) -> None:
        rows = list(self._index.values())
        assert len(set(rows)) == len(rows), "two snapshots share a row"
        assert len(set(self._free)) == len(self._free), "a snapshot row is free twice"
        assert not set(rows) & set(self._free), "a snapshot row is both free and used"
        assert set(rows) | set(self._free) == set(range(self.capacity)), "snapshot rows lost"
        if self.host_index is not None:
            self.host_index.check_integrity()
            assert self.host is not None and self.host.num_slots == self.host_index.num_slots, \
                "the host snapshot index and its slots differ"
        if live_request_ids is not None:
            stale = set(self._targets) - set(live_request_ids)
            assert not stale, f"snapshot targets kept for requests that are gone: {sorted(stale)[:3]}"


def build_state_snapshots(runner: Any, num_blocks: int) -> tuple[Optional[StateSnapshots], int]:
    """The runner's snapshot pool for a hybrid model (or None) and the KV blocks left after it.

    None when prefix caching is off or --mamba-cache-mode is none (EngineCore then turns prefix caching off
    for the model and says so). Raises for an invalid --mamba-block-size / --mamba-cache-mode.
    """
    cc = runner.config.cache
    mode = cc.mamba_cache_mode
    if mode not in ("align", "none"):
        raise ValueError(f"--mamba-cache-mode {mode}: not supported for hybrid models here; use align "
                         "(state snapshots at --mamba-block-size boundaries) or none")
    if not cc.enable_prefix_caching or mode == "none":
        return None, num_blocks
    m = resolve_mamba_block_size(cc.mamba_block_size, cc.block_size)
    cache = runner.state_cache
    snap_bytes = StateCache.bytes_per_slot(runner.model.state_spec)
    block_bytes = runner.kv_block_bytes()
    n = max(MIN_SNAPSHOTS, int(SNAPSHOT_MEMORY_SHARE * num_blocks * block_bytes) // snap_bytes)
    if not cc.num_gpu_blocks_override:  # the pool takes the place of KV blocks
        sc = runner.config.scheduler
        # one request of --max-model-len keeps its blocks; under auto the length is fitted to what is left
        min_blocks = 1 if runner.config.model.max_model_len_fit else -(-sc.max_model_len // cc.block_size)
        spare = max(0, num_blocks - min_blocks)
        n = min(n, spare * block_bytes // snap_bytes)
        num_blocks -= -(-n * snap_bytes // block_bytes)
    if getattr(runner, "group", None) is not None:  # every rank the same rows and blocks (rank 0 may hold a draft's KV)
        n, num_blocks = runner.group.min_int(n), runner.group.min_int(num_blocks)
    if n < 1:
        logger.warning("no memory left for recurrent-state snapshots (%.1f MiB each) next to the KV cache",
                       snap_bytes / 2**20)
        return None, num_blocks
    snaps = StateSnapshots(cache, n, m, cc.block_size)
    logger.info("hybrid prefix caching (--mamba-cache-mode align): state snapshots every %d tokens, pool of %d "
                "(%.2f GiB, %.1f MiB each)", m, n, n * snap_bytes / 2**30, snap_bytes / 2**20)
    return snaps, num_blocks
