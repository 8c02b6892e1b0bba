"""The target's whole vocabulary (embedding table and LM head) on rank 0 of a tensor-parallel group, for the drafters
that borrow the target's and run whole on rank 0 (MTP, DFlash and the EAGLE heads under -tp -pp or with
draft_tensor_parallel_size 1: under -tp alone they are split and run on every rank with the target's own tables,
worker/mtp_runner.py, dflash_runner.py).

Those drafters run unsharded on rank 0, beside its target shard (as a draft model does), but the target's
vocabulary-parallel embedding and LM head are collectives: every rank must call them. So at start-up every rank hands
its vocabulary rows to rank 0 (two gathers), which keeps whole copies for the drafter: the same values as the
target's, at the cost of one table (tied) or two on rank 0, which the KV sizing charges to every rank (the block count
is the ranks' minimum).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


class FullVocab(nn.Module):
    """Whole [vocab, hidden] embedding table and LM head (the same tensor when tied)."""

    def __init__(self, embed: torch.Tensor, head: Optional[torch.Tensor]):
        super().__init__()
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.head = None if head is None else nn.Parameter(head, requires_grad=False)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype over the whole vocabulary, as the target's compute_logits gives them."""
        return F.linear(hidden, self.embed if self.head is None else self.head)


class _Embedding(nn.Module):
    """FullVocab's lookup as a module (what a drafter's body calls as its embed_tokens)."""

    def __init__(self, vocab: FullVocab):
        super().__init__()
        self._vocab = [vocab]  # (a list: the tables are FullVocab's, not this module's)

    @property
    def weight(self) -> torch.Tensor:  # (what GEMM tuning reads as a tied head's weight)
        return self._vocab[0].embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._vocab[0].embed_tokens(ids)


def embedding_module(vocab: FullVocab) -> nn.Module:
    return _Embedding(vocab)


def _dense_shard(model: Any, what: str) -> torch.Tensor:
    holder = model.embed_tokens if what == "embedding" or model.tie else model.lm_head
    weight = getattr(holder, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise ValueError(f"an MTP / DFlash / EAGLE drafter whole on rank 0 (-pp, draft_tensor_parallel_size 1) needs "
                         f"the target's {what} held dense (rank 0 keeps a whole copy for the drafter); it is kept "
                         "quantized here: drop --quantization to dequantize the checkpoint at load")
    return weight


def gather_full_vocab(model: Any, tp: Any) -> Optional[FullVocab]:
    """Every rank of the group calls this at the same point of its start-up: rank 0 returns the whole tables (the
    ranks' row shards in rank order, the padding past the vocabulary dropped), the others None."""
    vocab_size = int(model.vocab_size)
    embed = _dense_shard(model, "embedding")
    full_embed = tp.gather_rows(embed.data)
    full_head = None
    if not model.tie:
        full_head = tp.gather_rows(_dense_shard(model, "LM head").data)
    if tp.rank != 0:
        return None
    head = None if full_head is None else full_head[:vocab_size]
    return FullVocab(full_embed[:vocab_size], head)
