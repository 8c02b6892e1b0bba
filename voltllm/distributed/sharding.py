"""Which slice of each weight a rank holds (Megatron-style 1-D tensor parallelism), as plain arithmetic.

- Attention: query heads split evenly; KV heads split evenly when there are at least as many as ranks, else each
  rank keeps the one KV head its query heads read (replicated over N / kv_heads ranks).
- MLP: the intermediate dimension split evenly (gate and up alike); weights kept quantized whose even share would cut
  a quantized group: whole groups per rank, not all ranks the same number (intermediate_split).
- Vocabulary (embedding, LM head): ceil(V / N) rows per rank, the last rank's tail zero-padded.

Weights kept quantized (model.layers.quantized_linear.PackedWeight) are cut the same way, lazily: `PackedWeight.cut`
records the slice and applies it when the layer re-lays the weight (rows: whole plane rows; input columns: whole
blocks / groups of the format, else a load error naming the layer, the kind and the multiple).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def even_split(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of rank's share of `total` items split evenly (total % size == 0, checked by support.py)."""
    n = total // size
    return rank * n, n


def intermediate_split(total: int, tp) -> tuple[int, int]:
    """(start, length) of this rank's rows of an MLP or expert intermediate dimension: an even share; or, where the
    weights are kept quantized and an even share would cut a quantized group of the down projection's inputs
    (tp.intermediate_align > 1, e.g. Qwen3-30B-A3B's 768 expert rows at -tp 4 with int4 groups of 128), whole groups,
    the first ranks one group more (2, 2, 1, 1 groups of 128). Each rank's down projection adds its partial sum to the
    all-reduce as before: the shares need not be equal."""
    align = getattr(tp, "intermediate_align", 1)
    if align == 1 or total % align or (total // tp.size) % align == 0:
        return even_split(total, tp.rank, tp.size)
    base, extra = divmod(total // align, tp.size)
    return (tp.rank * base + min(tp.rank, extra)) * align, (base + (tp.rank < extra)) * align


@dataclass(frozen=True)
class HeadShard:
    """Rank's attention heads: query heads [q_start, q_start + num_heads), KV heads [kv_start, kv_start + num_kv)."""

    num_heads: int
    q_start: int
    num_kv_heads: int
    kv_start: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, size: int) -> "HeadShard":
        q_start, q_n = even_split(num_heads, rank, size)
        if num_kv_heads >= size:
            kv_start, kv_n = even_split(num_kv_heads, rank, size)
        else:  # fewer KV heads than ranks: the KV head of this rank's query heads (they share one group)
            kv_start, kv_n = q_start // (num_heads // num_kv_heads), 1
        return cls(q_n, q_start, kv_n, kv_start)


def vocab_rows(vocab: int, size: int) -> int:
    """Rows of the embedding / LM head per rank."""
    return -(-vocab // size)


def _packed(t) -> bool:
    from voltllm.model.layers.quantized_linear import PackedWeight

    return isinstance(t, PackedWeight)


def take_rows(t, start: int, n: int):
    """Rows [start, start + n) of t (dim 0), zero rows where they pass its end (the vocabulary's padded tail)."""
    if _packed(t):
        return t.cut(0, start, n)
    part = t[start:start + n]
    if part.shape[0] == n:
        return part
    return torch.cat([part, part.new_zeros((n - part.shape[0],) + tuple(t.shape[1:]))])


def take_cols(t, start: int, n: int, what: str = ""):
    """Columns [start, start + n) of a 2-D weight (a row-parallel projection's input features); `what` names the
    layer in a packed weight's misaligned-cut error."""
    if _packed(t):
        return t.cut(1, start, n, what)
    return t[:, start:start + n]
