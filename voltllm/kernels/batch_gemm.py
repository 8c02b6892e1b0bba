"""Decode-batch GEMM: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for 16 <= M <= 64 rows, with tl.dot.

At 64 concurrent requests a decode step's projections are still memory-bound (64 rows against a 4096-wide
weight), and cuBLAS streams the smaller 8B projections at only 2.9-3.0 TB/s on the H200 (qkv 6144x4096,
o_proj 4096x4096; benchmarks/results/perf-8b-c64-2072111.profile.json), its split-K down projection at 3.2
with a separate reduce kernel. Here each program owns BLOCK_N output features for all M rows (padded to
BLOCK_M), streams its weight rows once (evict-first, pipelined over K) and multiplies on tensor cores.

`silu_mul=True` takes x = [gate | up] (M, 2K) and multiplies by silu(gate) * up, computed in the prologue in
fp32 and rounded once to x's dtype for the dot (the unfused silu_and_mul also rounds silu(gate) before the
multiply: a last-place difference), so the MLP needs no activation kernel. `gated=True` is the other side of the
same seam: w = [gate; up] and each program computes the same features of both halves, writing silu(gate) * up
(fp32, not rounded in between) from its epilogue, so the down projection runs plain; the start-up tuner picks
whichever form the MLP times faster.

Split-K (SPLIT_K > 1): 64 rows against N = 4096 give only N / BLOCK_N programs, too few to keep 132 SMs
streaming, and a small BLOCK_N makes every program re-read all of x. So the K range is cut into SPLIT_K slices:
each program writes its fp32 partial to a workspace and bumps a per-tile counter; the program that arrives last
sums the SPLIT_K partials in slice order (the result does not depend on which program finishes last), writes y
and resets the counter to 0 for the next call. One kernel, no separate reduce launch (cuBLAS's split-K has one).

TMA configs (a sixth config field, sm_90+ only): the same product with x and weight tiles moved by the copy engine
through tensor descriptors (`_batch_gemm_tma_kernel`), which streams the 8B shapes' weights faster than pointer
loads do; operands TMA cannot address (unaligned strides) run the pointer kernel with the same tile.

Whether it beats cuBLAS for a shape and row count, and with which tile, is measured at start-up
(voltllm.worker.skinny_tuning), not assumed: on sm_70/75 tl.dot runs on CUDA cores and cuBLAS wins.
Reference: batch_gemm_ref (fp32 math).
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.host_memory import in_host_memory
from voltllm.kernels import pdl
from voltllm.kernels.argmax import part_argmax
from voltllm.kernels.pdl import pdl_enter, prefetch_rows_l2
from voltllm.kernels.registry import CompileSpec, register_kernel

# Rows it takes: below 16 the tl.dot tile is 16 rows tall with the missing ones masked (the weight stream, not
# the tensor cores, sets the time); one row is the skinny GEMM's (kernels/gemv.py).
MIN_ROWS, MAX_ROWS = 2, 64


# M (the batch's rows) only bounds the row masks; left out of Triton's specialisation so that every row count of one
# row block (row_block) runs one compiled kernel: a batch whose M % 16 != 0 (the 2 / 4 / 8-row graph sizes, an eager
# step given a config) compiles no variant of its own inside a step (the rule of docs/kernels.md, session 43)
@triton.jit(do_not_specialize=["M"])
def _batch_gemm_kernel(X, W, B, Y, WS, COUNTERS, PV, PI, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
                       PREFETCH_K: tl.constexpr, GATED: tl.constexpr, ARGMAX: tl.constexpr = False):
    pid = tl.program_id(0)
    k_start = tl.program_id(1) * k_per_split  # a multiple of BLOCK_K
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH_K > 0:  # PDL: the weight does not depend on the predecessor; its first lines may come early
        prefetch_rows_l2(W + k_start, offs_n, N, stride_wn, K - k_start, PREFETCH_K)
    pdl_enter(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptr = X + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptr = W + offs_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N) if GATED else (16, 16), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
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
            up = tl.load(x_ptr + K, mask=mx, other=0.0)
            x = _silu_times(x.to(tl.float32), up.to(tl.float32)).to(W.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:  # the up rows of the same features, N rows below the gate rows
            wu = tl.load(w_ptr + N * stride_wn, mask=mw, other=0.0, eviction_policy="evict_first")
            acc_u = tl.dot(x, tl.trans(wu), acc_u)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if GATED:
        acc = _gate(acc, acc_u, B, offs_n, mask_n, N, HAS_BIAS)
    _finish_tile(acc, B, Y, WS, COUNTERS, Y, 0, acc, WS, 1.0, PV, PI, pid, offs_m, offs_n, mask_m, mask_n, N,
                 stride_ym, BLOCK_M, BLOCK_N, SPLIT_K, HAS_BIAS and not GATED, False, False, False, ARGMAX)


@triton.jit
def _gate(acc, acc_u, B, offs_n, mask_n, N, HAS_BIAS: tl.constexpr):
    """silu(gate) * up of a gated tile, in fp32 (not rounded in between; bias: [gate bias | up bias])."""
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(B + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return _silu_times(acc, acc_u)


@triton.jit
def _silu_times(g, u):
    """silu(g) * u in fp32: the silu*mul prologue and the gated epilogue alike."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _finish_tile(acc, B, Y, WS, COUNTERS, R, stride_rm, r_pre, SS, out_scale, PV, PI, pid, offs_m, offs_n, mask_m,
                 mask_n, N, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, RES_ADD: tl.constexpr, R_PRE: tl.constexpr, SS_OUT: tl.constexpr,
                 ARGMAX: tl.constexpr):
    """Store the program's [BLOCK_M, BLOCK_N] fp32 tile (+ bias); with split-K, write it as this slice's partial
    and let the last slice of the tile to arrive sum all partials in slice order and store that. RES_ADD: add the
    tile to the fp32 residual R in place (R_PRE: its rows loaded before the K loop, r_pre) and store the sum times
    out_scale, rounded, as Y (the next norm-folded GEMM's input; the scale keeps large residual values inside fp16);
    SS_OUT: also store each row's sum of squares of that rounded tile at SS[pid * BLOCK_M + row] (the next GEMM's
    RMSNorm sums the tiles' partials). ARGMAX (SPLIT_K 1, no residual): store nothing of the tile but each row's
    argmax partial (_store_tile_argmax); Y then only names the output dtype."""
    y_ptr = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask_y = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if RES_ADD:
            acc = _residual_add(acc, R, stride_rm, offs_m, offs_n, mask_y, r_pre, R_PRE) * out_scale
            if SS_OUT:
                _store_sumsq(acc, Y, SS, pid, offs_m, BLOCK_M)
        if ARGMAX:
            _store_tile_argmax(acc.to(Y.dtype.element_ty).to(tl.float32), PV, PI, pid, offs_m, offs_n, mask_m, mask_n)
        else:
            tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask_y)
    else:
        ws_tile = WS + offs_m[:, None] * N + offs_n[None, :]  # slice s at WS + s * BLOCK_M * N
        tl.store(ws_tile + tl.program_id(1) * BLOCK_M * N, acc, mask=mask_y)
        tl.debug_barrier()  # every thread's partial is written before the counter is released
        arrived = tl.atomic_add(COUNTERS + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last slice of this tile to finish: reduce in slice order
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_tile + s * BLOCK_M * N, mask=mask_y, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if RES_ADD:
                total = _residual_add(total, R, stride_rm, offs_m, offs_n, mask_y, r_pre, False) * out_scale
                if SS_OUT:
                    _store_sumsq(total, Y, SS, pid, offs_m, BLOCK_M)
            tl.store(y_ptr, total.to(Y.dtype.element_ty), mask=mask_y)
            tl.atomic_xchg(COUNTERS + pid, 0)


@triton.jit
def _store_tile_argmax(v, PV, PI, pid, offs_m, offs_n, mask_m, mask_n):
    """Each row's largest value in this tile (v: the tile as the output would hold it, rounded, in fp32) and its first
    column, at PV / PI[row * tiles + pid]; a row holding a NaN reports its first NaN's column c as -1 - c (a NaN
    outranks every number, as in torch.argmax). kernels/argmax.argmax_of_partials combines them in tile order."""
    best, code = part_argmax(tl.where(mask_n[None, :], v, float("-inf")), offs_n[None, :], 1)
    slot = offs_m * tl.num_programs(0) + pid
    tl.store(PV + slot, best, mask=mask_m)
    tl.store(PI + slot, code, mask=mask_m)


@triton.jit
def _residual_add(acc, R, stride_rm, offs_m, offs_n, mask_y, r_pre, R_PRE: tl.constexpr):
    """R += acc in place (fp32 residual rows, or bf16 ones for a bf16 model, whose stream has fp32's range; R_PRE:
    r_pre holds them already); returns the new residual tile (fp32, before R's rounding)."""
    r_ptr = R + offs_m[:, None] * stride_rm + offs_n[None, :]
    if R_PRE:
        total = r_pre + acc
    else:
        total = tl.load(r_ptr, mask=mask_y, other=0.0) + acc
    tl.store(r_ptr, total.to(R.dtype.element_ty), mask=mask_y)
    return total


@triton.jit
def _store_sumsq(total, Y, SS, pid, offs_m, BLOCK_M: tl.constexpr):
    """This tile's per-row sum of squares of the rounded rows (masked rows and features are zero)."""
    q = total.to(Y.dtype.element_ty).to(tl.float32)
    tl.store(SS + pid * BLOCK_M + offs_m, tl.sum(q * q, axis=1))


@triton.jit(do_not_specialize=["M"])  # (as _batch_gemm_kernel)
def _batch_gemm_tma_kernel(XD, UD, WD, W, B, Y, WS, COUNTERS, G, R, SS, PV, PI, M, N, K, k_per_split, stride_wn,
                           stride_ym, stride_rm, eps, g_scale, n_parts, out_scale,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
                           PREFETCH_K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr = False,
                           RES_ADD: tl.constexpr = False, NORM_X: tl.constexpr = True, SS_OUT: tl.constexpr = False,
                           SS_PARTS: tl.constexpr = 0, ARGMAX: tl.constexpr = False):
    """The same product with the x and weight tiles moved by TMA (tensor descriptors, sm_90+): the copy engine
    fills the pipeline stages without address math or masks in registers (out-of-range rows and K columns read
    as zero). XD / UD: descriptors of x, or of its gate / up halves with SILU_MUL; WD: the weight's (W: the same
    weight as a pointer, for the L2 prefetch before the PDL wait).

    NORM (RMSNorm folded in, SPLIT_K 1): x holds the un-normalised rows; each K tile's sum of squares is kept
    per row and the tile enters the dot as x * G (G: the norm weight / g_scale, fp32, so the rounded product stays
    in range), and the accumulators are scaled by rsqrt(mean(x^2) + eps) * g_scale at the end. NORM_X False: the
    weight already holds the norm weight, x enters the dot as loaded. SS_PARTS > 0: the sums of squares are not
    computed from x but summed from the producer's n_parts per-tile partials at SS (SS_OUT of _finish_tile), loaded
    before the K loop. RES_ADD / SS_OUT: see _finish_tile (R: the fp32 residual, loaded before the K loop)."""
    pid = tl.program_id(0)
    k_start = tl.program_id(1) * k_per_split  # a multiple of BLOCK_K
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH_K > 0:
        prefetch_rows_l2(W + k_start, pid * BLOCK_N + tl.arange(0, BLOCK_N), N, stride_wn, K - k_start, PREFETCH_K)
    pdl_enter(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_pre = tl.zeros((16, 16), dtype=tl.float32)
    if RES_ADD and SPLIT_K == 1:  # the residual rows' loads overlap the K loop
        r_pre = tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :],
                        mask=(offs_m < M)[:, None] & (offs_n < N)[None, :], other=0.0)
    if SS_PARTS > 0:
        offs_t = tl.arange(0, SS_PARTS)
        ss_parts = tl.load(SS + offs_t[:, None] * BLOCK_M + offs_m[None, :], mask=(offs_t < n_parts)[:, None],
                           other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N) if GATED else (16, 16), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = XD.load([0, k0])
        if SILU_MUL:
            x = _silu_times(x.to(tl.float32), UD.load([0, k0]).to(tl.float32)).to(x.dtype)
        if NORM and (SS_PARTS == 0 or NORM_X):
            xf = x.to(tl.float32)
            if SS_PARTS == 0:
                sumsq += tl.sum(xf * xf, axis=1)
            if NORM_X:  # (otherwise the weight holds the norm weight already: x enters the dot as loaded)
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = (xf * tl.load(G + offs_k, mask=offs_k < K, other=0.0)[None, :]).to(x.dtype)
        w = WD.load([pid * BLOCK_N, k0])
        acc = tl.dot(x, w.T, acc)
        if GATED:  # the up rows (a gate tile past N reads up rows: those features are not stored)
            acc_u = tl.dot(x, WD.load([N + pid * BLOCK_N, k0]).T, acc_u)
    if NORM:
        if SS_PARTS > 0:
            sumsq = tl.sum(ss_parts, axis=0)
        row_scale = (tl.rsqrt(sumsq / K + eps) * g_scale)[:, None]
        acc = acc * row_scale
        if GATED:
            acc_u = acc_u * row_scale
    if GATED:
        acc = _gate(acc, acc_u, B, offs_n, offs_n < N, N, HAS_BIAS)
    _finish_tile(acc, B, Y, WS, COUNTERS, R, stride_rm, r_pre, SS, out_scale, PV, PI, pid, offs_m, offs_n,
                 offs_m < M, offs_n < N, N, stride_ym, BLOCK_M, BLOCK_N, SPLIT_K, HAS_BIAS and not GATED, RES_ADD,
                 RES_ADD and SPLIT_K == 1, SS_OUT, ARGMAX)


def _specs() -> list[CompileSpec]:
    sig = {"X": "*fp16", "W": "*fp16", "B": "*fp16", "Y": "*fp16", "WS": "*fp32", "COUNTERS": "*i32", "PV": "*fp32",
           "PI": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_ym": "i32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr",
           "HAS_BIAS": "constexpr", "EVEN_K": "constexpr", "SILU_MUL": "constexpr", "PDL": "constexpr",
           "PREFETCH_K": "constexpr", "GATED": "constexpr", "ARGMAX": "constexpr"}
    return [CompileSpec(sig, {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "HAS_BIAS": b, "EVEN_K": e,
                              "SILU_MUL": s, "PDL": False, "PREFETCH_K": 0, "GATED": gt, "ARGMAX": am},
                        f"fp16 m{m} n{n} k{k} split{sk} bias={b} even={e} silu_mul={s} gated={gt} argmax={am}")
            for m, n, k, sk, b, e, s, gt, am in ((64, 32, 128, 1, False, True, False, False, False),
                                                 (32, 64, 64, 1, True, False, True, False, False),
                                                 (64, 64, 128, 4, True, False, False, False, False),
                                                 (64, 64, 128, 1, True, True, False, True, False),
                                                 (64, 64, 64, 1, False, False, False, False, True))]


register_kernel("gemm.decode_batch", _batch_gemm_kernel, _specs(), compat=False)  # native route only (runner)


def _tma_specs() -> list[CompileSpec]:
    sig = {"XD": "tensordesc<fp16[64, 128]>", "UD": "tensordesc<fp16[64, 128]>", "WD": "tensordesc<fp16[64, 128]>",
           "W": "*fp16", "B": "*fp16", "Y": "*fp16", "WS": "*fp32", "COUNTERS": "*i32", "G": "*fp32", "R": "*fp32",
           "SS": "*fp32", "PV": "*fp32", "PI": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32",
           "stride_wn": "i32",
           "stride_ym": "i32", "stride_rm": "i32", "eps": "fp32", "g_scale": "fp32", "n_parts": "i32",
           "out_scale": "fp32",
           "BLOCK_M": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr", "HAS_BIAS": "constexpr",
           "SILU_MUL": "constexpr", "PDL": "constexpr", "PREFETCH_K": "constexpr", "GATED": "constexpr",
           "NORM": "constexpr", "RES_ADD": "constexpr", "NORM_X": "constexpr", "SS_OUT": "constexpr",
           "SS_PARTS": "constexpr", "ARGMAX": "constexpr"}
    return [CompileSpec(sig, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": sk, "HAS_BIAS": b,
                              "SILU_MUL": s, "PDL": False, "PREFETCH_K": 0, "GATED": gt, "NORM": nm, "RES_ADD": ra,
                              "NORM_X": nx, "SS_OUT": ra and nm is False, "SS_PARTS": sp, "ARGMAX": am},
                        f"fp16 m64 n64 k128 split{sk} bias={b} silu_mul={s} gated={gt} norm={nm} res_add={ra} "
                        f"norm_x={nx} parts={sp} argmax={am} tma")
            for sk, b, s, gt, nm, ra, nx, sp, am in (
                (1, False, False, False, False, False, True, 0, False),
                (2, True, True, False, False, False, True, 0, False),
                (1, True, False, True, False, False, True, 0, False),
                (1, False, False, True, True, False, False, 64, False),
                (1, False, False, False, True, False, True, 0, False),
                (2, False, False, False, False, True, True, 0, False),
                (1, False, False, False, False, True, True, 0, False),
                (1, False, False, False, False, False, True, 0, True))]


register_kernel("gemm.decode_batch_tma", _batch_gemm_tma_kernel, _tma_specs(), compat=False)  # sm_90+ only

# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) candidates; start-up tuning times them per shape and row count.
# 128x128-wide split tiles (8 warps) were tried at 0b86bb5 and never came closest to cuBLAS on the 8B shapes;
# they are left out because each candidate costs start-up compile time (the batch tuner took 38 s there).
CONFIGS: tuple[tuple, ...] = (
    (32, 128, 4, 4, 1), (64, 128, 4, 4, 1), (32, 256, 4, 3, 1), (64, 64, 4, 5, 1), (16, 256, 4, 4, 1),
    (128, 64, 8, 4, 1), (64, 128, 4, 4, 2), (64, 128, 4, 4, 4), (32, 256, 4, 3, 2))
# TMA candidates (a sixth field, True), sm_90+: the fastest of a tile sweep at 64 rows on the H200 (cold L2, graph
# replays; benchmarks/micro/batch_gemm_sweep.py, results/batch-gemm-sweep-217862e.txt), best TMA / pointer tile /
# cuBLAS: 4096x12288 28.4 / 30.3 / 31.4 us, 4096x4096 11.2 / 12.7 / 11.5, 6144x4096 15.8 / 16.2 / 15.9,
# 24576x4096 51.0 / 51.1 / 50.2.
TMA_CONFIGS: tuple[tuple, ...] = (
    (64, 128, 4, 6, 1, True), (32, 256, 4, 4, 1, True), (32, 128, 4, 6, 1, True), (64, 64, 4, 4, 1, True),
    (64, 128, 4, 6, 2, True))


def tma_supported(device: torch.device) -> bool:
    """Whether `device` has TMA (sm_90+) and this Triton has host tensor descriptors."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return importlib.util.find_spec("triton.tools.tensor_descriptor") is not None


# The candidates for weights under SMALL_WEIGHT_BYTES: every config costs start-up compile time per row count and K,
# and timing all of them on SmolLM2's four shapes took 57 s on a cold Triton cache (H200, session 15). These three
# were the fastest there at 16-64 rows for every shape (results/batch-gemm-small-weights/).
SMALL_WEIGHT_BYTES = 4 << 20
SMALL_WEIGHT_CONFIGS: tuple[tuple, ...] = ((32, 128, 4, 4, 1), (16, 256, 4, 4, 1), (32, 256, 4, 4, 1, True))


def configs_for(device: torch.device, weight_bytes: Optional[int] = None) -> tuple[tuple, ...]:
    """The candidates the start-up tuner times on `device` (for a weight of `weight_bytes`, when given)."""
    tma = tma_supported(device)
    if weight_bytes is not None and weight_bytes < SMALL_WEIGHT_BYTES:
        return tuple(c for c in SMALL_WEIGHT_CONFIGS if tma or len(c) < 6)
    return CONFIGS + (TMA_CONFIGS if tma else ())


MAX_COUNTERS = 1 << 16  # output tiles a split-K call may have (N / BLOCK_N)
_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K tile counters: zeroed once, and every split-K call leaves them at zero again (its
    last program per tile resets its own), so CUDA-graph replays and eager calls share them. Kernels of one
    stream run one after the other (PDL waits for the predecessor too), so calls never overlap."""
    c = _counters.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("batch_gemm: split-K counters must exist before CUDA-graph capture "
                               "(call batch_gemm once eagerly first)")
        c = _counters[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return c


# With PDL, the weight elements per row each program prefetches into L2 before it waits for its predecessor
# (a power of two >= 64, or 0 for none).
BATCH_PREFETCH_K = 0


def batch_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
               config: tuple = CONFIGS[0], silu_mul: bool = False,
               out: Optional[torch.Tensor] = None, prefetch_k: Optional[int] = None,
               gated: bool = False, norm: Optional["FoldedNorm"] = None,
               residual: Optional[torch.Tensor] = None, sumsq_out: Optional[torch.Tensor] = None,
               sumsq_in: Optional[tuple[torch.Tensor, int]] = None, residual_out_scale: float = 1.0,
               argmax_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (MIN_ROWS <= M <= MAX_ROWS, last dim contiguous), w [N, K] (K contiguous), fp16 or bf16 ->
    [M, N] in x's dtype. With silu_mul, x is [M, 2K] = [gate | up] and the product uses silu(gate) * up.
    With gated (the other side of the same seam), w is [2N, K] = [gate; up] and the result [M, N] is
    silu(x gate^T) * (x up^T), computed in the epilogue in fp32 (bias: [2N]); gated tiles run without split-K.
    prefetch_k: with PDL on, weight elements per row prefetched before the wait (None: BATCH_PREFETCH_K).
    norm (TMA configs without split-K only): x is the un-normalised residual rows, rounded to x's dtype, and the
    product is with RMSNorm(x) (FoldedNorm). residual ([M, N], fp32, or bf16 with bf16 x; TMA configs only):
    residual += the product in place, and the result is the new residual times residual_out_scale rounded to x's
    dtype. sumsq_out (with residual; fp32, at least n_tiles * row_block(M) elements): each output tile's per-row
    sums of squares of the result, for the next GEMM's norm. sumsq_in = (that buffer, its producer's n_tiles), with
    norm: the norm's sums of squares are summed from those partials instead of computed from x (x must be the
    producer's result). argmax_out (int64 [M]; plain tiles without split-K): no [M, N] output, but each row's argmax
    of it (as torch.argmax of the rounded output would give) is written there and returned: a greedy LM head."""
    m, kx = x.shape
    k = kx // 2 if silu_mul else kx
    n = w.shape[0] // 2 if gated else w.shape[0]
    if (not MIN_ROWS <= m <= MAX_ROWS or w.shape[1] != k or kx != (2 * k if silu_mul else k)
            or w.stride(1) != 1 or x.stride(1) != 1 or x.dtype != w.dtype
            or x.dtype not in (torch.float16, torch.bfloat16)  # fp32 tl.dot would round through tf32
            or (gated and (w.shape[0] % 2 or silu_mul or config[4] != 1))
            or ((norm is not None or residual is not None) and not _tma_fold_ok(x, w, k, config, norm, residual))
            or (sumsq_out is not None and residual is None) or (sumsq_in is not None and norm is None)
            or (argmax_out is not None and not _argmax_ok(argmax_out, m, config, silu_mul, gated, norm, residual,
                                                          out))):
        raise ValueError(f"batch_gemm: x {tuple(x.shape)} {x.dtype} / w {tuple(w.shape)} {w.dtype} "
                         f"(silu_mul={silu_mul}, gated={gated}, config {config}) not supported")
    block_n, block_k, warps, stages, split, *tma = config
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    block_m = row_block(m)
    k_tiles = triton.cdiv(k, block_k)
    tiles_per_split = triton.cdiv(k_tiles, min(split, k_tiles))
    split = triton.cdiv(k_tiles, tiles_per_split)  # no empty slices
    n_tiles = triton.cdiv(n, block_n)
    if split > 1 and n_tiles > MAX_COUNTERS:
        raise ValueError(f"batch_gemm: {n_tiles} output tiles exceed the {MAX_COUNTERS} split-K counters")
    if argmax_out is not None:  # per-row partials of every tile instead of the output ("out" only names its dtype)
        out = w
        pv = torch.empty(m * n_tiles, dtype=torch.float32, device=x.device)
        pi = torch.empty(m * n_tiles, dtype=torch.int32, device=x.device)
    elif out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if split > 1:  # fp32 partials, one [BLOCK_M, N] slice per split; the caching allocator serves graphs too
        ws = torch.empty(split * block_m * n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    else:
        ws = counters = out
    if argmax_out is None:
        pv = pi = ws
    stages = _fitting_stages(x.device, stages, block_m, block_n * (2 if gated else 1), block_k, x.element_size(),
                             silu_mul, all_stages=gated and bool(tma and tma[0]))
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, HAS_BIAS=bias is not None,
                SILU_MUL=silu_mul, GATED=gated, ARGMAX=argmax_out is not None, num_warps=warps, num_stages=stages,
                **pdl.gemm_launch_options(BATCH_PREFETCH_K if prefetch_k is None else prefetch_k))
    b = bias if bias is not None else w
    if tma and tma[0] and _tma_aligned(x, w, k):
        from triton.tools.tensor_descriptor import TensorDescriptor

        xd = TensorDescriptor.from_tensor(x[:, :k], [block_m, block_k])
        ud = TensorDescriptor.from_tensor(x[:, k:], [block_m, block_k]) if silu_mul else xd
        wd = TensorDescriptor.from_tensor(w, [block_n, block_k])
        g = norm.weight if norm is not None else ws
        r = residual if residual is not None else ws
        ss, n_parts = sumsq_in if sumsq_in is not None else (sumsq_out if sumsq_out is not None else ws, 0)
        if sumsq_out is not None and sumsq_out.numel() < n_tiles * block_m:
            raise ValueError(f"batch_gemm: sumsq_out holds {sumsq_out.numel()} < {n_tiles * block_m} partials")
        if sumsq_in is not None and ss.numel() < n_parts * block_m:
            raise ValueError(f"batch_gemm: sumsq_in holds {ss.numel()} < {n_parts * block_m} partials")
        _batch_gemm_tma_kernel[(n_tiles, split)](
            xd, ud, wd, w, b, out, ws, counters, g, r, ss, pv, pi, m, n, k, tiles_per_split * block_k,
            w.stride(0), out.stride(0), r.stride(0) if residual is not None else 0,
            norm.eps if norm is not None else 0.0, norm.scale if norm is not None else 1.0, n_parts,
            float(residual_out_scale), NORM=norm is not None, RES_ADD=residual is not None,
            NORM_X=norm is None or not norm.in_weight, SS_OUT=sumsq_out is not None,
            SS_PARTS=triton.next_power_of_2(n_parts) if n_parts else 0, **meta)
    else:  # pointer loads (also a TMA config's fallback for operands TMA cannot address)
        _batch_gemm_kernel[(n_tiles, split)](
            x, w, b, out, ws, counters, pv, pi, m, n, k, tiles_per_split * block_k, x.stride(0), w.stride(0),
            out.stride(0), EVEN_K=k % block_k == 0, **meta)
    if argmax_out is not None:
        from voltllm.kernels.argmax import argmax_of_partials

        return argmax_of_partials(pv, pi, m, n_tiles, argmax_out)
    return out


def _argmax_ok(argmax_out: torch.Tensor, m: int, config: tuple, silu_mul: bool, gated: bool,
               norm: Optional["FoldedNorm"], residual: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> bool:
    """The argmax epilogue's form: plain tiles without split-K, an int64 [M] target, no other output."""
    return (argmax_out.dtype == torch.int64 and argmax_out.shape == (m,) and argmax_out.is_contiguous()
            and config[4] == 1 and not (silu_mul or gated) and norm is None and residual is None and out is None)


class FoldedNorm:
    """An RMSNorm as a norm-folded GEMM takes it: weight = (norm weight + offset) / scale in fp32, with scale the
    largest |norm weight + offset|, so x * weight never exceeds x's range when rounded for the dot."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        g = weight.detach().float() + offset
        self.scale = max(float(g.abs().max()), 1e-30) if g.numel() else 1.0
        self.weight = (g / self.scale).contiguous()
        self.eps = float(eps)
        self.in_weight = False  # True: the GEMM's weight columns are already multiplied by the norm weight


def _tma_fold_ok(x: torch.Tensor, w: torch.Tensor, k: int, config: tuple, norm: Optional[FoldedNorm],
                 residual: Optional[torch.Tensor]) -> bool:
    """The norm / residual epilogue forms exist in the TMA kernel only (and the norm needs every K in one program)."""
    if len(config) < 6 or not config[5] or not _tma_aligned(x, w, k):
        return False
    if norm is not None and (config[4] != 1 or norm.weight.numel() != k or norm.weight.device != x.device):
        return False
    if residual is not None and (not (residual.dtype == torch.float32 or residual.dtype == x.dtype == torch.bfloat16)
                                 or residual.shape != (x.shape[0], w.shape[0]) or residual.stride(1) != 1):
        return False
    return True


def row_block(m: int) -> int:
    """The tile's BLOCK_M for m rows: the compiled kernel is the same for every row count of one row block (the
    rows past m are masked)."""
    return max(16, triton.next_power_of_2(m))


def _fitting_stages(device: torch.device, stages: int, block_m: int, block_n: int, block_k: int, itemsize: int,
                    silu_mul: bool, all_stages: bool = False) -> int:
    """`stages`, lowered until the pipeline's buffers fit the device's shared memory: Triton keeps stages - 1 tiles
    of x (and of up, with silu_mul) and of the weight, plus the fp32 output tile for the epilogue. The silu*mul
    variant of a deep tile would otherwise not launch (the start-up tuner would drop the config). all_stages: the
    kernel keeps `stages` tiles (the gated TMA kernel does: Triton 3.6 asked for 245,848 bytes at 5 stages of 48 KB
    on the H200, whose limit is 232,448)."""
    if device.type != "cuda":
        return stages
    limit = _smem_limit(device)
    per_stage = (block_m * block_k * (2 if silu_mul else 1) + block_n * block_k) * itemsize
    fit = (0 if all_stages else 1) + (limit - block_m * block_n * 4) // per_stage
    return max(1, min(stages, fit))


_smem: dict[torch.device, int] = {}


def _smem_limit(device: torch.device) -> int:
    if device not in _smem:
        _smem[device] = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return _smem[device]


def _tma_aligned(x: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """TMA needs 16-byte aligned bases and row strides in device memory (not weights read in place from host memory:
    --offload-backend uva); with silu_mul the up half of x starts K elements in."""
    es = x.element_size()
    return not in_host_memory(w) and (x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and (x.stride(0) * es) % 16 == 0
            and (w.stride(0) * es) % 16 == 0 and (k * es) % 16 == 0)


def batch_gemm_ref(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   silu_mul: bool = False, gated: bool = False,
                   norm: Optional[tuple[torch.Tensor, float, float]] = None) -> torch.Tensor:
    """fp32 math; norm = (weight, eps, offset): x is normalised (RMSNorm, rounded to x's dtype) first."""
    xf = x.float()
    if norm is not None:
        g, eps, offset = norm
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (g.float() + offset)).to(x.dtype).float()
    if silu_mul:
        g, u = xf.chunk(2, dim=-1)
        xf = (torch.nn.functional.silu(g) * u).to(x.dtype).float()
    y = xf @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    if gated:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    return y.to(x.dtype)
