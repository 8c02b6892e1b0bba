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
  like(num_slots, device)          an empty cache of the same layout (snapshot pools, host copies)

Extra per-slot states (`extras`, spec["extras"]: name -> (shape, dtype)): a model may keep more per-request state
than GDN's two, e.g. Qwen4-Exp's Per-Layer-Embedding token context and dilated-conv rows. Each is one tensor
cache.extra[name] [num_slots + 1, *shape] (rows as conv / ssm: extra_rows[name] holds the checkpoint rows too),
and follows the slots everywhere the GDN states do: reset, copy_slot, keep_accepted, snapshots, host copies.

Speculative decoding (`checkpoints` = num_speculative_tokens > 0): a verification step runs a request's known
token and its k drafts through every GDN layer, but only the drafts the sampler accepts may stay in the state. So
each slot also owns k checkpoint rows, holding the states after the step's positions 0 .. k-1 (the slot itself
gets the state after the last position, as in any step); once the sampler has judged the drafts,
keep_accepted (device ops, no host sync) copies the checkpoint of the last accepted position into the slot, and
settle (host, when the verdicts arrive) sets num_tokens to match.
  conv_rows[layer], ssm_rows[layer]  the layer's whole row space: slots 0 .. num_slots (pad slot included), then
                                     the checkpoint rows; checkpoint_row(slot, j) = num_slots + 1 + slot * k + j
Every layer's rows live in one tensor per kind, so keep_accepted is a few launches for all layers together.

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
                 ssm_dtype: torch.dtype = torch.float32, checkpoints: int = 0,
                 extras: Optional[dict] = None):
        if num_slots < 1:
            raise ValueError(f"a state cache needs at least one slot, got {num_slots}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.checkpoints = checkpoints
        self.conv_shape = tuple(conv_shape)
        self.ssm_shape = tuple(ssm_shape)
        # one extra row: the scratch slot of padding rows; then the speculative checkpoint rows
        rows = num_slots + 1 + num_slots * checkpoints
        self._conv_all = torch.zeros(num_layers, rows, *self.conv_shape, dtype=conv_dtype, device=device)
        self._ssm_all = torch.zeros(num_layers, rows, *self.ssm_shape, dtype=ssm_dtype, device=device)
        self.conv_rows = list(self._conv_all.unbind(0))
        self.ssm_rows = list(self._ssm_all.unbind(0))
        self.conv = [c[: num_slots + 1] for c in self.conv_rows]
        self.ssm = [c[: num_slots + 1] for c in self.ssm_rows]
        self.extra_spec = {name: (tuple(shape), dtype) for name, (shape, dtype) in (extras or {}).items()}
        self.extra_rows = {name: torch.zeros(rows, *shape, dtype=dtype, device=device)
                           for name, (shape, dtype) in self.extra_spec.items()}
        self.extra = {name: t[: num_slots + 1] for name, t in self.extra_rows.items()}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._owner: dict[Hashable, int] = {}
        self.num_tokens: list[int] = [0] * num_slots
        # per slot, a number that changes with every allocation: settle() ignores verdicts of a step whose request
        # let go of the slot in the meantime (preempted or aborted while the step ran)
        self.lease: list[int] = [0] * num_slots
        self._leases = 0

    @classmethod
    def for_model(cls, model: Any, num_slots: int, device: torch.device | str = "cpu",
                  checkpoints: int = 0) -> "StateCache":
        return cls.from_spec(model.state_spec, num_slots, device, checkpoints)

    @classmethod
    def from_spec(cls, spec: dict, num_slots: int, device: torch.device | str = "cpu",
                  checkpoints: int = 0) -> "StateCache":
        return cls(spec["num_layers"], num_slots, spec["conv_shape"], spec["ssm_shape"], spec["conv_dtype"],
                   device, spec.get("ssm_dtype", torch.float32), checkpoints, spec.get("extras"))

    def like(self, num_slots: int, device: torch.device | str) -> "StateCache":
        """An empty cache of this one's layout (every state, extras included) with num_slots slots."""
        return StateCache(self.num_layers, num_slots, self.conv_shape, self.ssm_shape, self._conv_all.dtype, device,
                          self._ssm_all.dtype, extras=self.extra_spec)

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
        extras = sum(size(shape, dtype) for shape, dtype in (spec.get("extras") or {}).values())
        return per_layer * spec["num_layers"] + extras

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors that hold every row: conv, SSM, then the extras (a host copy page-locks them:
        worker/kv_offload.py; sleep mode releases them)."""
        return (self._conv_all, self._ssm_all, *self.extra_rows.values())

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
        self._leases += 1
        self.lease[slot] = self._leases
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

    # -- speculative checkpoints ------------------------------------------------------------------
    @property
    def checkpoint_base(self) -> int:
        """Row of slot 0's first checkpoint (checkpoint_row(slot, j) = checkpoint_base + slot * checkpoints + j)."""
        return self.num_slots + 1

    def keep_accepted(self, slots: torch.Tensor, num_drafts: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a verification step (device tensors, one entry per verifying request): the request at slots[i]
        ran its known token and num_drafts[i] drafts, of which the first accepted[i] were accepted; its slot takes
        the state after its last accepted position (a checkpoint row, or what it holds when all were accepted)."""
        if not self.checkpoints:
            raise RuntimeError("this state cache keeps no speculative checkpoints")
        src = torch.where(accepted < num_drafts, self.checkpoint_base + slots * self.checkpoints + accepted, slots)
        for rows in (self._conv_all, self._ssm_all):
            rows.index_copy_(1, slots, rows.index_select(1, src))
        for rows in self.extra_rows.values():
            rows.index_copy_(0, slots, rows.index_select(0, src))

    def settle(self, slot: int, lease: int, num_tokens: int) -> None:
        """The host side of keep_accepted: the slot covers num_tokens tokens, unless it was allocated again since
        (a free slot's count is reset when it is next allocated)."""
        if self.lease[slot] == lease:
            self.num_tokens[slot] = num_tokens

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
        for t in self.extra.values():
            t[slot].zero_()
        self.num_tokens[slot] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        for c, s in zip(self.conv, self.ssm):
            c[dst].copy_(c[src])
            s[dst].copy_(s[src])
        for t in self.extra.values():
            t[dst].copy_(t[src])
        self.num_tokens[dst] = self.num_tokens[src]
