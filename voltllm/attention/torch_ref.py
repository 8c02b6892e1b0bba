"""Reference attention backend in plain PyTorch: runs anywhere (CPU tests), one request at a time."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from voltllm.attention.backend import AttentionBackend, AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their cache slots (slot -1: skipped)."""
    _, num_blocks, block_size, h, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, h, d)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0, slots] = k[valid].to(kv_cache.dtype)
    flat[1, slots] = v[valid].to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first ctx_len tokens, [ctx_len, H, D] each."""
    block_size = kv_cache.shape[2]
    nblocks = (ctx_len + block_size - 1) // block_size
    blocks = block_table[:nblocks].long()
    kv = kv_cache[:, blocks]  # (2, nblocks, bs, H, D)
    kv = kv.reshape(2, nblocks * block_size, *kv.shape[3:])[:, :ctx_len]
    return kv[0], kv[1]


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [Lq, Hq, D] as the last Lq positions of k/v [Lk, Hkv, D]."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    qf = q.transpose(0, 1).float()
    kf = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
    vf = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
    q_pos = torch.arange(lk - lq, lk, device=q.device)
    mask = torch.arange(lk, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


class TorchReferenceBackend(AttentionBackend):
    name = "TORCH_REF"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None):
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        qsl = meta.query_start_loc_cpu
        for i, ctx in enumerate(meta.seq_lens_cpu):
            s, e = qsl[i], qsl[i + 1]
            if e == s:
                continue
            kc, vc = gather_kv(kv_cache, meta.block_tables[i], ctx)
            out[s:e] = attend_one(q[s:e], kc.to(q.dtype), vc.to(q.dtype), scale)
        if meta.num_tokens < q.shape[0]:
            out[meta.num_tokens:] = 0
        return out
