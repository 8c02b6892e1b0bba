"""The engine's side of LoRA: which adapters it knows, which sit in the GPU slots, and each step's per-token mask.

- Known adapters: a request names one with a LoRARequest; the first request of a name reads and checks it
  (`register`, at add_request: a bad adapter is that request's error). Checked adapters are kept in CPU memory,
  least recently used dropped beyond --max-cpu-loras, but never one a live request uses (a dropped one is read from
  its path again by its next request).
- GPU slots: --max-loras of them in every LoRA-taking Linear (layers.LoRAWeights). The scheduler admits requests so
  that the running batch holds at most --max-loras distinct adapters; each step the adapters of its requests take
  slots (resident ones stay, others evict a slot no request of the step uses, least recently used first) and the
  runner fills the mask (`prepare_step`).
- Tensor parallelism: every rank has a manager whose slots hold its cut of each adapter (lora/sharding.py). Rank 0
  decides; `prepare_step` returns the step's `LoRAStep` (the slot loads it made, each token's slot), which travels in
  the step's StepInputs, and the other ranks repeat it (`follow_step`): they read each adapter from its path
  themselves when it first takes a slot there, so every rank holds the same adapter in the same slot.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from voltllm.lora.adapter import LoRAAdapter, LoRAAdapterError, projection_shapes, read_adapter
from voltllm.lora.layers import LoRABatch, LoRAWeights
from voltllm.lora.request import LoRARequest
from voltllm.lora.sharding import Split, shard_adapter

logger = logging.getLogger("voltllm")


@dataclass
class LoRAStep:
    """One step's LoRA choices as rank 0 made them, for the other tensor-parallel ranks to repeat: the adapters that
    took a slot this step (slot, request; in order) and each of the step's real tokens' slot (-1: none; None: a step
    without adapters)."""

    loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    token_slots: Optional[np.ndarray] = None


class LoRAManager:
    def __init__(self, model: torch.nn.Module, lora_config: Any, hf_config: Any, max_tokens: int,
                 device: torch.device, split: Optional[Split] = None):
        """split: under tensor parallelism, the model's cut of a checkpoint weight for this rank (its `tp_part`):
        the projections are the rank's shards, and each adapter is cut the same way."""
        from voltllm.model.layers.linear import Linear

        self.config = lora_config
        self.hf_config = hf_config
        self.device = device
        self.dtype = lora_config.lora_dtype
        self.max_loras = lora_config.max_loras
        self.split = split
        self.batch = LoRABatch(max_tokens, self.max_loras, self.dtype, device)
        self.weights: dict[str, LoRAWeights] = {}
        for name, shape in projection_shapes(hf_config).items():
            linear = model.get_submodule(name)
            whole = isinstance(linear, Linear) and tuple(linear.shard_sizes) == shape.shard_sizes
            # (a rank's shard of the projection: as many shards, each cut, under tensor parallelism)
            if not (whole or split is not None and isinstance(linear, Linear)
                    and len(linear.shard_sizes) == len(shape.shard_sizes)):
                raise RuntimeError(f"{name}: not the projection LoRA expects ({shape})")
            linear.lora = self.weights[name] = LoRAWeights(linear.shard_sizes, linear.in_features, self.batch,
                                                           self.max_loras, lora_config.max_lora_rank, self.dtype,
                                                           device)
        self.known: dict[str, LoRARequest] = {}
        self._cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, least recently used first
        self._dirty_rows = 0  # mask rows that may be non-zero
        logger.info("LoRA: %d projections take adapters, %d slot(s) of rank %d, %.1f MiB", len(self.weights),
                    self.max_loras, lora_config.max_lora_rank,
                    sum(w.nbytes for w in self.weights.values()) / 2**20)

    # -- known adapters -------------------------------------------------------------------------
    def register(self, req: LoRARequest, live_names: Callable[[], Iterable[str]] = tuple) -> None:
        """Make `req`'s adapter known (read and checked on its first use); LoRAAdapterError for one that cannot run.
        live_names: the adapters live requests use (never dropped from CPU memory)."""
        known = self.known.get(req.lora_name)
        if known is not None and known.lora_path != req.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {req.lora_name!r} is already loaded from {known.lora_path}; a "
                                   f"second adapter ({req.lora_path}) needs another name")
        if req.lora_name in self._cpu:
            self._cpu.move_to_end(req.lora_name)
            return
        adapter = read_adapter(req, self.hf_config, self.config.max_lora_rank, self.dtype)
        if self.split is not None:  # this rank's part of each matrix
            adapter = shard_adapter(adapter, self.split, self.weights)
        if self.device.type == "cuda":
            adapter.pin()
        self.known[req.lora_name] = req
        self._cpu[req.lora_name] = adapter
        if len(self._cpu) > self.config.max_cpu_loras:
            keep = set(live_names()) | {req.lora_name}
            for name in [n for n in self._cpu if n not in keep][: len(self._cpu) - self.config.max_cpu_loras]:
                del self._cpu[name]

    # -- one step -------------------------------------------------------------------------------
    def prepare_step(self, scheduled: list, num_tokens: int) -> LoRAStep:
        """Each token's adapter for the step whose tokens (padding included: num_tokens) the runner laid out in
        scheduled order, each request's num_new_tokens together: the adapters take slots, the mask is uploaded.
        Returns what the other tensor-parallel ranks repeat (follow_step)."""
        names = [s.request.lora_name for s in scheduled]
        if not any(names):
            self._upload_mask(None, num_tokens)
            return LoRAStep()
        step = LoRAStep()
        slot_of = self._assign({n for n in names if n}, step.loads)
        per_request = np.array([slot_of[n] if n else -1 for n in names], dtype=np.int32)
        step.token_slots = np.repeat(per_request, [s.num_new_tokens for s in scheduled])
        self._upload_mask(step.token_slots, num_tokens)
        return step

    def follow_step(self, step: LoRAStep, num_tokens: int) -> None:
        """A tensor-parallel rank other than 0: rank 0's slot loads (each adapter read and cut here, unless still
        in this rank's CPU memory) and its tokens' slots."""
        for slot, req in step.loads:
            # CPU memory keeps the adapters of the other slots for sure (this rank does not know the live requests;
            # one dropped here is read again when rank 0 puts it back)
            others = {n for n, j in self._slots.items() if j != slot}
            self.register(req, lambda: others)
            self._load_slot(slot, req.lora_name)
        self._upload_mask(step.token_slots, num_tokens)

    def _upload_mask(self, per_token: Optional[np.ndarray], num_tokens: int) -> None:
        """The mask rows of the step's num_tokens tokens from each real token's slot (-1: none; None: no adapter in
        the step: the eager forward skips the terms)."""
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

    def _assign(self, names: set[str], loads: list[tuple[int, LoRARequest]]) -> dict[str, int]:
        """A slot for each adapter of the step (at most --max-loras: the scheduler's admission rule); the slots it
        loads are appended to `loads`."""
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step with {len(names)} LoRA adapters; --max-loras is {self.max_loras}")
        for name in names:
            if name in self._slots:
                self._slots.move_to_end(name)
        for name in sorted(n for n in names if n not in self._slots):
            used = set(self._slots.values())
            free = [j for j in range(self.max_loras) if j not in used]
            if free:
                slot = free[0]
            else:  # the least recently used resident adapter this step does not need
                slot = self._slots[next(n for n in self._slots if n not in names)]
            self._load_slot(slot, name)
            loads.append((slot, self.known[name]))
        return {name: self._slots[name] for name in names}

    def _load_slot(self, slot: int, name: str) -> None:
        """Adapter `name` (in CPU memory) into `slot`, replacing the one there."""
        adapter = self._cpu.get(name)
        if adapter is None:  # (a live request's adapter is never dropped from CPU memory)
            raise RuntimeError(f"LoRA adapter {name!r} is not loaded")
        for held in [n for n, j in self._slots.items() if j == slot]:
            del self._slots[held]
        for linear, w in self.weights.items():
            w.load_slot(slot, adapter.weights.get(linear))
        self._slots[name] = slot

    @contextlib.contextmanager
    def capturing(self):
        """CUDA-graph captures record the LoRA terms (a replay computes them over the mask the step filled); the
        next step's prepare_step sets `active` again for eager forwards."""
        self.batch.active = True
        yield

    def resident(self) -> dict[str, int]:
        return dict(self._slots)

    def cached(self) -> list[str]:
        return list(self._cpu)


def lora_token_capacity(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Rows of the mask: any step's tokens (the runner's input buffers hold as many)."""
    return max(max_num_batched_tokens, max_num_seqs) + 8


def optional_lora(manager: Optional[LoRAManager]):
    return manager.capturing() if manager is not None else contextlib.nullcontext()
