"""The engine's side of LoRA: which adapters it knows, which sit in the GPU slots, and each step's per-token mask.

- Known adapters: a request names one with a LoRARequest; the first request of a (name, lora_int_id) reads and checks
  it (`register`, at add_request: a bad adapter is that request's error) and the manager gives it a `LoRAKey` (the
  name and a serial number of its own): the engine's identity of that load, which its requests, its slot and its
  prefix-cache blocks go by. Checked adapters are kept in CPU memory, least recently used dropped beyond
  --max-cpu-loras, but never one a live request uses (a dropped one is read from its path again by its next request).
- Removal (`remove`, vLLM's remove_lora; the server's /v1/unload_lora_adapter and in-place reloads): the adapter is
  retired, so a later request of the same LoRARequest reads it afresh under a new key (new weights never meet the old
  load's slot or cached blocks), and it is dropped from CPU memory and its GPU slot once no live request uses it
  (`drop_retired`, after each step); requests running with it finish with it.
- GPU slots: --max-loras of them in every LoRA-taking Linear (layers.LoRAWeights). The scheduler admits requests so
  that the running batch holds at most --max-loras distinct adapters; each step the adapters of its requests take
  slots (resident ones stay, others evict a slot no request of the step uses, least recently used first) and the
  runner fills the mask (`prepare_step`).
- Tensor parallelism: every rank has a manager whose slots hold its cut of each adapter (lora/sharding.py). Rank 0
  decides; `prepare_step` returns the step's `LoRAStep` (the adapters dropped since the last step, the slot loads it
  made, each token's slot), which travels in the step's StepInputs, and the other ranks repeat it (`follow_step`):
  they read each adapter from its path themselves when it first takes a slot there, so every rank holds the same
  adapter in the same slot, and drop what rank 0 dropped.
- Pipeline parallelism: likewise a manager per rank, but over its stage's decoder layers alone: each rank keeps the
  adapter's matrices of its own layers, renamed to their local indices (lora/stages.py), and follows rank 0's steps.
- MoE experts: every sparse MoE layer gets slots for its routed experts too (lora/experts.py), refused at start when
  they would outweigh the experts themselves (`check_expert_slots`). A step whose tokens use an adapter with expert
  weights sets `LoRABatch.experts_active` and runs eagerly (`needs_eager`: the runner's choice, made by rank 0).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Optional

import numpy as np
import torch

from voltllm.lora.adapter import LoRAAdapter, LoRAAdapterError, expert_shapes, projection_shapes, read_adapter
from voltllm.lora.experts import ExpertLoRAWeights, expert_slot_values
from voltllm.lora.layers import LoRABatch, LoRAWeights
from voltllm.lora.request import LoRARequest
from voltllm.lora.sharding import Split, shard_adapter
from voltllm.lora.stages import stage_adapter, stage_projections

logger = logging.getLogger("voltllm")


class LoRAKey(NamedTuple):
    """One load of an adapter in this engine: its name and the serial number the manager gave it when it read it.
    A reload (after remove, or under another lora_int_id) is a new key, so nothing of an old load is taken for it."""

    name: str
    serial: int


@dataclass
class LoRAStep:
    """One step's LoRA choices as rank 0 made them, for the other tensor-parallel ranks to repeat: the adapters rank 0
    dropped since its last step, the adapters that took a slot this step (slot, key, request; in order) and each of
    the step's real tokens' slot (-1: none; None: a step without adapters)."""

    drops: list[LoRAKey] = field(default_factory=list)
    loads: list[tuple[int, LoRAKey, LoRARequest]] = field(default_factory=list)
    token_slots: Optional[np.ndarray] = None


LiveKeys = Callable[[], Iterable[LoRAKey]]


class LoRAManager:
    def __init__(self, model: torch.nn.Module, lora_config: Any, hf_config: Any, max_tokens: int,
                 device: torch.device, split: Optional[Split] = None, stage: Any = None):
        """split: under tensor parallelism, the model's cut of a checkpoint weight for this rank (its `tp_part`):
        the projections are the rank's shards, and each adapter is cut the same way. stage: under pipeline
        parallelism, this rank's PipelineStage (voltllm.distributed.pipeline): the model holds its layers alone,
        under local indices, and each adapter keeps those layers' matrices."""
        from voltllm.model.layers.linear import Linear

        self.config = lora_config
        self.hf_config = hf_config
        self.device = device
        self.dtype = lora_config.lora_dtype
        self.max_loras = lora_config.max_loras
        self.split = split
        self.stage = stage
        self.batch = LoRABatch(max_tokens, self.max_loras, self.dtype, device)
        self.weights: dict[str, LoRAWeights] = {}
        self.expert_weights: dict[str, ExpertLoRAWeights] = {}
        for name, shape in stage_projections(projection_shapes(hf_config), stage).items():
            linear = model.get_submodule(name)
            whole = isinstance(linear, Linear) and tuple(linear.shard_sizes) == shape.shard_sizes
            # (a rank's shard of the projection: as many shards, each cut, under tensor parallelism)
            if not (whole or split is not None and isinstance(linear, Linear)
                    and len(linear.shard_sizes) == len(shape.shard_sizes)):
                raise RuntimeError(f"{name}: not the projection LoRA expects ({shape})")
            linear.lora = self.weights[name] = LoRAWeights(linear.shard_sizes, linear.in_features, self.batch,
                                                           self.max_loras, lora_config.max_lora_rank, self.dtype,
                                                           device)
        from voltllm.model.layers.moe import SparseMoE

        experts = expert_shapes(hf_config)
        check_expert_slots(experts, self.max_loras, lora_config.max_lora_rank)
        for name, shape in stage_projections(experts, stage).items():
            moe = model.get_submodule(name.rpartition(".")[0])  # ("layers.{i}.mlp")
            if not isinstance(moe, SparseMoE) or moe.num_experts != shape.num_experts:
                raise RuntimeError(f"{name}: not the sparse MoE layer LoRA expects ({shape})")
            moe.lora = self.expert_weights[name] = ExpertLoRAWeights(moe, self.batch, self.max_loras,
                                                                     lora_config.max_lora_rank, self.dtype, device)
        self._slot_experts = [False] * self.max_loras  # (host) slots holding an adapter with expert weights
        self.known: dict[LoRAKey, LoRARequest] = {}
        self._current: dict[tuple[str, int], LoRAKey] = {}  # (name, lora_int_id) -> the key new requests run with
        self._retired: set[LoRAKey] = set()  # removed, kept while live requests use them
        self._removed_ids: set[int] = set()  # remove()d ids: a later request's load is retired at once
        self._dropped: list[LoRAKey] = []  # dropped since the last step (the other TP ranks drop them with it)
        self._serials = itertools.count(1)
        self._cpu: OrderedDict[LoRAKey, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[LoRAKey, int] = OrderedDict()  # resident adapter -> slot, least recently used first
        self._dirty_rows = 0  # mask rows that may be non-zero
        logger.info("LoRA: %d projections and %d MoE layers' experts take adapters, %d slot(s) of rank %d, %.1f MiB "
                    "(experts: %.1f MiB)", len(self.weights), len(self.expert_weights), self.max_loras,
                    lora_config.max_lora_rank, sum(w.nbytes for w in self.weights.values()) / 2**20
                    + sum(w.nbytes for w in self.expert_weights.values()) / 2**20,
                    sum(w.nbytes for w in self.expert_weights.values()) / 2**20)

    # -- known adapters -------------------------------------------------------------------------
    def register(self, req: LoRARequest, live_keys: LiveKeys = tuple) -> LoRAKey:
        """The key `req`'s requests run with (its adapter read and checked on its first use); LoRAAdapterError for
        one that cannot run. live_keys: the adapters live requests use (never dropped from CPU memory)."""
        ident = (req.lora_name, req.lora_int_id)
        key = self._current.get(ident)
        if key is not None and self.known[key].lora_path != req.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r} is already loaded from {self.known[key].lora_path} "
                                   f"(lora_int_id {req.lora_int_id}); a second adapter ({req.lora_path}) needs "
                                   "another name or lora_int_id")
        if key is None:  # a request that came after remove() (a beam search's next step): its still live load
            key = self._retired_load(req)
        if key is None:
            key = LoRAKey(req.lora_name, next(self._serials))
            self._read(key, req)
            self.known[key] = req
            if req.lora_int_id in self._removed_ids:  # (dropped when its requests end)
                self._retired.add(key)
            else:
                self._current[ident] = key
        elif key in self._cpu:
            self._cpu.move_to_end(key)
        else:  # dropped from CPU memory (--max-cpu-loras): read again
            self._read(key, req)
        self._limit_cpu(set(live_keys()) | {key})
        return key

    def add(self, req: LoRARequest, live_keys: LiveKeys = tuple) -> LoRAKey:
        """vLLM's add_lora: read and check the adapter now (a removed lora_int_id is taken again: a load of it that
        requests still run with becomes current again, so it is listed and kept when they end)."""
        self._removed_ids.discard(req.lora_int_id)
        ident = (req.lora_name, req.lora_int_id)
        if ident not in self._current:
            key = self._retired_load(req)
            if key is not None:
                self._retired.discard(key)
                self._current[ident] = key
        return self.register(req, live_keys)

    def _retired_load(self, req: LoRARequest) -> Optional[LoRAKey]:
        """The removed load of req's (name, lora_int_id) from its path that live requests still use, if any."""
        ident = (req.lora_name, req.lora_int_id)
        return next((k for k in self._retired if (k.name, self.known[k].lora_int_id) == ident
                     and self.known[k].lora_path == req.lora_path), None)

    def remove(self, lora_int_id: int, live_keys: LiveKeys = tuple) -> bool:
        """vLLM's remove_lora: retire the adapters of that id (new requests of it read it again; the running ones
        finish with it) and drop those no live request uses. False: no such adapter was loaded."""
        idents = [i for i in self._current if i[1] == lora_int_id]
        for ident in idents:
            self._retired.add(self._current.pop(ident))
        self._removed_ids.add(lora_int_id)
        self.drop_retired(live_keys)
        return bool(idents)

    def ids(self) -> set[int]:
        """vLLM's list_loras: the lora_int_ids of the adapters loaded (not removed)."""
        return {i for _, i in self._current}

    @property
    def retiring(self) -> bool:
        return bool(self._retired)

    def drop_retired(self, live_keys: LiveKeys) -> None:
        """Drop the removed adapters no live request uses any more: CPU memory, GPU slot (zeroed)."""
        if not self._retired:
            return
        live = set(live_keys())
        for key in sorted(self._retired - live):
            self._retired.discard(key)
            self._drop(key)
            self._dropped.append(key)

    def _drop(self, key: LoRAKey) -> None:
        self.known.pop(key, None)
        self._cpu.pop(key, None)
        slot = self._slots.pop(key, None)
        if slot is not None:  # (stream-ordered: a step in flight still reads the old values)
            for w in self.weights.values():
                w.load_slot(slot, None)
            for ew in self.expert_weights.values():
                ew.load_slot(slot, None)
            self._slot_experts[slot] = False

    def _read(self, key: LoRAKey, req: LoRARequest) -> None:
        adapter = read_adapter(req, self.hf_config, self.config.max_lora_rank, self.dtype)
        if self.stage is not None:  # this stage's layers, under local indices
            adapter = stage_adapter(adapter, self.stage)
        if self.split is not None:  # this rank's part of each matrix
            adapter = shard_adapter(adapter, self.split, self.weights, self.expert_weights)
        if self.device.type == "cuda":
            adapter.pin()
        self._cpu[key] = adapter

    def _limit_cpu(self, keep: set[LoRAKey]) -> None:
        """At most --max-cpu-loras adapters in CPU memory (least recently used dropped first), but never one of
        `keep`."""
        excess = len(self._cpu) - self.config.max_cpu_loras
        if excess > 0:
            for key in [k for k in self._cpu if k not in keep][:excess]:
                del self._cpu[key]

    def check_integrity(self, live_keys: Iterable[LoRAKey]) -> None:
        live = set(live_keys)
        assert live <= set(self._cpu), f"LoRA adapters of live requests not in CPU memory: {live - set(self._cpu)}"
        assert self._retired <= live, f"removed LoRA adapters kept without live requests: {self._retired - live}"
        assert set(self._cpu) <= set(self.known) and set(self._slots) <= set(self.known), "unknown LoRA adapters held"
        assert set(self._current.values()) | self._retired == set(self.known), \
            "LoRA adapters neither current nor retired"

    # -- one step -------------------------------------------------------------------------------
    def prepare_step(self, scheduled: list, num_tokens: int) -> LoRAStep:
        """Each token's adapter for the step whose tokens (padding included: num_tokens) the runner laid out in
        scheduled order, each request's num_new_tokens together: the adapters take slots, the mask is uploaded.
        Returns what the other tensor-parallel ranks repeat (follow_step)."""
        step = LoRAStep(drops=self._dropped)
        self._dropped = []
        keys = [s.request.lora_key for s in scheduled]
        if not any(keys):
            self._upload_mask(None, num_tokens)
            return step
        slot_of = self._assign({k for k in keys if k}, step.loads)
        per_request = np.array([slot_of[k] if k else -1 for k in keys], dtype=np.int32)
        step.token_slots = np.repeat(per_request, [s.num_new_tokens for s in scheduled])
        self._upload_mask(step.token_slots, num_tokens)
        return step

    def follow_step(self, step: LoRAStep, num_tokens: int) -> None:
        """A tensor-parallel rank other than 0: rank 0's drops, its slot loads (each adapter read and cut here,
        unless still in this rank's CPU memory) and its tokens' slots."""
        for key in step.drops:
            self._drop(key)
        for slot, key, req in step.loads:
            if key in self._cpu:
                self._cpu.move_to_end(key)
            else:
                self._read(key, req)
                self.known[key] = req
                # CPU memory keeps the adapters of the other slots for sure (this rank does not know the live
                # requests; one dropped here is read again when rank 0 puts it back)
                self._limit_cpu({k for k, j in self._slots.items() if j != slot} | {key})
            self._load_slot(slot, key)
        self._upload_mask(step.token_slots, num_tokens)

    def _upload_mask(self, per_token: Optional[np.ndarray], num_tokens: int) -> None:
        """The mask rows of the step's num_tokens tokens from each real token's slot (-1: none; None: no adapter in
        the step: the eager forward skips the terms)."""
        slots = set(np.unique(per_token).tolist()) if per_token is not None else set()
        self.batch.experts_active = any(self._slot_experts[s] for s in slots if s >= 0)
        if per_token is None:
            self.batch.active = False
            if self._dirty_rows:  # (graphs read the mask whatever `active` says)
                self.batch.mask[:self._dirty_rows].zero_()
                self._dirty_rows = 0
            return
        onehot = np.zeros((num_tokens, self.max_loras), dtype=np.float32)
        rows = np.flatnonzero(per_token >= 0)
        onehot[rows, per_token[rows]] = 1.0
        src = torch.from_numpy(onehot).to(self.dtype)
        cuda = self.device.type == "cuda"
        # (pinned, non-blocking: the host does not wait for the GPU; rows past num_tokens are read by no step of
        # num_tokens and are cleared by the next step without adapters)
        self.batch.mask[:num_tokens].copy_(src.pin_memory() if cuda else src, non_blocking=cuda)
        self._dirty_rows = max(self._dirty_rows, num_tokens)
        self.batch.active = True

    def _assign(self, keys: set[LoRAKey], loads: list[tuple[int, LoRAKey, LoRARequest]]) -> dict[LoRAKey, int]:
        """A slot for each adapter of the step (at most --max-loras: the scheduler's admission rule); the slots it
        loads are appended to `loads`."""
        if len(keys) > self.max_loras:
            raise RuntimeError(f"a step with {len(keys)} LoRA adapters; --max-loras is {self.max_loras}")
        for key in keys:
            if key in self._slots:
                self._slots.move_to_end(key)
        for key in sorted(k for k in keys if k not in self._slots):
            used = set(self._slots.values())
            free = [j for j in range(self.max_loras) if j not in used]
            if free:
                slot = free[0]
            else:  # the least recently used resident adapter this step does not need
                slot = self._slots[next(k for k in self._slots if k not in keys)]
            self._load_slot(slot, key)
            loads.append((slot, key, self.known[key]))
        return {key: self._slots[key] for key in keys}

    def _load_slot(self, slot: int, key: LoRAKey) -> None:
        """Adapter `key` (in CPU memory) into `slot`, replacing the one there."""
        adapter = self._cpu.get(key)
        if adapter is None:  # (a live request's adapter is never dropped from CPU memory)
            raise RuntimeError(f"LoRA adapter {key.name!r} is not loaded")
        for held in [k for k, j in self._slots.items() if j == slot]:
            del self._slots[held]
        for linear, w in self.weights.items():
            w.load_slot(slot, adapter.weights.get(linear))
        for name, ew in self.expert_weights.items():
            ew.load_slot(slot, adapter.experts.get(name))
        self._slot_experts[slot] = adapter.has_experts
        self._slots[key] = slot

    @contextlib.contextmanager
    def capturing(self):
        """CUDA-graph captures record the LoRA terms (a replay computes them over the mask the step filled); the
        next step's prepare_step sets `active` again for eager forwards."""
        self.batch.active = True
        self.batch.experts_active = False  # (expert terms run eagerly: never recorded in a graph)
        yield

    def needs_eager(self, scheduled: list) -> bool:
        """Whether a step of these scheduled requests must run eagerly: one of them uses an adapter with MoE expert
        weights (their terms sort the pairs on the host: lora/experts.py)."""
        return any(s.request.lora_key and self._cpu[s.request.lora_key].has_experts for s in scheduled)

    def resident(self) -> dict[LoRAKey, int]:
        return dict(self._slots)

    def cached(self) -> list[LoRAKey]:
        return list(self._cpu)


# the experts' slots may take at most this share of the experts' own weights (a bound, not a tuning: beyond it the
# slots cost more memory than the model's experts; --max-loras or --max-lora-rank is then to be lowered)
EXPERT_SLOTS_MAX_SHARE = 1.0


def check_expert_slots(experts: dict, max_loras: int, max_rank: int) -> None:
    """ValueError when the MoE experts' LoRA slots (--max-loras x experts x --max-lora-rank x 3 (hidden + inter) per
    layer) would take more values than the experts themselves (experts x 3 hidden x inter)."""
    if not experts:
        return
    slots = sum(expert_slot_values(s, max_loras, max_rank) for s in experts.values())
    weights = sum(s.num_experts * 3 * s.hidden * s.inter for s in experts.values())
    if slots > EXPERT_SLOTS_MAX_SHARE * weights:
        shape = next(iter(experts.values()))
        raise ValueError(
            f"--enable-lora: the MoE experts' LoRA slots would hold {slots / 1e6:.1f}M values (--max-loras {max_loras} "
            f"x {shape.num_experts} experts x --max-lora-rank {max_rank} x 3 x (hidden {shape.hidden} + inter "
            f"{shape.inter}) per MoE layer, {len(experts)} layers), more than the experts themselves "
            f"({weights / 1e6:.1f}M); lower --max-loras or --max-lora-rank")


def lora_token_capacity(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Rows of the mask: any step's tokens (the runner's input buffers hold as many)."""
    return max(max_num_batched_tokens, max_num_seqs) + 8


def optional_lora(manager: Optional[LoRAManager]):
    return manager.capturing() if manager is not None else contextlib.nullcontext()
