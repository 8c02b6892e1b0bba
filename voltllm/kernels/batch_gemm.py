"""Decode-batch GEMM: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for 16 <= M <= 64 rows, with tl.dot.

At 64 concurrent requests a decode step's projections are still memory-bound (64 rows against a 4096-wide
weight), and cuBLAS streams the smaller 8B projections at only 2.9-3.0 TB/s on the H200 (qkv 6144x4096,
o_proj 4096x4096; benchmarks/results/perf-8b-c64-2072111.profile.json), its split-K down projection at 3.2
with a separate reduce kernel. Here each program owns BLOCK_N output features for all M rows (padded to
BLOCK_M), streams its weight rows once (evict-first, pipelined over K) and multiplies on tensor cores.

`silu_mul=True` takes x = [gate | up] (M, 2K) and multiplies by silu(gate) * up, computed in the prologue in
fp32 and rounded once to x's dtype for the dot (the unfused silu_and_mul also rounds silu(gate) before the
multiply: a last-place difference), so the MLP needs no activation kernel.

Whether it beats cuBLAS for a shape and row count, and with which tile, is measured at start-up
(voltllm.worker.skinny_tuning), not assumed: on sm_70/75 tl.dot runs on CUDA cores and cuBLAS wins.
Reference: batch_gemm_ref (fp32 math).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.pdl import pdl_enter
from voltllm.kernels.registry import CompileSpec, register_kernel

MIN_ROWS, MAX_ROWS = 16, 64


@triton.jit
def _batch_gemm_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptr = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptr = W + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # K % BLOCK_K == 0: only the row / feature masks
            mx = mask_m[:, None]
            mw = mask_n[:, None]
        else:
            mk = (k0 + offs_k) < K
            mx = mask_m[:, None] & mk[None, :]
            mw = mask_n[:, None] & mk[None, :]
        w = tl.load(w_ptr, mask=mw, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr, mask=mx, other=0.0)
        if SILU_MUL:
            up = tl.load(x_ptr + K, mask=mx, other=0.0).to(tl.float32)
            g = x.to(tl.float32)
            x = (g / (1.0 + tl.exp(-g)) * up).to(W.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _specs() -> list[CompileSpec]:
    sig = {"X": "*fp16", "W": "*fp16", "B": "*fp16", "Y": "*fp16", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "BLOCK_M": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "HAS_BIAS": "constexpr", "EVEN_K": "constexpr",
           "SILU_MUL": "constexpr", "PDL": "constexpr"}
    return [CompileSpec(sig, {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "HAS_BIAS": b, "EVEN_K": e,
                              "SILU_MUL": s, "PDL": False}, f"fp16 m{m} n{n} k{k} bias={b} even={e} silu_mul={s}")
            for m, n, k, b, e, s in ((64, 32, 128, False, True, False), (32, 64, 64, True, False, True))]


register_kernel("gemm.decode_batch", _batch_gemm_kernel, _specs(), compat=False)  # native route only (runner)

# (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates; start-up tuning times them per shape and row count
CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 5), (16, 256, 4, 4), (128, 64, 8, 4))


def batch_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
               config: tuple[int, int, int, int] = CONFIGS[0], silu_mul: bool = False,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (MIN_ROWS <= M <= MAX_ROWS, last dim contiguous), w [N, K] (K contiguous), fp16 or bf16 ->
    [M, N] in x's dtype. With silu_mul, x is [M, 2K] = [gate | up] and the product uses silu(gate) * up."""
    m, kx = x.shape
    k = kx // 2 if silu_mul else kx
    n = w.shape[0]
    if (not MIN_ROWS <= m <= MAX_ROWS or w.shape[1] != k or kx != (2 * k if silu_mul else k)
            or w.stride(1) != 1 or x.stride(1) != 1 or x.dtype != w.dtype
            or x.dtype not in (torch.float16, torch.bfloat16)):  # fp32 tl.dot would round through tf32
        raise ValueError(f"batch_gemm: x {tuple(x.shape)} {x.dtype} / w {tuple(w.shape)} {w.dtype} "
                         f"(silu_mul={silu_mul}) not supported")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    _batch_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0, SILU_MUL=silu_mul, num_warps=warps, num_stages=stages, **pdl.launch_options())
    return out


def batch_gemm_ref(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   silu_mul: bool = False) -> torch.Tensor:
    xf = x.float()
    if silu_mul:
        g, u = xf.chunk(2, dim=-1)
        xf = (torch.nn.functional.silu(g) * u).to(x.dtype).float()
    y = xf @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
