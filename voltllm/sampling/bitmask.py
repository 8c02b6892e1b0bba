"""Token bitmasks (xgrammar's layout: int32 words, bit j of word w allows token 32 * w + j) applied to logits.

Plain torch ops on the logits' device (no Triton kernel: every kernel must pass the sm_70 gate, and this one is
a shift, an and and a masked fill). Only the constrained rows are unpacked, a byte per token: a step with one
constrained request among hundreds does not build a [rows, vocab] intermediate."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class TokenBitmask:
    """Allowed tokens of some of a batch's rows: words[i] (int32 [words]) applies to row rows[i] (None: row i)."""

    words: torch.Tensor
    rows: Optional[torch.Tensor] = None


_BIT = {}  # device -> [8] uint8 shifts


def apply_token_bitmask_(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """Set the logits of tokens the mask disallows to -inf, in place; returns them. The mask's tensors are on the
    logits' device; words * 32 >= the vocabulary."""
    vocab = logits.shape[1]
    words = mask.words
    n = words.shape[0]
    assert words.dtype == torch.int32 and words.shape[1] * 32 >= vocab, (words.shape, logits.shape)
    shifts = _BIT.get(words.device)
    if shifts is None:
        shifts = _BIT[words.device] = torch.arange(8, dtype=torch.uint8, device=words.device)
    # the int32 words' bytes in memory order (little-endian, as on x86 / ARM hosts and NVIDIA GPUs): byte k of
    # word w holds tokens 32w + 8k .. 32w + 8k + 7, lowest bit first
    disallowed = ((words.view(torch.uint8).view(n, -1, 1) >> shifts) & 1).view(n, -1)[:, :vocab] == 0
    if mask.rows is None:
        return logits.masked_fill_(disallowed, float("-inf"))
    logits[mask.rows] = logits[mask.rows].masked_fill_(disallowed, float("-inf"))
    return logits
