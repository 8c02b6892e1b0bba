"""Qwen4-Exp QSA: an indexer that picks which blocks of past tokens each query of an indexed-attention layer sees
(transformers' Qwen4ExpTextQSAIndexer), and the sparse attention over them.

  [q_idx | key] = x W_idx                   q_idx: n_idx heads of d_idx; key: one raw key [d_idx] per token (cached)
  q_idx         = rope(q_layernorm(q_idx))   zero-centred RMSNorm, RoPE on the first rotary_dim channels
  block j       = tokens [j r, (j + 1) r)    r = indexer_compress_ratio; complete blocks of positions 0..p only:
                                             n_c(p) = (p + 1) // r
  key_j         = rope(k_layernorm(mean_fp32(raw keys of block j) -> dtype), at position j r)
  score_j       = sum_h relu(q_idx_h . key_j) / sqrt(d_idx)        fp32
  selected(p)   = tokens of the top min(budget // r, n_c) blocks, plus the tail [n_c r, p]
When n_c <= budget // r every token is selected: a context of fewer than budget + r tokens is plain causal attention
(the normal paged path); only rows of longer contexts take the sparse path here.

Raw keys live in the paged KV cache's blocks (so prefix caching, preemption and offloading carry them like K / V):
the model asks the runner for a few more "attention layers" than it has (IndexKeyStore), and packs the indexed
layers' raw keys into those caches' token rows: a cache [2, blocks, block_size, Hkv, D] holds 2 * (Hkv * D //
d_idx) layers' keys per token. In an fp8 KV cache (uint8 elements) the keys keep the model dtype, their bytes in the
cache's: a row then holds half (fp16 / bf16) or a quarter (fp32) as many (Qwen4ExpForCausalLM.set_kv_storage_dtype).

Every row past the budget selects from pooled keys stored per block and attends through virtual block tables into
the paged decode kernel (qwen4_exp_qsa_decode: pure-decode steps CUDA-graph safe, multi-row chunks in eager steps,
Qwen4ExpForCausalLM.eager_step). This module's selection + sparse_attention (a token mask over the request's raw
keys, masked attention in fp32) are their plain-torch reference, used by the tests.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from voltllm.model.layers.rotary import RotaryEmbedding
from voltllm.model.models.qwen4_exp_ple import ZeroCentredRMSNorm

class IndexKeyStore:
    """Where each indexed layer's raw keys and pooled block keys live inside the extra KV caches (after the attention
    layers' own): entries 0..n-1 are the layers' raw keys, n..2n-1 their pooled keys (qwen4_exp_qsa_decode)."""

    def __init__(self, num_attention: int, num_indexed: int, kv_heads: int, head_dim: int, index_dim: int,
                 row_bytes_per_value: int = 1):
        """row_bytes_per_value: the index keys' element size over the cache's (an fp8 cache, one byte per element,
        holds a 2-byte key value in two: half as many keys per row)."""
        per_plane = (kv_heads * head_dim) // row_bytes_per_value // index_dim
        if per_plane < 1:
            fp8 = f" (an fp8 cache's one-byte elements, {row_bytes_per_value} per key value)" if \
                row_bytes_per_value > 1 else ""
            raise ValueError(f"Qwen4-Exp QSA: index keys of {index_dim} channels do not fit a KV cache row of "
                             f"{kv_heads} x {head_dim}{fp8}")
        self.per_plane = per_plane
        self.index_dim = index_dim
        self.num_attention = num_attention
        self.num_indexed = num_indexed
        self.num_caches = -(-2 * num_indexed // (2 * per_plane)) if num_indexed else 0

    def _entry(self, e: int) -> tuple[int, int, int]:
        cache, rest = divmod(e, 2 * self.per_plane)
        plane, slot = divmod(rest, self.per_plane)
        return self.num_attention + cache, plane, slot * self.index_dim

    def place(self, j: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Indexed layer j -> (raw keys, pooled keys), each (KV cache index, plane 0 / 1, channel offset)."""
        return self._entry(j), self._entry(self.num_indexed + j)

    @staticmethod
    def view(kv_cache: torch.Tensor, plane: int, offset: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """[blocks * block_size, dim] rows of one layer's raw (or pooled) keys, in the model dtype: an fp8 cache's
        bytes (uint8) are read as `dtype` values, so the keys are kept exactly, never encoded."""
        two, nb, bs = kv_cache.shape[:3]
        rows = kv_cache.view(two, nb * bs, -1)
        if rows.dtype != dtype:
            rows = rows.view(dtype)
        return rows[plane, :, offset:offset + dim]


def break_ties(scores: torch.Tensor) -> torch.Tensor:
    """Scores [..., blocks] with their ties at 0 made strict, earlier blocks first. relu makes every block whose heads
    all score below zero tie at exactly 0 (common with few indexer heads), and top-k among equal values is up to the
    sort (torch's differs with the vector's length and device: transformers' own choice is not fixed either); both
    of voltllm's paths (prompt rows here, decode rows in qwen4_exp_qsa_decode) select by this one rule. Positive
    scores stay as they are, the zeros become -(j + 1): below every positive score, above -inf."""
    j = torch.arange(1, scores.shape[-1] + 1, device=scores.device, dtype=scores.dtype)
    return torch.where(scores == 0, -j, scores)


def rope_rows(x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    """RoPE (rotate-half) on the first rotary_dim channels of x [T, ..., d] at positions [T]; any device, new tensor."""
    rd = rotary.rotary_dim
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = rotary.cos[positions].view(shape), rotary.sin[positions].view(shape)
    xr = x[..., :rd].float()
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., rd:]), dim=-1)


class QSAIndexer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype):
        super().__init__()
        self.n_heads = cfg.indexer_n_heads
        self.dim = cfg.indexer_head_dim
        self.ratio = cfg.indexer_compress_ratio
        self.budget = cfg.indexer_budget
        self.top_blocks = self.budget // self.ratio
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.n_heads + 1) * self.dim, bias=False, dtype=dtype)
        self.q_layernorm = ZeroCentredRMSNorm(self.dim, cfg.rms_norm_eps)
        self.k_layernorm = ZeroCentredRMSNorm(self.dim, cfg.rms_norm_eps)

    @property
    def full_context(self) -> int:
        """Contexts shorter than this are plain causal attention (every block selected)."""
        return self.budget + self.ratio

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (unnormed queries [T, n_idx, d_idx], raw keys [T, d_idx])."""
        q, k = self.index_qk_proj(x).split([self.n_heads * self.dim, self.dim], dim=-1)
        return q.view(-1, self.n_heads, self.dim), k

    def selection(self, q_idx: torch.Tensor, positions: torch.Tensor, raw_keys: torch.Tensor,
                  rotary: RotaryEmbedding) -> torch.Tensor:
        """q_idx [n, n_idx, d] of query rows at positions [n] (unnormed); raw_keys [L, d]: the request's keys at
        positions 0..L-1 (L > every position) -> bool mask [n, L] of the tokens each row attends to."""
        n, length = q_idx.shape[0], raw_keys.shape[0]
        r = self.ratio
        dev = raw_keys.device
        q = rope_rows(self.q_layernorm(q_idx), positions, rotary)
        nc_max = length // r
        pos = positions.long()
        tail_start = (pos + 1) // r * r
        t = torch.arange(length, device=dev)
        mask = (t[None, :] >= tail_start[:, None]) & (t[None, :] <= pos[:, None])
        if nc_max == 0:
            return mask
        pooled = raw_keys[:nc_max * r].view(nc_max, r, self.dim).float().mean(1).to(raw_keys.dtype)
        keys = rope_rows(self.k_layernorm(pooled), torch.arange(nc_max, device=dev) * r, rotary)
        scores = break_ties(torch.relu(torch.einsum("nhd,cd->nhc", q.float(), keys.float())).sum(1)
                            / math.sqrt(self.dim))
        complete = (pos + 1) // r  # n_c per row
        scores = scores.masked_fill(torch.arange(nc_max, device=dev)[None, :] >= complete[:, None], float("-inf"))
        top = scores.topk(min(self.top_blocks, nc_max), dim=-1).indices  # [n, k]
        chosen = torch.zeros(n, nc_max, dtype=torch.bool, device=dev)
        chosen.scatter_(1, top, True)
        chosen &= torch.arange(nc_max, device=dev)[None, :] < complete[:, None]  # (-inf picks: incomplete blocks)
        block_tokens = chosen.repeat_interleave(r, dim=1)
        mask[:, :nc_max * r] |= block_tokens
        return mask


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [n, Hq, D] (rotated), k / v [L, Hkv, D] (the request's cached K / V), mask [n, L] -> [n, Hq, D]; fp32."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, vf).to(q.dtype)
