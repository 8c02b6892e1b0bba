"""The LoRA term of one projection, for a batch whose tokens run different adapters (or none).

Each Linear that takes adapters gets a `LoRAWeights` (`linear.lora`) holding every slot's weights stacked:
  a: [shards x slots x R, in]    row (s, j, k): rank row k of slot j's lora_A for shard s (zero past the adapter's r)
  b: [shards x slots x R, out]   the same rows of B^T x scaling, each only in its shard's output columns
With the step's one-hot mask [tokens, slots] (`LoRABatch.mask`: 1 where a token runs the adapter in that slot; a
token without an adapter has an all-zero row), the term is three launches of fixed shape:
  xa = x a^T;  xa *= mask (per slot);  y += xa b
so every token takes its own adapter's (x A^T) B^T x scaling and no other's, whatever mix the batch holds. The
shapes depend only on the token count, the adapter choice is device data: CUDA graphs capture it and a replay reads
the mask the runner filled (no host sync, no per-step launch change). R is --max-lora-rank, slots --max-loras: the
products are tokens x slots x R wide (small next to the projection itself).
Under tensor parallelism `in` and `out` are the rank's (lora/sharding.py cuts the adapters): a row-parallel
projection's term is the rank's partial one, added into its partial product before the all-reduce that follows.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class LoRABatch:
    """The step's adapter choice per token, on the device. `mask` has a fixed address (graphs read it); `active`:
    whether an eager forward computes the LoRA terms at all (a step without adapters skips them; captures and
    replays always compute them, over an all-zero mask then)."""

    def __init__(self, max_tokens: int, max_loras: int, dtype: torch.dtype, device: torch.device):
        self.mask = torch.zeros(max_tokens, max_loras, dtype=dtype, device=device)
        self.active = True
        # whether the step's tokens use an adapter with MoE expert weights (an eager step: lora/experts.py)
        self.experts_active = False


class LoRAWeights:
    def __init__(self, shard_sizes: list[int], in_features: int, batch: LoRABatch, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.batch = batch
        self.shard_sizes = list(shard_sizes)
        self.offsets = [sum(self.shard_sizes[:s]) for s in range(len(self.shard_sizes))]
        self.slots, self.rank = max_loras, max_rank
        self.in_features = in_features
        rows = len(self.shard_sizes) * max_loras * max_rank
        self.a = torch.zeros(rows, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(rows, sum(self.shard_sizes), dtype=dtype, device=device)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x, [T, out], fresh) plus each token's LoRA term, in place."""
        if not self.batch.active:
            return y
        t = x.shape[0]
        xa = F.linear(x if x.dtype == self.a.dtype else x.to(self.a.dtype), self.a)
        xa.view(t, len(self.shard_sizes), self.slots, self.rank).mul_(self.batch.mask[:t, None, :, None])
        return y.addmm_(xa, self.b)

    def _rows(self, shard: int, slot: int) -> slice:
        start = (shard * self.slots + slot) * self.rank
        return slice(start, start + self.rank)

    def load_slot(self, slot: int, shards: Optional[dict[int, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Slot `slot` (0-based: the mask's column) takes an adapter's {shard: (A [r, in], B^T scaled [r, n])},
        zeros where it has none. Stream-ordered copies: a step still in flight reads the old values."""
        for s in range(len(self.shard_sizes)):
            rows = self._rows(s, slot)
            self.a[rows].zero_()
            self.b[rows].zero_()
        nb = self.a.is_cuda
        for s, (a, bt) in (shards or {}).items():
            r = a.shape[0]
            rows = self._rows(s, slot)
            self.a[rows.start:rows.start + r].copy_(a, non_blocking=nb)
            off, n = self.offsets[s], self.shard_sizes[s]
            self.b[rows.start:rows.start + r, off:off + n].copy_(bt, non_blocking=nb)

    @property
    def nbytes(self) -> int:
        return (self.a.numel() + self.b.numel()) * self.a.element_size()
