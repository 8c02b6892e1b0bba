"""Triton attention backend over the paged KV cache (see voltllm.attention.backend for the contract).

forward() = kv_write (one launch for K and V) -> paged decode (pure-decode steps, split-KV when the grid
would not fill the GPU) or paged prefill (everything else: chunked prefill, prefix hits, mixed batches).

No host syncs: grids come from host ints (q.shape, len(seq_lens), meta.max_query_len, meta.max_seq_len).
Decode is CUDA-graph capturable: for a fixed batch size and a fixed meta.max_seq_len bound the grid is
fixed, and each program sizes its split-KV slice from the actual seq_len on the device, so shorter
contexts only leave trailing partitions empty (they contribute weight 0 to the reduction).
Per call it allocates only the output; the split-KV scratch is kept and grown on demand (call
`reserve()` before CUDA-graph capture so that capture never has to grow it).
"""
from __future__ import annotations

from typing import Optional

import torch

from voltllm.attention.backend import AttentionBackend, AttentionMetadata
from voltllm.kernels.attention import (choose_num_splits, decode_scratch_numel, kv_write, paged_decode,
                                       paged_prefill)
from voltllm.kernels.attention.paged_decode import FMA_LANES_DEFAULT

_SUPPORTED_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"

    def __init__(self, use_tensor_cores: Optional[bool] = None, num_sms: Optional[int] = None,
                 max_splits: Optional[int] = None, fma_lanes: Optional[bool] = None) -> None:
        """use_tensor_cores: decode inner products with tl.dot (None: yes on sm_80+, no on sm_70/75 and
        on the CPU interpreter; False forces the FMA route, as `--compat sm70` does on any GPU).
        num_sms: SM count for the split-KV heuristic (None: read from the device).
        max_splits: cap on split-KV partitions (None: the kernel module's default).
        fma_lanes: FMA-route decode variant (None: FMA_LANES_DEFAULT; see paged_decode.py)."""
        self.use_tensor_cores = use_tensor_cores
        self.num_sms = num_sms
        self.max_splits = max_splits
        self.fma_lanes = FMA_LANES_DEFAULT if fma_lanes is None else fma_lanes
        self._dev_info: dict[str, tuple[Optional[tuple[int, int]], int]] = {}
        self._scratch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # --- device facts and scratch -------------------------------------------------------------
    def _device_info(self, device: torch.device) -> tuple[Optional[tuple[int, int]], int]:
        key = str(device)
        info = self._dev_info.get(key)
        if info is None:
            if device.type == "cuda":
                props = torch.cuda.get_device_properties(device)
                info = ((props.major, props.minor), props.multi_processor_count)
            else:
                info = (None, 1)
            self._dev_info[key] = info
        return info

    def _get_scratch(self, device: torch.device, numel_o: int, numel_l: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        cur = self._scratch.get(key)
        if cur is None or cur[0].numel() < numel_o or cur[1].numel() < numel_l:
            old_o = cur[0].numel() if cur else 0
            old_l = cur[1].numel() if cur else 0
            cur = (torch.empty(max(numel_o, old_o), dtype=torch.float32, device=device),
                   torch.empty(max(numel_l, old_l), dtype=torch.float32, device=device))
            self._scratch[key] = cur
        return cur

    def num_splits_for(self, num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
        _, sms = self._device_info(device)
        splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, self.num_sms or sms)
        if self.max_splits is not None:
            splits = max(1, min(splits, self.max_splits))
        return splits

    def reserve(self, max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                device: torch.device) -> None:
        """Allocate split-KV scratch for every decode batch size up to max_num_seqs (before graph capture)."""
        need_o = need_l = 0
        for b in range(1, max_num_seqs + 1):
            splits = self.num_splits_for(b, num_kv_heads, max_seq_len, device)
            if splits > 1:
                o, l = decode_scratch_numel(b, num_heads, splits, head_dim)
                need_o, need_l = max(need_o, o), max(need_l, l)
        if need_o:
            self._get_scratch(device, need_o, need_l)

    def _use_dot(self, device: torch.device) -> bool:
        if self.use_tensor_cores is not None:
            return self.use_tensor_cores
        cap, _ = self._device_info(device)
        return cap is not None and cap >= (8, 0)

    # --- forward ---------------------------------------------------------------------------------
    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None):
        if kv_cache.dtype not in _SUPPORTED_CACHE_DTYPES:
            raise NotImplementedError(f"{self.name}: KV cache dtype {kv_cache.dtype} is not supported "
                                      f"(quantized caches go through a KV codec backend)")
        t = q.shape[0]
        n_write = min(k.shape[0], meta.slot_mapping.shape[0])
        kv_write(k[:n_write], v[:n_write], kv_cache, meta.slot_mapping)

        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_seqs = meta.seq_lens.shape[0]
        if num_seqs > 0 and meta.is_pure_decode:
            num_kv_heads = kv_cache.shape[3]
            splits = self.num_splits_for(num_seqs, num_kv_heads, meta.max_seq_len, q.device)
            part_o = part_lse = None
            if splits > 1:
                need_o, need_l = decode_scratch_numel(num_seqs, q.shape[1], splits, q.shape[2])
                part_o, part_lse = self._get_scratch(q.device, need_o, need_l)
            use_dot = self._use_dot(q.device)
            paged_decode(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, out,
                         num_splits=splits, part_o=part_o, part_lse=part_lse, use_dot=use_dot,
                         fma_lanes=self.fma_lanes and not use_dot)
        elif num_seqs > 0:
            cap, _ = self._device_info(q.device)
            paged_prefill(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, out,
                          max_query_len=meta.max_query_len, capability=cap)
        if meta.num_tokens < t:
            out[meta.num_tokens:].zero_()
        return out
