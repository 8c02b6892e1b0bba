"""Token bitmasks (xgrammar's layout: int32 words, bit j of word w allows token 32 * w + j) applied to logits.

Plain torch ops on the logits' device (no Triton kernel: every kernel must pass the sm_70 gate, and this one is
a shift, an and and a masked fill)."""
from __future__ import annotations

import torch


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of tokens the bitmask disallows to -inf, in place. bitmask: [rows, words] int32 on the logits'
    device, words * 32 >= the vocabulary (a row of -1 allows everything)."""
    rows, vocab = logits.shape
    assert bitmask.shape[0] == rows and bitmask.shape[1] * 32 >= vocab, (bitmask.shape, logits.shape)
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(rows, -1)[:, :vocab]
    return logits.masked_fill_(allowed == 0, float("-inf"))
