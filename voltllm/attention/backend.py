"""Attention backend contract: paged KV cache layout, per-step metadata, and the backend interface.

KV cache layout (one tensor per attention layer):
    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim)   [0] = K, [1] = V
Token t of a request lives in block `block_table[t // block_size]` at offset `t % block_size`;
its flat slot is `block * block_size + offset` (slot_mapping). A slot of -1 means "do not write"
(padding rows of a CUDA-graph batch).

One step's batch is a flat list of tokens: request i owns rows query_start_loc[i]:query_start_loc[i+1]
and, after this step, has seq_lens[i] tokens of context in its blocks (the new ones included). Its
query rows are the last (query_len) positions of that context, causally masked.

Sliding-window layers (forward's `window` W > 0): a query row at position p sees only the keys at positions
p - W + 1 .. p (transformers' sliding_attention). A caller whose rows see past their own position (the DFlash
drafter's block rows: each is a one-row sequence whose context ends after the block) passes `query_positions`, the
step's int64 positions, so the window of a one-row sequence starts at query_positions[row] - W + 1 instead of at its
context's last position; the keys after it up to the context's end stay visible.
"""
from __future__ import annotations

import functools

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], device
    seq_lens: torch.Tensor  # int32 [num_seqs], device
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], device
    slot_mapping: torch.Tensor  # int64 [num_tokens], device
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def longest_one_row_context(self) -> int:
        """The longest context of a sequence with one query row this step (a decode row); -1 without any. Computed
        once per step (every attention layer of a mixed step asks)."""
        qsl, lens = self.query_start_loc_cpu, self.seq_lens_cpu
        return max((lens[i] for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1), default=-1)


class CacheWrite(NamedTuple):
    """This step's V rows and where K and V go: handed to the model's RoPE launch, which stores the rotated K
    and V in the cache itself (one kernel less per layer), after which forward() runs with kv_written=True."""
    v: torch.Tensor  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor  # int64, -1 = skip; rows past its end are skipped
    fmt: int = -1  # a uint8 fp8 cache: fp8_codec.FP8_E4M3 / FP8_E5M2 / FP8_E4M3_HW, codes of x / scale
    k_scale: Optional[torch.Tensor] = None  # fp8: the layer's fp32 scales (one element each)
    v_scale: Optional[torch.Tensor] = None


class DecodeRope(NamedTuple):
    """A pure-decode step's K / V rows before QK-norm and RoPE, and what rotates them: handed to a backend whose
    decode kernel applies the norm and RoPE to q and k itself and stores K and V in the cache (one launch for
    RoPE + KV store + attention; `fuses_decode_rope`). q passed to forward() is then unrotated too."""
    k: torch.Tensor  # [T, num_kv_heads, head_dim]
    v: torch.Tensor  # [T, num_kv_heads, head_dim]
    positions: torch.Tensor  # int64 [T]
    cos: torch.Tensor  # fp32 [max_pos, head_dim / 2] (rotary over the whole head)
    sin: torch.Tensor
    q_norm: Optional[torch.Tensor]  # per-head RMSNorm weights [head_dim] (Qwen3 QK-norm), or None
    k_norm: Optional[torch.Tensor]
    eps: float = 1e-6
    norm_offset: float = 0.0  # the (1 + w) norm variant


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged cache. Stateless across layers."""

    name: str = "abstract"

    def cache_write_for(self, v: torch.Tensor, kv_cache: torch.Tensor, meta: "AttentionMetadata",
                        k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None
                        ) -> Optional[CacheWrite]:
        """A CacheWrite when the model may store K/V itself in its RoPE launch (then forward(..., kv_written=
        True)); None when forward must write them. k_scale / v_scale: the layer's fp8 scales (fp8 caches)."""
        return None

    def fuses_decode_rope(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: "AttentionMetadata",
                          rotary_dim: int) -> bool:
        """Whether forward(..., rope=DecodeRope(...)) may be used for this step (then the model skips its RoPE
        launch and hands unrotated q / k)."""
        return False

    def limit_context(self, max_context: int) -> None:
        """The engine's longest context is now max_context (--max-model-len auto, after memory sizing): drop
        buffers sized for more. Backends without such buffers have nothing to do."""

    def workspace_bytes(self) -> int:
        """Bytes of the buffers a forward allocates and this backend keeps for the next ones (the compat prefill
        workspace): memory sizing charges them once, as memory the engine holds (worker/memory.py). 0: none."""
        return 0

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: Optional[torch.Tensor] = None,
        v_scale: Optional[torch.Tensor] = None,
        kv_written: bool = False,
        rope: Optional[DecodeRope] = None,
        window: int = 0,
        query_positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v of this step at meta.slot_mapping (unless kv_written: the model stored them through
        cache_write_for's CacheWrite), then attend q over each request's context. rope (only where
        fuses_decode_rope said so): q and rope.k are unrotated; the decode kernel rotates them and stores K / V.
        window / query_positions: a sliding-window layer's window and, for rows that see past their own position,
        the step's positions (module docstring). Callers pass them only for sliding-window layers."""



def make_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)]
