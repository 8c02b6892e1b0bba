"""The token embedding split by vocabulary rows over the tensor-parallel ranks (voltllm.distributed).

Each rank holds rows [start, start + rows) (the last rank's tail zero-padded past the vocabulary); a lookup reads
the ids this rank holds, zeroes the rest and sums over the ranks. A tied LM head multiplies by the same shard and
the ranks' logits are gathered side by side (LlamaForCausalLM.compute_logits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.distributed.sharding import take_rows, vocab_rows


class VocabParallelEmbedding(nn.Embedding):
    """An nn.Embedding of this rank's rows (so what counts embeddings, e.g. bench/limits.py, counts it)."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp):
        rows = vocab_rows(vocab_size, tp.size)
        super().__init__(rows, hidden, dtype=dtype)
        self.weight.requires_grad_(False)
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = rows
        self.start = tp.rank * rows

    def load(self, full: torch.Tensor) -> None:
        """The checkpoint's whole [vocab, hidden] table -> this rank's rows."""
        if full.shape != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"embedding of shape {tuple(full.shape)}, expected "
                             f"{(self.vocab_size, self.weight.shape[1])}")
        self.weight.data.copy_(take_rows(full, self.start, self.rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local, held = shard_ids(ids, self.start, self.rows)
        return sum_over_ranks(F.embedding(local, self.weight), held, self.tp)


def shard_ids(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids as rows of this rank's shard [start, start + rows), ids other ranks hold reading row 0; which it holds)."""
    local = ids - start
    held = (local >= 0) & (local < rows)
    return torch.where(held, local, torch.zeros_like(local)), held


def sum_over_ranks(out: torch.Tensor, held: torch.Tensor, tp) -> torch.Tensor:
    """The looked-up rows with those of ids other ranks hold zeroed (their rank adds the row), summed over ranks."""
    out.masked_fill_(~held.unsqueeze(-1), 0)
    return tp.all_reduce_(out)
