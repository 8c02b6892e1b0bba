"""Skinny GEMM (decode: a few rows of activations times a big fp16/bf16 weight), memory-bound.

y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M <= 4. Each program owns BLOCK_N output features and streams
their weight rows once (contiguous along K), multiplying by all M activation rows held in registers,
fp32 accumulation. No tensor cores are needed (the work is bandwidth, not FLOPs), so the same kernel
serves the compat route (sm_70/75). Whether it beats cuBLAS for a given shape is measured at start-up
(voltllm.model.layers.linear), not assumed.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel

MAX_ROWS = 4


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _specs() -> list[CompileSpec]:
    sig = {"X": "*fp16", "W": "*fp16", "B": "*fp16", "Y": "*fp16", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "BLOCK_M": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "HAS_BIAS": "constexpr"}
    return [CompileSpec(sig, {"BLOCK_M": m, "BLOCK_N": 16, "BLOCK_K": 256, "HAS_BIAS": b}, f"fp16 m{m} bias={b}")
            for m, b in ((1, False), (4, True))]


register_kernel("gemv.skinny", _gemv_kernel, _specs())


# (BLOCK_N, BLOCK_K, num_warps) candidates; start-up tuning times them per weight shape
CONFIGS: tuple[tuple[int, int, int], ...] = ((8, 512, 4), (16, 1024, 8), (4, 2048, 8), (32, 512, 8),
                                             (16, 512, 4), (8, 1024, 4), (2, 2048, 4))
DEFAULT_CONFIG = CONFIGS[0]


def gemv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
         out: Optional[torch.Tensor] = None, config: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """x [M, K] (M <= 4, last dim contiguous), w [N, K] contiguous -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k or w.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} / w {tuple(w.shape)} not supported")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or DEFAULT_CONFIG
    block_m = triton.next_power_of_2(m)
    block_k = max(16, min(block_k // block_m, triton.next_power_of_2(k)))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=warps)
    return out


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
