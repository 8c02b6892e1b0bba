"""Per-request recurrent state for hybrid models (Gated DeltaNet layers): a fixed pool of slots.

A GDN layer keeps, per request, a fixed-size state instead of per-token KV:
  conv state  [conv_kernel - 1, conv_dim]   the last K-1 inputs of the causal depthwise conv1d
                                             (token-major: row K-2 is the newest), model dtype
  ssm state   [num_v_heads, head_k_dim, head_v_dim]   the delta-rule memory S, always fp32

The pool holds `num_slots` of each, for every GDN layer:
  cache.conv[layer]  tensor [num_slots, K-1, conv_dim]
  cache.ssm[layer]   tensor [num_slots, Hv, Dk, Dv]
`layer` is the GDN layer's own index (0 .. num_layers-1, counting only GDN layers), not the decoder index.

API
  StateCache(num_layers, num_slots, conv_shape, ssm_shape, conv_dtype, device)   or
  StateCache.for_model(model, num_slots, device)        (model.state_spec gives the shapes)
  allocate(request_id) -> slot     a free slot (the same one again if the request already holds one);
                                   raises RuntimeError when the pool is exhausted
  free(request_id)                 give the slot back (no-op if the request holds none)
  slot_of(request_id) -> slot | None
  num_free, num_slots, bytes_per_slot (static helper: for the memory budget next to KV blocks)
  num_tokens[slot]                 how many tokens of its request the slot's state covers
  note_step(slots, starts, ends)   check that each request resumes where its slot's state ends (or at 0)
                                   and record the new ends; the model's forward calls it (a CUDA-graph
                                   replay, which skips the model's Python, must call it itself)
  pad_slot                         a scratch slot (index num_slots) for padding rows: a state_slots entry
                                   of -1 (CUDA-graph padding) reads zeros and writes there
  reset(slot)                      zero both states of a slot (all layers)
  copy_slot(src, dst)              copy both states within the pool (prefix-cache snapshots live in a
                                   pool of their own: voltllm.cache.state_snapshots)

How the model uses it (one forward step):
  ctx.extra["state_cache"] = the StateCache
  ctx.extra["state_slots"] = list[int], one slot per request, in the batch order of the
                             AttentionMetadata (request i owns query rows qsl[i]:qsl[i+1]);
                             or, in a CUDA graph, a persistent long device tensor of resolved slots
                             (padding rows = pad_slot; the runner calls note_step itself)
A request whose context before this step is empty (seq_len - query_len == 0) starts from a zero
state whatever the slot holds, so a fresh slot needs no zeroing, and a preempted request that is
recomputed from token 0 resets itself. A request resuming at num_computed > 0 reads its slot: the
slot must hold exactly the state after those tokens (the runner keeps the slot for the request's
whole life; a prefix-cache hit restores a snapshot into the slot first, see
voltllm/cache/state_snapshots.py). The forward
checks this against num_tokens[slot] and raises instead of computing from a wrong state.
"""
from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

import torch


class StateCache:
    def __init__(self, num_layers: int, num_slots: int, conv_shape: Sequence[int], ssm_shape: Sequence[int],
                 conv_dtype: torch.dtype, device: torch.device | str = "cpu",
                 ssm_dtype: torch.dtype = torch.float32):
        if num_slots < 1:
            raise ValueError(f"a state cache needs at least one slot, got {num_slots}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.conv_shape = tuple(conv_shape)
        self.ssm_shape = tuple(ssm_shape)
        # one extra row: the scratch slot of padding rows
        self.conv = [torch.zeros(num_slots + 1, *self.conv_shape, dtype=conv_dtype, device=device)
                     for _ in range(num_layers)]
        self.ssm = [torch.zeros(num_slots + 1, *self.ssm_shape, dtype=ssm_dtype, device=device)
                    for _ in range(num_layers)]
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._owner: dict[Hashable, int] = {}
        self.num_tokens: list[int] = [0] * num_slots

    @classmethod
    def for_model(cls, model: Any, num_slots: int, device: torch.device | str = "cpu") -> "StateCache":
        spec = model.state_spec
        return cls(spec["num_layers"], num_slots, spec["conv_shape"], spec["ssm_shape"], spec["conv_dtype"],
                   device, spec.get("ssm_dtype", torch.float32))

    @staticmethod
    def bytes_per_slot(spec: dict) -> int:
        """Bytes one request's state takes over all GDN layers (for the memory budget)."""
        def size(shape, dtype):
            n = 1
            for d in shape:
                n *= d
            return n * torch.tensor([], dtype=dtype).element_size()
        per_layer = size(spec["conv_shape"], spec["conv_dtype"]) + size(spec["ssm_shape"],
                                                                         spec.get("ssm_dtype", torch.float32))
        return per_layer * spec["num_layers"]

    @property
    def pad_slot(self) -> int:
        return self.num_slots

    # -- slots ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: Hashable) -> Optional[int]:
        return self._owner.get(request_id)

    def allocate(self, request_id: Hashable) -> int:
        slot = self._owner.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            raise RuntimeError(f"state cache exhausted: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self._owner[request_id] = slot
        self.num_tokens[slot] = 0
        return slot

    def free(self, request_id: Hashable) -> None:
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def note_step(self, slots: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> None:
        """Request i computes tokens starts[i]:ends[i] with slot slots[i] (-1: padding row, ignored)."""
        real = [s for s in slots if s >= 0]
        if len(set(real)) != len(real):
            raise ValueError(f"two requests of the batch share a state slot: {list(slots)}")
        for i, slot in enumerate(slots):
            if slot >= 0 and starts[i] and self.num_tokens[slot] != starts[i]:
                raise RuntimeError(
                    f"request {i} of the batch resumes at token {starts[i]} but its state slot {slot} covers "
                    f"{self.num_tokens[slot]} tokens (a hybrid model cannot resume from a prefix-cache hit or "
                    "a freed slot without a state snapshot)")
        for i, slot in enumerate(slots):
            if slot >= 0:
                self.num_tokens[slot] = ends[i]

    def check_integrity(self) -> None:
        used = set(self._owner.values())
        free = set(self._free)
        assert len(used) == len(self._owner), "a slot is owned by two requests"
        assert len(free) == len(self._free), "a slot is free twice"
        assert not used & free, "a slot is both free and owned"
        assert used | free == set(range(self.num_slots)), "slots lost"

    # -- contents -------------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        for c, s in zip(self.conv, self.ssm):
            c[slot].zero_()
            s[slot].zero_()
        self.num_tokens[slot] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        for c, s in zip(self.conv, self.ssm):
            c[dst].copy_(c[src])
            s[dst].copy_(s[src])
        self.num_tokens[dst] = self.num_tokens[src]
