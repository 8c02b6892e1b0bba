"""What every attention layer over the paged KV cache shares: its cache index, its fp8 KV scales, and the step
RoPE -> K/V into the cache -> attention, whichever projections and norms surround it.

The K/V store goes into the RoPE launch when the backend offers a CacheWrite (caches on CUDA; fp8 pages encoded
there), and into the backend's own write otherwise (voltllm.attention.backend).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from voltllm.attention.backend import DecodeRope
from voltllm.attention.kv_spec import center_keys, maybe_calc_kv_scales, new_kv_scale
from voltllm.model.forward_context import ForwardContext
from voltllm.model.layers.norm import RMSNorm
from voltllm.model.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    def __init__(self, kv_index: int, head_dim: int, rotary: RotaryEmbedding, sliding_window: int = 0):
        super().__init__()
        self.kv_index = kv_index
        # a sliding-window layer's window (0: full attention; voltllm.attention.backend); window_by_position: its rows
        # may see past their own position (the DFlash drafter's block rows), so the window follows their positions
        self.sliding_window = int(sliding_window or 0)
        self.window_by_position = False
        self.head_dim = head_dim
        self.rotary = rotary
        self.scale = head_dim ** -0.5
        self.register_buffer("k_scale", new_kv_scale())  # fp8 KV cache scales (voltllm/attention/kv_spec.py)
        self.register_buffer("v_scale", new_kv_scale())
        self.checkpoint_kv_scales: set[str] = set()  # buffers the checkpoint set (--calculate-kv-scales keeps them)
        self.register_buffer("k_offset", None, persistent=False)  # --calculate-key-offsets (kv_spec.py)

    def rope_and_attend(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        ctx: ForwardContext, q_norm: Optional[RMSNorm] = None,
                        k_norm: Optional[RMSNorm] = None) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hkv, D] (QK-norm first when q_norm / k_norm are given) -> attention
        output [T, Hq, D]."""
        cache = ctx.kv_caches[self.kv_index]
        meta = self._meta(ctx)
        window = self._window_args(positions)
        rope = self._decode_rope(positions, q, k, v, cache, ctx, meta, q_norm, k_norm)
        if rope is not None:  # the decode kernel applies QK-norm + RoPE and stores K / V itself
            return ctx.backend.forward(q, k, v, cache, meta, self.scale, k_scale=self.k_scale,
                                       v_scale=self.v_scale, rope=rope, **window)
        # centered keys must reach the cache, so with key offsets the backend writes them (after center_keys); an
        # fp8 scale still to be calculated from this forward's K / V must exist before anything is encoded
        write = None if self.k_offset is not None or ctx.calc_kv_scales else ctx.backend.cache_write_for(
            v, cache, meta, self.k_scale, self.v_scale)
        if q_norm is not None:
            q, k = self.rotary.norm_and_rotate(positions, q, k, q_norm, k_norm, cache_write=write)
        else:
            q, k = self.rotary(positions, q, k, cache_write=write)
        k = center_keys(self, k, ctx)
        maybe_calc_kv_scales(self, k, v, ctx)
        return ctx.backend.forward(q, k, v, cache, meta, self.scale, k_scale=self.k_scale, v_scale=self.v_scale,
                                   kv_written=write is not None, **window)

    def _meta(self, ctx: ForwardContext):
        """The step's attention metadata for this layer: a sliding-window layer whose cache is addressed apart from the
        step's blocks (a DFlash drafter's per-request rings, worker/drafter_rings.py) takes ctx.extra["window_meta"]."""
        if self.sliding_window:
            meta = ctx.extra.get("window_meta")
            if meta is not None:
                return meta
        return ctx.meta

    def _window_args(self, positions: torch.Tensor) -> dict:
        """The backend's sliding-window arguments of this layer (none for a full-attention layer)."""
        if not self.sliding_window:
            return {}
        return {"window": self.sliding_window, "query_positions": positions if self.window_by_position else None}

    def _decode_rope(self, positions, q, k, v, cache, ctx: ForwardContext, meta, q_norm: Optional[RMSNorm],
                     k_norm: Optional[RMSNorm]) -> Optional[DecodeRope]:
        """A DecodeRope when the backend fuses this step's norm, RoPE and KV store into its decode kernel
        (not while --calculate-kv-scales still needs the rotated K of a first forward, nor with key offsets)."""
        if (ctx.calc_kv_scales or self.k_offset is not None
                or not ctx.backend.fuses_decode_rope(q, cache, meta, self.rotary.rotary_dim)):
            return None
        if q_norm is None:
            return DecodeRope(k, v, positions, self.rotary.cos, self.rotary.sin, None, None)
        if k_norm is None or q_norm.offset != k_norm.offset or q_norm.eps != k_norm.eps:
            return None
        return DecodeRope(k, v, positions, self.rotary.cos, self.rotary.sin, q_norm.weight, k_norm.weight,
                          q_norm.eps, q_norm.offset)
