"""Reference attention backend in plain PyTorch: runs anywhere (CPU tests), one request at a time.

FP8 caches (uint8, `kv_cache_dtype` fp8 / fp8_e4m3 / fp8_e5m2) go through the software codec's torch
reference: stored = encode(x / scale), read = decode(code) * scale in fp32, then attention in fp32
("dequantize, then attend": the reference the Triton kernels are checked against)."""
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


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
               window_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of q [Lq, Hq, D] as the last Lq positions of k/v [Lk, Hkv, D]. window > 0: row j sees only
    keys from window_pos[j] - window + 1 on (window_pos: int [Lq], the rows' positions; None: their places in the
    context), as a sliding-window layer (voltllm.attention.backend)."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    qf = q.transpose(0, 1).float()
    kf = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
    vf = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
    mask = None  # one query row (decode) sees every key: no mask. Same result, and torch's masked CPU path
    if lq > 1 or window > 0:  # is ~1000x slower with several threads (OpenMP sync on tiny work)
        keys = torch.arange(lk, device=q.device)[None, :]
        q_pos = torch.arange(lk - lq, lk, device=q.device)
    if lq > 1:
        mask = keys <= q_pos[:, None]
    if window > 0:
        first = (q_pos if window_pos is None else window_pos.to(q.device)) - window + 1
        seen = keys >= first[:, None]
        mask = seen if mask is None else mask & seen
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


class TorchReferenceBackend(AttentionBackend):
    name = "TORCH_REF"

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        """kv_cache_dtype: the --kv-cache-dtype value; it names the fp8 format of a uint8 cache."""
        from voltllm.attention.kv_spec import FP8_KV_DTYPES

        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_format = FP8_KV_DTYPES.get((kv_cache_dtype or "auto").lower())

    def _is_fp8(self, kv_cache: torch.Tensor) -> bool:
        if kv_cache.dtype != torch.uint8:
            return False
        if self.fp8_format is None:
            raise ValueError(f"{self.name}: a uint8 (fp8) KV cache needs kv_cache_dtype fp8_e4m3 or fp8_e5m2, "
                             f"got {self.kv_cache_dtype!r}")
        return True

    def write_kv(self, k, v, kv_cache, meta: AttentionMetadata, k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None) -> None:
        """Store K / V rows at meta.slot_mapping (slot -1: skipped; fp8 caches: encoded with the scales)."""
        if self._is_fp8(kv_cache):
            from voltllm.kernels.kv_fp8 import write_kv_fp8_ref

            n = min(k.shape[0], meta.slot_mapping.shape[0])
            write_kv_fp8_ref(k[:n], v[:n], kv_cache, meta.slot_mapping, k_scale, v_scale, self.fp8_format)
        else:
            write_kv(k, v, kv_cache, meta.slot_mapping)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                kv_written: bool = False, window: int = 0, query_positions: Optional[torch.Tensor] = None):
        fp8 = self._is_fp8(kv_cache)
        if fp8:
            from voltllm.kernels.kv_fp8 import gather_kv_fp8_ref
        if not kv_written:
            self.write_kv(k, v, kv_cache, meta, k_scale, v_scale)
        out = torch.empty_like(q)
        qsl = meta.query_start_loc_cpu
        for i, ctx in enumerate(meta.seq_lens_cpu):
            s, e = qsl[i], qsl[i + 1]
            if e == s:
                continue
            win = {} if window <= 0 else {"window": window, "window_pos": None if query_positions is None
                                          else query_positions[s:e]}
            if fp8:
                kc, vc = gather_kv_fp8_ref(kv_cache, meta.block_tables[i], ctx, k_scale, v_scale, self.fp8_format,
                                           dtype=torch.float32)
                out[s:e] = attend_one(q[s:e], kc, vc, scale, **win)
                continue
            kc, vc = gather_kv(kv_cache, meta.block_tables[i], ctx)
            out[s:e] = attend_one(q[s:e], kc.to(q.dtype), vc.to(q.dtype), scale, **win)
        if meta.num_tokens < q.shape[0]:
            out[meta.num_tokens:] = 0
        return out
