"""Scatter one step's K and V rows into the paged KV cache (one launch writes both).

Cache layout: (2, num_blocks, block_size, num_kv_heads, head_dim); flat slot = block * block_size + offset.
A slot of -1 means "skip this row" (padding rows of a CUDA-graph batch).
Reference: voltllm.attention.torch_ref.write_kv.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel


@triton.jit
def _kv_write_kernel(
    K, V, KV, SlotMapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
):
    tok = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(SlotMapping + tok).to(tl.int64)
    blk = slot // PAGE
    off = slot % PAGE
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    tok64 = tok.to(tl.int64)
    k = tl.load(K + tok64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + tok64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = KV + blk * stride_c_blk + off * stride_c_slot + h[:, None] * stride_c_head + d[None, :]
    tl.store(dst, k.to(KV.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(KV.dtype.element_ty), mask=mask)


def _specs() -> list[CompileSpec]:
    specs = []
    for d in (64, 128, 256):
        sig = {"K": "*fp16", "V": "*fp16", "KV": "*fp16", "SlotMapping": "*i64",
               "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32",
               "stride_c_kv": "i64", "stride_c_blk": "i32", "stride_c_slot": "i32", "stride_c_head": "i32",
               "num_kv_heads": "i32",
               "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr", "BLOCK_H": "constexpr", "PAGE": "constexpr"}
        specs.append(CompileSpec(signature=sig, constexprs={"HEAD_DIM": d, "BLOCK_D": d, "BLOCK_H": 8,
                                                            "PAGE": 16}, label=f"fp16 d{d} page16"))
    return specs


register_kernel("attention.kv_write", _kv_write_kernel, _specs(), compat=True)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim] (last dim contiguous); slot_mapping: int64 [>= T], -1 = skip."""
    t, h, d = k.shape
    if t == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    assert kv_cache.stride(4) == 1 and kv_cache.shape[3] == h and kv_cache.shape[4] == d
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(h), 4096 // block_d))
    grid = (t, triton.cdiv(h, block_h))
    _kv_write_kernel[grid](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        h,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h, PAGE=kv_cache.shape[2],
        num_warps=4 if block_h * block_d >= 2048 else 2,
    )
