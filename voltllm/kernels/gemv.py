"""Skinny GEMM (decode: a few rows of activations times a big fp16/bf16 weight), memory-bound.

y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M <= 4. Each program owns BLOCK_N output features and streams
their weight rows once (contiguous along K, evict-first: a weight is read once per step), multiplying by
all M activation rows. The products go into an fp32 accumulator of the tile's full shape and are summed
over K once at the end: a reduction per K step (shuffles) cost the earlier version half its bandwidth.
No tensor cores are needed (the work is bandwidth, not FLOPs), so the same kernel serves the compat
route (sm_70/75).

`silu_mul=True` takes x = [gate | up] (M, 2K) and multiplies by silu(gate) * up, computed on the fly in
fp32: the MLP's down projection then needs no separate activation kernel at batch-1 decode.
`gated=True` is the other side of the same seam: w = [gate; up] (2N, K) and the output is silu(x gate^T) *
(x up^T) [M, N]; each program owns N-features of both halves, so the activation is an epilogue computed once
per output (the prologue form recomputes it in every program of the down projection).

Whether it beats cuBLAS for a given shape, and with which tile, is measured at start-up
(voltllm.worker.skinny_tuning), not assumed. On the H200 (cold L2) it streams 3.4-4.6 TB/s where cuBLAS
streams 2.6-4.4 TB/s at one row (docs/kernels.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.pdl import pdl_enter, prefetch_rows_l2
from voltllm.kernels.registry import CompileSpec, register_kernel

MAX_ROWS = 4


@triton.jit
def _load_x(X, offs_m, offs_k, stride_xm, K, mask, SILU_MUL: tl.constexpr):
    """Activation rows [BLOCK_M, BLOCK_K] in fp32; silu(gate) * up when X holds [gate | up]."""
    ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = tl.load(ptr + K, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    return x


@triton.jit
def _gemv_kernel(X, W, B, Y, NW, M, N, K, stride_xm, stride_wn, stride_ym, eps, norm_offset,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, ACCUMULATE: tl.constexpr,
                 GATED: tl.constexpr, PDL: tl.constexpr, PREFETCH_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH_K > 0:  # the weight does not depend on the previous kernel: start it towards L2 before waiting
        prefetch_rows_l2(W, offs_n, N, stride_wn, K, PREFETCH_K)
        if GATED:
            prefetch_rows_l2(W + N * stride_wn, offs_n, N, stride_wn, K, PREFETCH_K)
    pdl_enter(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_ptr = W + offs_n[:, None] * stride_wn
    u_ptr = w_ptr + N * stride_wn  # GATED: the up rows, N below the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K) if GATED else (1, 1, 1), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight stream
            w = tl.load(w_ptr + offs_k[None, :], eviction_policy="evict_first")
            if GATED:
                wu = tl.load(u_ptr + offs_k[None, :], eviction_policy="evict_first")
            x = _load_x(X, offs_m, offs_k, stride_xm, K, mask_m[:, None], SILU_MUL)
            if NORM:
                nw = tl.load(NW + offs_k).to(tl.float32) + norm_offset
        else:
            mask_k = offs_k < K
            w = tl.load(w_ptr + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            if GATED:
                wu = tl.load(u_ptr + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                             eviction_policy="evict_first")
            x = _load_x(X, offs_m, offs_k, stride_xm, K, mask_m[:, None] & mask_k[None, :], SILU_MUL)
            if NORM:
                nw = tl.load(NW + offs_k, mask=mask_k, other=0.0).to(tl.float32) + norm_offset
        if NORM:  # x is the residual stream: sum its squares on the way, scale by the norm weight
            sq += x * x
            x = x * nw[None, :]
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        if GATED:
            acc_u += x[:, None, :] * wu.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    if NORM:  # rms_norm(x) @ w^T = (x * nw) @ w^T / rms(x): the scalar factor comes out of the sum
        y = y * tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:  # silu(gate) * up, in fp32 (not rounded in between)
        yu = tl.sum(acc_u, axis=2)
        if NORM:
            yu = yu * tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
        if HAS_BIAS:
            yu += tl.load(B + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y = y / (1.0 + tl.exp(-y)) * yu
    y_ptr = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask_y = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:  # Y += x w^T (the residual add): each program owns its features, so in place is race-free
        y += tl.load(y_ptr, mask=mask_y, other=0.0).to(tl.float32)
    tl.store(y_ptr, y.to(Y.dtype.element_ty), mask=mask_y)


def _specs() -> list[CompileSpec]:
    def sig(x, y):
        return {"X": x, "W": "*fp16", "B": "*fp16", "Y": y, "NW": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "eps": "fp32", "norm_offset": "fp32",
                "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "HAS_BIAS": "constexpr",
                "EVEN": "constexpr", "SILU_MUL": "constexpr", "NORM": "constexpr", "ACCUMULATE": "constexpr",
                "GATED": "constexpr", "PDL": "constexpr", "PREFETCH_K": "constexpr"}

    # the plain and silu*mul GEMVs (fp16 in and out); the decode layer's fused forms: RMSNorm of the fp32
    # residual in the prologue, and the residual add (into fp32) in the epilogue; the gated (silu epilogue) form
    return [CompileSpec(sig("*fp32" if nm else "*fp16", "*fp32" if acc else "*fp16"),
                        {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "HAS_BIAS": b, "EVEN": e, "SILU_MUL": s,
                         "NORM": nm, "ACCUMULATE": acc, "GATED": g, "PDL": False, "PREFETCH_K": 0},
                        f"fp16 m{m} n{n} k{k} bias={b} even={e} silu_mul={s} norm={nm} accumulate={acc} gated={g}")
            for m, n, k, b, e, s, nm, acc, g in (
                (1, 4, 1024, False, True, False, False, False, False),
                (1, 1, 512, False, True, True, False, False, False),
                (4, 2, 512, True, False, False, False, False, False),
                (2, 8, 256, False, False, True, False, False, False),
                (1, 4, 1024, False, True, False, True, False, False),
                (1, 4, 512, True, False, False, True, False, False),
                (1, 4, 1024, False, True, True, False, True, False),
                (1, 2, 512, False, False, False, False, True, False),
                (1, 4, 1024, False, True, False, False, False, True),
                (2, 2, 512, True, False, False, True, False, True))]


register_kernel("gemv.skinny", _gemv_kernel, _specs())


# (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates, from a cold-L2 sweep on the H200 at 8B and 135M
# decode shapes; start-up tuning times them per weight shape
CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (4, 1024, 4, 1), (1, 1024, 2, 1), (4, 512, 2, 3), (8, 256, 4, 1), (2, 512, 2, 1), (1, 512, 4, 1),
    (2, 512, 2, 3), (4, 256, 2, 3), (1, 1024, 8, 1))
DEFAULT_CONFIG = CONFIGS[0]


def gemv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
         out: Optional[torch.Tensor] = None, config: Optional[tuple[int, ...]] = None,
         silu_mul: bool = False, prefetch_k: Optional[int] = None,
         norm: Optional[tuple[torch.Tensor, float, float]] = None, accumulate: bool = False,
         gated: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 4, last dim contiguous), w [N, K] contiguous -> [M, N] in x's dtype (w's with `norm`).
    With silu_mul, x is [M, 2K] = [gate | up] and the product uses silu(gate) * up. With norm = (weight, eps,
    offset) the product uses RMSNorm(x) (x / rms(x) * (weight + offset), fp32 math, not rounded in between).
    With accumulate, out (required) gets out + x w^T in place. With gated, w is [2N, K] = [gate; up] (bias
    [2N]) and the result [M, N] is silu(x gate^T) * (x up^T). `prefetch_k` overrides pdl.prefetch_elements
    (experiments)."""
    m, kx = x.shape
    k = kx // 2 if silu_mul else kx
    n = w.shape[0] // 2 if gated else w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k or kx != (2 * k if silu_mul else k) or w.stride(1) != 1 or x.stride(1) != 1 \
            or (norm is not None and (silu_mul or norm[0].numel() != k or norm[0].stride(-1) != 1)) \
            or (gated and (w.shape[0] % 2 or silu_mul or accumulate)):
        raise ValueError(f"gemv: x {tuple(x.shape)} / w {tuple(w.shape)} (silu_mul={silu_mul}, "
                         f"norm={norm is not None}, gated={gated}, accumulate={accumulate}) not supported")
    if accumulate and (out is None or tuple(out.shape) != (m, n) or out.stride(1) != 1):
        raise ValueError(f"gemv: accumulate needs an [{m}, {n}] out with a contiguous last dim")
    if out is None:
        out = torch.empty(m, n, dtype=w.dtype if norm is not None else x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or DEFAULT_CONFIG
    block_m = triton.next_power_of_2(m)
    block_k = max(16, min(block_k // block_m, triton.next_power_of_2(k)))
    even = n % block_n == 0 and k % block_k == 0
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else w, out, norm[0] if norm is not None else w, m, n, k, x.stride(0),
        w.stride(0), out.stride(0), float(norm[1]) if norm else 0.0, float(norm[2]) if norm else 0.0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN=even,
        SILU_MUL=silu_mul, NORM=norm is not None, ACCUMULATE=accumulate, GATED=gated, num_warps=warps,
        num_stages=stages, **pdl.gemm_launch_options(
            pdl.prefetch_elements(w.shape[0], k, w.element_size()) if prefetch_k is None else prefetch_k))
    return out


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
             silu_mul: bool = False, norm: Optional[tuple[torch.Tensor, float, float]] = None,
             gated: bool = False) -> torch.Tensor:
    """fp32 reference of gemv (accumulate: add the result to out yourself); output in w's dtype with norm."""
    xf = x.float()
    if norm is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm[1]) * (norm[0].float() + norm[2])
    if silu_mul:
        g, u = xf.chunk(2, dim=-1)
        xf = torch.nn.functional.silu(g) * u
    y = xf @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    if gated:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    return y.to(w.dtype if norm is not None else x.dtype)
