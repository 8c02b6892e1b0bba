"""KV cache manager: which blocks each request holds, prefix-cache lookups, allocation per step."""
from __future__ import annotations

from typing import Optional

import numpy as np

from voltllm.cache.block_pool import Block, BlockPool
from voltllm.cache.cpu_offload import CpuBlockIndex, KVTransfers
from voltllm.cache.prefix import DEFAULT_HASH_ALGO, extend_request_hashes
from voltllm.engine.request import Request

_NO_BLOCKS = np.empty(0, dtype=np.int32)  # block_array of a request without blocks
_NO_BLOCKS.flags.writeable = False


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, cpu_blocks: int = 0,
                 hash_algo: str = DEFAULT_HASH_ALGO):
        """cpu_blocks: host slots of the CPU tier (--kv-offloading-size; 0: none); hash_algo:
        --prefix-caching-hash-algo's (a hybrid model's state snapshots take it from here: one chain for both)."""
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same, as ids, kept in step (read every step)
        # and as an int32 array (capacity doubling): the runner copies a row of its block table from it at memcpy
        # speed, where converting the list costs ~11 ns per block every step (~22 us per 32K-token request)
        self._block_arrays: dict[str, np.ndarray] = {}
        self._block_views: dict[str, np.ndarray] = {}  # each array's filled part (slicing it costs ~0.3 us a step)
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request already put in the hash map
        self.prefix_queries = 0
        self.prefix_hits = 0
        # hybrid models: recurrent-state snapshots (voltllm.cache.state_snapshots.StateSnapshots) limit prefix
        # hits to snapshot boundaries and cut prefill chunks at them; None for attention-only models
        self.state_prefix = None
        # tokens a hit leaves to compute (at least one): a DFlash drafter's sliding-window rings hold only what the
        # request's own steps computed, so its window before the first block is computed again
        # (worker/drafter_rings.py)
        self.recompute_tail = 1
        # the CPU tier (cache/cpu_offload.py): evicted cached blocks are saved to host slots, later prefix hits there
        # are loaded into fresh blocks; the copies of the step being scheduled gather in `transfers`
        self.cpu: Optional[CpuBlockIndex] = None
        self.transfers = KVTransfers()
        self._cpu_hits: dict[str, list[int]] = {}  # request id -> host slots get_computed_blocks found, until allocated
        self.cpu_queries = 0  # vLLM's external_prefix_cache_queries / _hits (tokens)
        self.cpu_hit_tokens = 0
        self._lookup: Optional[tuple[str, int, int, int]] = None  # the last lookup's counts, until it admits
        if cpu_blocks and enable_caching:
            self.cpu = CpuBlockIndex(cpu_blocks)
            self.pool.on_evict = self._save_evicted

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_hashes(self, req: Request) -> None:
        if self.enable_caching:
            extend_request_hashes(req, self.block_size, self.hash_algo)

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of the request (at least one token is always left to compute)."""
        if not self.enable_caching or req.wants_prompt_logprobs:
            return [], 0
        self._update_hashes(req)
        max_blocks = max(0, (req.num_tokens - max(1, self.recompute_tail))) // self.block_size
        hits: list[Block] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        num_cpu = self._cpu_room(req, hits, max_blocks) if self.cpu is not None else 0
        if self.state_prefix is not None:  # a hybrid's hit ends at a snapshot boundary (its blocks GPU or CPU ones)
            usable = self.state_prefix.limit_hit(req, len(hits) + num_cpu)
            hits = hits[:usable]
            num_cpu = max(0, usable - len(hits))
        num_cpu = self._cpu_lookup(req, len(hits), num_cpu) if self.cpu is not None else 0
        # counted once the request is admitted (allocate_slots): one that waits for blocks is looked up again
        self._lookup = (req.request_id, req.num_tokens, len(hits) * self.block_size, num_cpu * self.block_size)
        return hits, (len(hits) + num_cpu) * self.block_size

    def _count_lookup(self, req: Request) -> None:
        """The prefix-cache counters (vLLM's queries / hits, the CPU tier's as its external ones) of the lookup that
        admitted the request."""
        if self._lookup is None or self._lookup[0] != req.request_id:
            return
        _, queries, gpu_hits, cpu_hits = self._lookup
        self._lookup = None
        self.prefix_queries += queries
        self.prefix_hits += gpu_hits
        if self.cpu is not None:
            self.cpu_queries += queries
            self.cpu_hit_tokens += cpu_hits

    def _cpu_room(self, req: Request, hits: list[Block], max_blocks: int) -> int:
        """How many blocks after the GPU hits the CPU tier holds, at most as many as leave one free GPU block for the
        tokens still to compute."""
        held = self.cpu.count_run(req.block_hashes[len(hits):max_blocks])
        room = self.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0) - 1
        return min(held, max(room, 0))

    def _cpu_lookup(self, req: Request, num_gpu: int, num_cpu: int) -> int:
        """Take the CPU tier's first num_cpu hits after the GPU's num_gpu (kept for allocate_slots, their slots pinned
        until the step's copies are taken)."""
        slots = self.cpu.lookup_run(req.block_hashes[num_gpu:num_gpu + num_cpu]) if num_cpu else []
        if slots:
            self.cpu.pin(slots)
            self._cpu_hits[req.request_id] = slots
        return len(slots)

    def _save_evicted(self, b: Block) -> None:
        """A cached block is about to be reused: save it to a host slot first, unless the CPU tier holds its hash."""
        slot = self.cpu.store(b.block_hash)
        if slot is not None:
            self.transfers.saves.append((b.block_id, slot))

    def take_transfers(self) -> Optional[KVTransfers]:
        """The copies of the step just scheduled (None: none), in the order they must run; the loads' slots are
        unpinned (a later step's saves into them run after these loads, in stream order)."""
        if self.cpu is None:
            return None
        out, self.transfers = (self.transfers or None), KVTransfers()
        self.cpu.unpin_all()
        self._cpu_hits.clear()  # (hits of a request that was not admitted: looked up again next time)
        return out

    def reset_cpu_tier(self) -> None:
        if self.cpu is not None:
            self.cpu.reset()
            if self.state_prefix is not None:  # a hybrid's snapshots there too
                self.state_prefix.reset_host()

    def cap_new_tokens(self, req: Request, start: int, num_new: int) -> int:
        """num_new, or fewer so that a hybrid model's chunk ends where a state snapshot is wanted."""
        if self.state_prefix is None or num_new <= 0:
            return num_new
        return self.state_prefix.cap_new_tokens(req, start, num_new)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[Block]] = None) -> Optional[list[Block]]:
        """Make room for num_new_tokens more tokens; None (and nothing changed) if blocks run out."""
        if not new_computed_blocks and not self._cpu_hits:  # the common decode case first: the held blocks have room
            rid = req.request_id
            held = self.req_blocks.get(rid)
            if held is not None:
                total = req.num_computed_tokens + num_new_tokens
                bs = self.block_size
                if total <= len(held) * bs:
                    filled = min(total, len(req.all_token_ids))
                    if self.enable_caching and filled // bs > self.num_cached_blocks.get(rid, 0):
                        self._cache_full_blocks(req, filled)  # a block fills this step: register its hash
                    return []
        new_computed_blocks = new_computed_blocks or []
        cpu_slots = self._cpu_hits.pop(req.request_id, ()) if self._cpu_hits else ()
        held = self.req_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + (len(new_computed_blocks) + len(cpu_slots)) * self.block_size
        total = num_computed + num_new_tokens
        need = -(-total // self.block_size) - len(held) - len(new_computed_blocks)  # (CPU hits take new blocks)
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(need, 0) + evictable_hits > self.pool.num_free_blocks:
            return None
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self._append_ids(req.request_id, [b.block_id for b in new_computed_blocks])
        new = self.pool.get_new_blocks(need) if need > 0 else []
        # the CPU hits' blocks come first (they follow the GPU hits); their hashes are registered below, with the
        # step's: the loads run before any forward reads them
        self.transfers.loads.extend(zip(cpu_slots, (b.block_id for b in new)))
        blocks.extend(new)
        self._append_ids(req.request_id, [b.block_id for b in new])
        self._cache_full_blocks(req, min(total, req.num_tokens))
        self._count_lookup(req)
        return new

    def _append_ids(self, request_id: str, new_ids: list[int]) -> None:
        ids = self.req_block_ids.setdefault(request_id, [])
        start = len(ids)
        ids.extend(new_ids)
        arr = self._block_arrays.get(request_id)
        if arr is None or len(arr) < len(ids):
            grown = np.empty(max(16, 2 * len(ids)), dtype=np.int32)
            if arr is not None:
                grown[:start] = arr[:start]
            arr = self._block_arrays[request_id] = grown
        arr[start:len(ids)] = new_ids
        self._block_views[request_id] = arr[:len(ids)]

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Register blocks that will be full (with known tokens) after this step."""
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_tokens // self.block_size <= start:  # no block fills this step (hashes catch up when one does)
            return
        self._update_hashes(req)
        blocks = self.req_blocks[req.request_id]
        end = min(num_tokens // self.block_size, len(req.block_hashes))
        if self.pool.events is None:
            for i in range(start, end):
                self.pool.cache_block(blocks[i], req.block_hashes[i])
        else:
            self._cache_and_record(req, blocks, start, end)
        if end > start:
            self.num_cached_blocks[req.request_id] = end

    def record_events(self, recorder) -> None:
        """--kv-events-config: tell `recorder` (cache/kv_events.py KVEventRecorder) what the GPU pool and the CPU tier
        gain and lose from now on."""
        self.pool.events = recorder
        if self.cpu is not None:
            self.cpu.events = recorder

    def _cache_and_record(self, req: Request, blocks: list[Block], start: int, end: int) -> None:
        """Blocks start..end of the request into the hash map, each run of those that entered it (not hits, not
        duplicates of a cached block) one BlockStored event with its parent and its tokens."""
        run = None  # the first block of the run entering the map
        for i in range(start, end + 1):
            entered = i < end and self.pool.cache_block(blocks[i], req.block_hashes[i])
            if entered and run is None:
                run = i
            elif not entered and run is not None:
                bs = self.block_size
                lora = req.lora_request
                self.pool.events.stored(req.block_hashes[run:i], req.block_hashes[run - 1] if run else None,
                                        req.all_token_ids[run * bs:i * bs],
                                        lora.lora_int_id if lora is not None else None)
                run = None

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.req_block_ids.pop(req.request_id, None)
        self._block_arrays.pop(req.request_id, None)
        self._block_views.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
        self._cpu_hits.pop(req.request_id, None)
        if self.state_prefix is not None:
            self.state_prefix.forget(req.request_id)
        self.pool.free_blocks(reversed(blocks))  # tail blocks are evicted first

    def block_ids(self, req: Request) -> list[int]:
        """The request's block ids (the live list: read it before the next allocation)."""
        return self.req_block_ids.get(req.request_id, [])

    def block_array(self, req: Request) -> np.ndarray:
        """The request's block ids as an int32 array view (a snapshot of the current ones: later allocations do
        not change it)."""
        return self._block_views.get(req.request_id, _NO_BLOCKS)

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for rid, blocks in self.req_blocks.items():
            assert self.req_block_ids.get(rid) == [b.block_id for b in blocks], f"block ids of {rid} drifted"
            arr, ids = self._block_arrays.get(rid), self.req_block_ids[rid]
            assert (arr[:len(ids)].tolist() if arr is not None else []) == ids, f"block array of {rid} drifted"
            view = self._block_views.get(rid)
            assert (view.tolist() if view is not None else []) == ids, f"block view of {rid} drifted"
        assert set(self._block_arrays) <= set(self.req_blocks), "block arrays of freed requests kept"
        assert set(self._block_views) == set(self._block_arrays), "block views and arrays out of step"
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        self.pool.check_integrity(refs)
        if self.cpu is not None:  # (between steps: the last step's copies were taken)
            self.cpu.check_integrity()
            assert not self._cpu_hits, f"CPU-tier hits of requests never allocated: {sorted(self._cpu_hits)}"
            assert not self.transfers, "KV copies planned outside a step"
