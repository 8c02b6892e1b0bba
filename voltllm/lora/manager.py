"""The engine's side of LoRA: which adapters it knows, which sit in the GPU slots, and each step's per-token mask.

- Known adapters: a request names one with a LoRARequest; the first request of a name reads and checks it
  (`register`, at add_request: a bad adapter is that request's error). Checked adapters are kept in CPU memory,
  least recently used dropped beyond --max-cpu-loras, but never one a live request uses (a dropped one is read from
  its path again by its next request).
- GPU slots: --max-loras of them in every LoRA-taking Linear (layers.LoRAWeights). The scheduler admits requests so
  that the running batch holds at most --max-loras distinct adapters; each step the adapters of its requests take
  slots (resident ones stay, others evict a slot no request of the step uses, least recently used first) and the
  runner fills the mask (`prepare_step`).
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from voltllm.lora.adapter import LoRAAdapter, LoRAAdapterError, projection_shapes, read_adapter
from voltllm.lora.layers import LoRABatch, LoRAWeights
from voltllm.lora.request import LoRARequest

logger = logging.getLogger("voltllm")


class LoRAManager:
    def __init__(self, model: torch.nn.Module, lora_config: Any, hf_config: Any, max_tokens: int,
                 device: torch.device):
        from voltllm.model.layers.linear import Linear

        self.config = lora_config
        self.hf_config = hf_config
        self.device = device
        self.dtype = lora_config.lora_dtype
        self.max_loras = lora_config.max_loras
        self.batch = LoRABatch(max_tokens, self.max_loras, self.dtype, device)
        self.weights: dict[str, LoRAWeights] = {}
        for name, shape in projection_shapes(hf_config).items():
            linear = model.get_submodule(name)
            if not isinstance(linear, Linear) or tuple(linear.shard_sizes) != shape.shard_sizes:
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
        if self.device.type == "cuda":
            adapter.pin()
        self.known[req.lora_name] = req
        self._cpu[req.lora_name] = adapter
        if len(self._cpu) > self.config.max_cpu_loras:
            keep = set(live_names()) | {req.lora_name}
            for name in [n for n in self._cpu if n not in keep][: len(self._cpu) - self.config.max_cpu_loras]:
                del self._cpu[name]

    # -- one step -------------------------------------------------------------------------------
    def prepare_step(self, scheduled: list, num_tokens: int) -> None:
        """Each token's adapter for the step whose tokens (padding included: num_tokens) the runner laid out in
        scheduled order, each request's num_new_tokens together: the adapters take slots, the mask is uploaded."""
        names = [s.request.lora_name for s in scheduled]
        if not any(names):
            self.batch.active = False
            if self._dirty_rows:  # (graphs read the mask whatever `active` says)
                self.batch.mask[:self._dirty_rows].zero_()
                self._dirty_rows = 0
            return
        slot_of = self._assign({n for n in names if n})
        per_request = np.array([slot_of[n] if n else -1 for n in names], dtype=np.int64)
        per_token = np.repeat(per_request, [s.num_new_tokens for s in scheduled])
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

    def _assign(self, names: set[str]) -> dict[str, int]:
        """A slot for each adapter of the step (at most --max-loras: the scheduler's admission rule)."""
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
                victim = next(n for n in self._slots if n not in names)
                slot = self._slots.pop(victim)
            adapter = self._cpu.get(name)
            if adapter is None:  # (a live request's adapter is never dropped from CPU memory)
                raise RuntimeError(f"LoRA adapter {name!r} is not loaded")
            for linear, w in self.weights.items():
                w.load_slot(slot, adapter.weights.get(linear))
            self._slots[name] = slot
        return {name: self._slots[name] for name in names}

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
