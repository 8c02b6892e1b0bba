"""Stream-K schedule of the decode-batch TMA GEMM (sm_90+): whole waves for any number of output tiles.

With one program per BLOCK_N output features, a projection whose tile count is not a multiple of the SM count
ends in a partial wave: the 8B gated gate_up at 64 rows has 192 tiles of 64 features on 132 SMs (1.45 waves) and
streams at 3.87 TB/s, while the same tile at 132 or 264 tiles reaches 4.00-4.19 (benchmarks/results/session39/
gated-waves-74ea120.txt). Here a fixed grid of P programs (PER_SM per SM) splits the n_tiles x k_tiles iterations
evenly: program p covers iterations [p T / P, (p + 1) T / P), tile-major, so a tile's K range may be shared by a
few neighbouring programs.

Each program walks its segments from its last to its first. The program holding a tile's last K iteration owns
the tile: the lower programs that hold the tile's earlier iterations did them at the start of their walk, wrote
the fp32 partial (gate and up halves, gated) to their workspace slot and counted it (release); the owner, which
reaches that tile at the end of its walk, waits for the count (acquire), adds the partials in program order to its
own, resets the count and runs the epilogue (bias, silu(gate) * up). Each program writes at most one partial (its
first segment), owners only wait for lower programs, and those never wait for higher ones, so the dependencies
have no cycle; the sum order is fixed, so results do not depend on timing. Programs run in increasing order under
the Triton interpreter, where no wait ever spins.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.batch_gemm import _gate, tma_k_step
from voltllm.kernels.pdl import pdl_enter
from voltllm.kernels.registry import CompileSpec, register_kernel


@triton.jit
def _range_start(p, P, total):
    """First iteration of program p (of P) over `total` iterations."""
    return p * total // P


@triton.jit
def _program_of(j, P, total):
    """The program whose range holds iteration j (total >= P, so one correction step is enough)."""
    p = j * P // total
    return tl.where(_range_start(p + 1, P, total) <= j, p + 1, p)


@triton.jit
def _streamk_tma_kernel(XD, UD, WD, B, Y, WS, COUNTERS, M, N, n_tiles, k_tiles, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    total = n_tiles * k_tiles
    lo = _range_start(pid, P, total)
    cur = _range_start(pid + 1, P, total)
    offs_m = tl.arange(0, BLOCK_M)
    offs_b = tl.arange(0, BLOCK_N)
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    slot = offs_m[:, None] * BLOCK_N + offs_b[None, :]  # [gate | up] partials of BLOCK_M x BLOCK_N each per program
    pdl_enter(PDL)
    while cur > lo:
        tile = (cur - 1) // k_tiles
        seg = tl.maximum(lo, tile * k_tiles)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N) if GATED else (16, 16), dtype=tl.float32)
        for kk in range(seg - tile * k_tiles, cur - tile * k_tiles):
            acc, acc_u = tma_k_step(XD, UD, WD, kk * BLOCK_K, tile * BLOCK_N, N, acc, acc_u, SILU_MUL, GATED)
        if cur == (tile + 1) * k_tiles:  # this program owns the tile: add the lower programs' partials, store
            first = _program_of(tile * k_tiles, P, total)
            if first < pid:
                ready = tl.atomic_add(COUNTERS + tile, 0, sem="acquire")
                while ready < pid - first:
                    ready = tl.atomic_add(COUNTERS + tile, 0, sem="acquire")
                for q in range(first, pid):
                    acc += tl.load(WS + q * (2 * TILE) + slot, cache_modifier=".cg")
                    if GATED:
                        acc_u += tl.load(WS + q * (2 * TILE) + TILE + slot, cache_modifier=".cg")
                tl.atomic_xchg(COUNTERS + tile, 0)  # back to zero for the next call
            offs_n = tile * BLOCK_N + offs_b
            mask_n = offs_n < N
            if GATED:
                acc = _gate(acc, acc_u, B, offs_n, mask_n, N, HAS_BIAS)
            elif HAS_BIAS:
                acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                     mask=(offs_m < M)[:, None] & mask_n[None, :])
        else:  # an earlier part of a tile a higher program owns: hand over the partial
            tl.store(WS + pid * (2 * TILE) + slot, acc)
            if GATED:
                tl.store(WS + pid * (2 * TILE) + TILE + slot, acc_u)
            tl.debug_barrier()  # every thread's part is written before the count is released
            tl.atomic_add(COUNTERS + tile, 1, sem="release")
        cur = seg


def _specs() -> list[CompileSpec]:
    sig = {"XD": "tensordesc<fp16[64, 128]>", "UD": "tensordesc<fp16[64, 128]>", "WD": "tensordesc<fp16[64, 128]>",
           "B": "*fp16", "Y": "*fp16", "WS": "*fp32", "COUNTERS": "*i32", "M": "i32", "N": "i32", "n_tiles": "i32",
           "k_tiles": "i32", "stride_ym": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "HAS_BIAS": "constexpr", "SILU_MUL": "constexpr", "GATED": "constexpr",
           "PDL": "constexpr"}
    return [CompileSpec(sig, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "HAS_BIAS": b, "SILU_MUL": s,
                              "GATED": g, "PDL": False}, f"fp16 m64 n64 k128 bias={b} silu_mul={s} gated={g} streamk")
            for b, s, g in ((False, False, False), (True, True, False), (True, False, True))]


register_kernel("gemm.decode_batch_streamk", _streamk_tma_kernel, _specs(), compat=False)  # sm_90+ only

_sm_count: dict[torch.device, int] = {}


def programs_for(device: torch.device, per_sm: int, total: int) -> int:
    """The stream-K grid: per_sm programs per SM (the CPU interpreter: 5), at most one per iteration."""
    if device.type != "cuda":
        sms = 5
    else:
        if device not in _sm_count:
            _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
        sms = _sm_count[device]
    return max(1, min(per_sm * sms, total))


def streamk_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                 counters: torch.Tensor, m: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
                 warps: int, stages: int, per_sm: int, silu_mul: bool, gated: bool) -> torch.Tensor:
    """out = x w^T (the batch_gemm variants) on the stream-K grid; batch_gemm has checked the operands (TMA-aligned)
    and the tile; counters: its zeroed tile counters (at least ceil(n / block_n) of them)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    programs = programs_for(x.device, per_sm, n_tiles * k_tiles)
    ws = torch.empty(programs * 2 * block_m * block_n, dtype=torch.float32, device=x.device)
    xd = TensorDescriptor.from_tensor(x[:, :k], [block_m, block_k])
    ud = TensorDescriptor.from_tensor(x[:, k:], [block_m, block_k]) if silu_mul else xd
    wd = TensorDescriptor.from_tensor(w, [block_n, block_k])
    _streamk_tma_kernel[(programs,)](
        xd, ud, wd, bias if bias is not None else w, out, ws, counters, m, n, n_tiles, k_tiles, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        GATED=gated, num_warps=warps, num_stages=stages, **pdl.launch_options())
    return out
