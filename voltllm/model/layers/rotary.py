"""Rotary position embedding (rotate-half layout), any rope type transformers knows, partial rotary."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_parameters(config: Any) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", "default")
    return params


def inv_freq_for(config: Any, rotary_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {params['rope_type']!r} is not supported")
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")


class RotaryEmbedding(nn.Module):
    def __init__(self, config: Any, head_dim: int, max_positions: int, rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, scale = inv_freq_for(config, self.rotary_dim)
        self.inv_freq, self.scale = inv_freq.float(), float(scale)  # (image M-RoPE rows are computed from them)
        t = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(t, inv_freq.float())
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)  # [max_pos, rotary_dim / 2]
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def reserve_rows(self, n: int) -> int:
        """Append n scratch rows to the cos / sin tables (before any CUDA graph captures them); returns the first's
        index. A step's tokens whose rotation is no position's (an image token's M-RoPE, multimodal/mrope.py) get
        their rows written there and these indices as positions, so the kernels need no other input."""
        base = self.cos.shape[0]
        pad = self.cos.new_zeros(n, self.cos.shape[1])
        self.cos, self.sin = torch.cat((self.cos, pad)), torch.cat((self.sin, pad))
        return base

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache_write=None):
        """q [T, Hq, D], k [T, Hk, D] -> rotated (first rotary_dim channels), same dtype.

        On CUDA q and k are rotated in place (one fused launch). cache_write (an attention backend's
        CacheWrite): the rotated K and the V rows are also stored in the paged KV cache."""
        if q.is_cuda:
            from voltllm.kernels import fused

            return fused.rope_inplace(q, k, positions, self.cos, self.sin, self.rotary_dim, cache_write)
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        if cache_write is not None:
            n = min(k.shape[0], cache_write.slot_mapping.shape[0])
            if cache_write.fmt >= 0:  # fp8 codes of x / scale (the codec's reference write)
                from voltllm.kernels.kv_fp8 import write_kv_fp8_ref

                write_kv_fp8_ref(k[:n], cache_write.v[:n], cache_write.kv_cache, cache_write.slot_mapping[:n],
                                 cache_write.k_scale, cache_write.v_scale, cache_write.fmt)
            else:
                from voltllm.attention.torch_ref import write_kv

                write_kv(k[:n], cache_write.v[:n], cache_write.kv_cache, cache_write.slot_mapping[:n])
        return q, k

    def norm_and_rotate(self, positions, q, k, q_norm, k_norm, cache_write=None):
        """Per-head RMSNorm of q and k (Qwen3 QK-norm) then RoPE (and the cache store, as forward); fused and
        in place on CUDA."""
        if q.is_cuda and q_norm.offset == k_norm.offset:
            from voltllm.kernels import fused

            return fused.qk_norm_rope_inplace(q, k, q_norm.weight, k_norm.weight, q_norm.eps, positions,
                                              self.cos, self.sin, self.rotary_dim, q_norm.offset, cache_write)
        return self.forward(positions, q_norm(q), k_norm(k), cache_write)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        xr = x[..., :rd].float()
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if rd == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., rd:]), dim=-1)
