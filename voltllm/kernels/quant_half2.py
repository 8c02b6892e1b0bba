"""4-bit kept-quantized weights times a few activation rows in packed fp16 (f16x2) arithmetic: the decode GEMV.

quant_gemv.quant_matmul dequantizes each weight in fp32 and multiplies it there, which at batch 1 holds an H200 to
1.0-1.25 TB/s of 4-bit codes (~35 % of the read limit). This form works on 32-bit words of `lo` (8 weights each)
with the fp16 "magic number" conversion and f16x2 instructions (sm_53+, so SM70 too; no tensor cores, no fp8 / bf16):

- a word's bytes become halves (prmt), a nibble OR 0x6400 is the fp16 1024 + q (lop3), and a high nibble left in
  place is 1024 + 16 q; one f16x2 subtract (or FMA by 1/16) gives q - zero exactly, one f16x2 multiply the weight
  (q - zero) * scale, rounded once to fp16: the value dequantize() writes in fp16.
- NVFP4 codes become fp16 bits directly ((q & 7) << 9 | sign << 15: the E2M1 value / 2^14), multiplied by the
  per-16 scale times the global times 2^14 in fp16 (the caller checks that product stays finite: `fits`).
- each row's products accumulate in f16x2 over one word (4 per lane), then in fp32.
Measured on the H200 (benchmarks/micro/quant_half2_sweep.py, session 27): 1.3-1.8x the fp32 form at one row and
2.0-2.4x at four, over the qwen3-8b shapes (AWQ and NVFP4); still 1.2-1.9 TB/s at one row, so not yet at the read
limit. The activations must be read in 16-byte vectors: a form with one 16-byte unit per thread and 8-byte activation
loads ran fewer instructions (3.7 per weight against ~7) but was slower than the fp32 form (scattered loads).
Activations must be fp16 (f16x2 has no bf16 form before sm_80). Kinds: the 4-bit planes without high bits and
without a separate minimum: int4 (AWQ / GPTQ, any group of 16 or more), Q4_0 and NVFP4.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.pdl import pdl_enter
from voltllm.kernels.quant_gemv import checked_operands, quant_matmul
from voltllm.kernels.registry import CompileSpec, register_kernel
from voltllm.model.layers.gguf_planes import KINDS, NVFP4_KIND, e4m3_values, int4_kind

__triton_helpers__ = ("_half2_bits", "_int4_weights", "_fp4_weights", "_row_partial", "_two_word_partial",
                       "_word_halves", "_unit_scale_words",
                       "_word_pairs", "_words_0213")

FP16_MAX = 65504.0
MAX_ROWS = 4  # rows per program: each shares the dequantized words


@triton.jit
def _half2_bits(h):
    """An fp16 tensor as int32 words holding it twice (both f16x2 lanes)."""
    b = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _int4_weights(word, s_lo, s_hi, z_lo, z_hi):
    """The 8 weights of a word of `lo` as four f16x2 words: lo nibbles of bytes (0, 1), (2, 3), then the high ones.
    s_*: the scale in both lanes; z_lo: fp16 1024 + zero, z_hi: fp16 -(64 + zero), both lanes."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, z, c16;
        mov.b32 z, 0;
        mov.b32 c16, 0x2C002C00;
        prmt.b32 t0, $4, z, 0x4140;
        prmt.b32 t1, $4, z, 0x4342;
        lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $2, t0, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 $3, t1, 0x00F000F0, 0x64006400, 0xEA;
        sub.f16x2 $0, $0, $7;
        sub.f16x2 $1, $1, $7;
        fma.rn.f16x2 $2, $2, c16, $8;
        fma.rn.f16x2 $3, $3, c16, $8;
        mul.rn.f16x2 $0, $0, $5;
        mul.rn.f16x2 $1, $1, $5;
        mul.rn.f16x2 $2, $2, $6;
        mul.rn.f16x2 $3, $3, $6;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[word, s_lo, s_hi, z_lo, z_hi], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _fp4_weights(word, s_lo, s_hi):
    """The 8 E2M1 weights of a word as four f16x2 words (same order as _int4_weights); s_*: the scale times 2^14."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, a, b, z;
        mov.b32 z, 0;
        prmt.b32 t0, $4, z, 0x4140;
        prmt.b32 t1, $4, z, 0x4342;
        shl.b32 a, t0, 9;
        shl.b32 b, t0, 12;
        and.b32 b, b, 0x80008000;
        lop3.b32 $0, a, 0x0E000E00, b, 0xEA;
        shl.b32 a, t1, 9;
        shl.b32 b, t1, 12;
        and.b32 b, b, 0x80008000;
        lop3.b32 $1, a, 0x0E000E00, b, 0xEA;
        shl.b32 a, t0, 5;
        shl.b32 b, t0, 8;
        and.b32 b, b, 0x80008000;
        lop3.b32 $2, a, 0x0E000E00, b, 0xEA;
        shl.b32 a, t1, 5;
        shl.b32 b, t1, 8;
        and.b32 b, b, 0x80008000;
        lop3.b32 $3, a, 0x0E000E00, b, 0xEA;
        mul.rn.f16x2 $0, $0, $5;
        mul.rn.f16x2 $1, $1, $5;
        mul.rn.f16x2 $2, $2, $6;
        mul.rn.f16x2 $3, $3, $6;
        }""",
        constraints="=r,=r,=r,=r,r,r,r",
        args=[word, s_lo, s_hi], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _row_partial(w0, w1, w2, w3, xa, xb, xc, xd):
    """fp32 sum of a word's 8 products with its activations (x pairs as int32 words), accumulated in f16x2."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 acc;
        .reg .b16 lo, hi;
        .reg .f32 f;
        mul.rn.f16x2 acc, $1, $5;
        fma.rn.f16x2 acc, $2, $6, acc;
        fma.rn.f16x2 acc, $3, $7, acc;
        fma.rn.f16x2 acc, $4, $8, acc;
        mov.b32 {lo, hi}, acc;
        cvt.f32.f16 $0, lo;
        cvt.f32.f16 f, hi;
        add.f32 $0, $0, f;
        }""",
        constraints="=r,r,r,r,r,r,r,r,r",
        args=[w0, w1, w2, w3, xa, xb, xc, xd], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _two_word_partial(w0, w1, w2, w3, v0, v1, v2, v3, xa, xb, xc, xd, ya, yb, yc, yd):
    """_row_partial over two words (w*, v*) and their activations (x*, y*): 16 products accumulated in f16x2 (8 per
    lane) before one conversion to fp32, which saves a third of the accumulation's instructions (session 28)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 acc;
        .reg .b16 lo, hi;
        .reg .f32 f;
        mul.rn.f16x2 acc, $1, $9;
        fma.rn.f16x2 acc, $2, $10, acc;
        fma.rn.f16x2 acc, $3, $11, acc;
        fma.rn.f16x2 acc, $4, $12, acc;
        fma.rn.f16x2 acc, $5, $13, acc;
        fma.rn.f16x2 acc, $6, $14, acc;
        fma.rn.f16x2 acc, $7, $15, acc;
        fma.rn.f16x2 acc, $8, $16, acc;
        mov.b32 {lo, hi}, acc;
        cvt.f32.f16 $0, lo;
        cvt.f32.f16 f, hi;
        add.f32 $0, $0, f;
        }""",
        constraints="=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[w0, w1, w2, w3, v0, v1, v2, v3, xa, xb, xc, xd, ya, yb, yc, yd], dtype=tl.float32, is_pure=True,
        pack=1)


@triton.jit
def _word_halves(t):
    """[1, U, 4] -> its words 0, 2 and 1, 3 as two [1, U, 2] (inside the thread)."""
    return tl.split(tl.reshape(t, (1, t.shape[1], 2, 2)))


@triton.jit
def _half2_matmul_kernel(X, Y, B, LO, D, SC, MN, M, N, NU, stride_xm, stride_ym, stride_lo, stride_d, stride_s,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, U: tl.constexpr, ZERO: tl.constexpr,
                         SUPER: tl.constexpr, ZP: tl.constexpr, FP4: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PDL: tl.constexpr):
    """Y[M, N] = X[M, K] W^T (+ B). LO: the codes as int32 words [N, K / 8] (a 16-byte unit u covers elements
    64 (u // 2) + 16 (u % 2) + [0, 16) in its low nibbles and 32 more in its high ones); X: fp16 pairs as int32
    [M, K / 2]. Strides in elements of those views. PDL: wait for the step's previous kernel (kernels/pdl.py)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    n3 = offs_n[:, None, None]
    i4 = tl.arange(0, 4)
    j8 = tl.arange(0, 8)
    acc0 = tl.zeros((BLOCK_N, U, 4), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, U, 4), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, U, 4), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, U, 4), dtype=tl.float32)
    for u0 in range(0, NU, U):
        u = u0 + tl.arange(0, U)
        umask = u < NU
        mask3 = mask_n[:, None, None] & umask[None, :, None]
        word = tl.load(LO + n3 * stride_lo + (u * 4)[None, :, None] + i4[None, None, :], mask=mask3, other=0)
        e0 = (u // 2) * 64 + (u % 2) * 16  # the unit's first low-nibble element
        g_lo = (e0 // SUPER)[None, :, None]
        g_hi = ((e0 + 32) // SUPER)[None, :, None]
        if FP4:  # E4M3 scale codes as fp16 bits (value / 2^8) times the row's global scale times 2^22
            glob = tl.load(D + n3 * stride_d + g_lo, mask=mask3, other=0.0) * 4194304.0
            c_lo = tl.load(SC + n3 * stride_s + e0[None, :, None] // 16, mask=mask3, other=0).to(tl.int32)
            c_hi = tl.load(SC + n3 * stride_s + (e0[None, :, None] + 32) // 16, mask=mask3, other=0).to(tl.int32)
            f_lo = (((c_lo & 0x7F) << 7) | ((c_lo & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
            f_hi = (((c_hi & 0x7F) << 7) | ((c_hi & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
            s_lo = _half2_bits((f_lo.to(tl.float32) * glob).to(tl.float16))
            s_hi = _half2_bits((f_hi.to(tl.float32) * glob).to(tl.float16))
            w0, w1, w2, w3 = _fp4_weights(word, s_lo, s_hi)
        else:
            s_lo = _half2_bits(tl.load(D + n3 * stride_d + g_lo, mask=mask3, other=0.0))
            s_hi = _half2_bits(tl.load(D + n3 * stride_d + g_hi, mask=mask3, other=0.0))
            if ZP:  # fp16 bits of 1024 + z (ulp 1 there) and -(64 + z) (ulp 1/16)
                zr_lo = tl.load(MN + n3 * stride_s + g_lo, mask=mask3, other=0).to(tl.int32)
                zr_hi = tl.load(MN + n3 * stride_s + g_hi, mask=mask3, other=0).to(tl.int32)
            else:
                zr_lo = tl.full((1, 1, 1), ZERO, tl.int32)
                zr_hi = zr_lo
            z_lo = (0x6400 + zr_lo) | ((0x6400 + zr_lo) << 16)
            z_hi = (0xD400 + zr_hi * 16) | ((0xD400 + zr_hi * 16) << 16)
            w0, w1, w2, w3 = _int4_weights(word, s_lo, s_hi, z_lo, z_hi)
        # activation pairs: low nibbles' elements e0 + 4 i + (0, 1 | 2, 3) -> pair index e0 / 2 + 2 i + (0 | 1)
        xo = (e0 // 2)[None, :, None] + j8[None, None, :]
        xmask = umask[None, :, None]
        for r in tl.static_range(BLOCK_M):
            row = pid_m * BLOCK_M + r
            xr = X + row * stride_xm
            rm = xmask & (row < M)
            xa, xb = tl.split(tl.reshape(tl.load(xr + xo, mask=rm, other=0), (1, U, 4, 2)))
            xc, xd = tl.split(tl.reshape(tl.load(xr + xo + 16, mask=rm, other=0), (1, U, 4, 2)))
            part = _row_partial(w0, w1, w2, w3, xa, xb, xc, xd)
            if r == 0:
                acc0 += part
            elif r == 1:
                acc1 += part
            elif r == 2:
                acc2 += part
            else:
                acc3 += part
    if HAS_BIAS:
        bias = tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r in tl.static_range(BLOCK_M):
        row = pid_m * BLOCK_M + r
        if r == 0:
            acc = acc0
        elif r == 1:
            acc = acc1
        elif r == 2:
            acc = acc2
        else:
            acc = acc3
        y = tl.sum(tl.sum(acc, 2), 1) + bias
        tl.store(Y + row * stride_ym + offs_n, y.to(Y.dtype.element_ty), mask=mask_n & (row < M))


@triton.jit
def _unit_scale_words(D, SC, MN, n, u, um, stride_d, stride_s, ZERO: tl.constexpr, SUPER: tl.constexpr,
                      SHIFT: tl.constexpr, ZP: tl.constexpr, FP4: tl.constexpr):
    """(s_lo, s_hi, z_lo, z_hi) [1, U, 1] of weight row n's units u (see _int4_weights / _fp4_weights)."""
    e0 = ((u >> 1) << 6) | ((u & 1) << 4)  # the unit's first low-nibble element (never negative: shifts)
    if SUPER & (SUPER - 1) == 0:
        g_lo = e0 >> SHIFT
        g_hi = (e0 + 32) >> SHIFT
    else:
        g_lo = e0 // SUPER
        g_hi = (e0 + 32) // SUPER
    if FP4:  # E4M3 scale codes as fp16 bits (value / 2^8) times the row's global scale times 2^22
        glob = tl.load(D + n * stride_d + g_lo, mask=um, other=0.0) * 4194304.0
        c_lo = tl.load(SC + n * stride_s + (e0 >> 4), mask=um, other=0).to(tl.int32)
        c_hi = tl.load(SC + n * stride_s + ((e0 + 32) >> 4), mask=um, other=0).to(tl.int32)
        f_lo = (((c_lo & 0x7F) << 7) | ((c_lo & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        f_hi = (((c_hi & 0x7F) << 7) | ((c_hi & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        s_lo = _half2_bits((f_lo.to(tl.float32) * glob).to(tl.float16))
        s_hi = _half2_bits((f_hi.to(tl.float32) * glob).to(tl.float16))
        z_lo = s_lo
        z_hi = s_hi
    else:
        s_lo = _half2_bits(tl.load(D + n * stride_d + g_lo, mask=um, other=0.0))
        s_hi = _half2_bits(tl.load(D + n * stride_d + g_hi, mask=um, other=0.0))
        if ZP:  # fp16 bits of 1024 + z (ulp 1 there) and -(64 + z) (ulp 1/16)
            zr_lo = tl.load(MN + n * stride_s + g_lo, mask=um, other=0).to(tl.int32)
            zr_hi = tl.load(MN + n * stride_s + g_hi, mask=um, other=0).to(tl.int32)
        else:
            zr_lo = tl.full(u.shape, ZERO, tl.int32)
            zr_hi = zr_lo
        z_lo = (0x6400 + zr_lo) | ((0x6400 + zr_lo) << 16)
        z_hi = (0xD400 + zr_hi * 16) | ((0xD400 + zr_hi * 16) << 16)
    return s_lo, s_hi, z_lo, z_hi


@triton.jit
def _word_pairs(X32, base, um):
    """The activation pairs of a unit's four words, [1, U, 4] each in the words' order (0, 2, 1, 3): (low-nibble
    pair 2i, low 2i + 1, high 2i, high 2i + 1). base [1, U, 1]: the unit's first pair index. Four 16-byte loads per
    unit, split and joined inside the thread (no exchange between lanes)."""
    i4 = tl.arange(0, 4)[None, None, :]
    lo_a = tl.reshape(tl.load(X32 + base + i4, mask=um, other=0), (1, base.shape[1], 2, 2))
    lo_b = tl.reshape(tl.load(X32 + base + 4 + i4, mask=um, other=0), (1, base.shape[1], 2, 2))
    hi_a = tl.reshape(tl.load(X32 + base + 16 + i4, mask=um, other=0), (1, base.shape[1], 2, 2))
    hi_b = tl.reshape(tl.load(X32 + base + 20 + i4, mask=um, other=0), (1, base.shape[1], 2, 2))
    ea, oa = tl.split(lo_a)
    eb, ob = tl.split(lo_b)
    hea, hoa = tl.split(hi_a)
    heb, hob = tl.split(hi_b)
    shape: tl.constexpr = (1, base.shape[1], 4)
    return (tl.reshape(tl.join(ea, eb), shape), tl.reshape(tl.join(oa, ob), shape),
            tl.reshape(tl.join(hea, heb), shape), tl.reshape(tl.join(hoa, hob), shape))


@triton.jit
def _words_0213(w):
    """A unit's words [1, U, 4] in the order (0, 2, 1, 3), inside the thread."""
    return tl.reshape(tl.permute(tl.reshape(w, (1, w.shape[1], 2, 2)), (0, 1, 3, 2)), (1, w.shape[1], 4))


@triton.jit
def _half2_rows_kernel(X, Y, B, LO, D, SC, MN, M, N, NU, stride_xm, stride_ym, stride_lo, stride_d, stride_s,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, U: tl.constexpr, ZERO: tl.constexpr,
                       SUPER: tl.constexpr, SHIFT: tl.constexpr, ZP: tl.constexpr, FP4: tl.constexpr,
                       HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr):
    """The second tiling: BLOCK_N (1 | 2) weight rows and BLOCK_M (<= 4) activation rows per program; every tile
    [1, U, 4] (a unit's 4 words in one thread, units across lanes), the activations read in 16-byte vectors and
    rearranged inside the thread, so no values cross lanes until the final sums. EVEN: no masks. STAGES > 1: the
    loop's loads go through shared memory as asynchronous copies that many iterations ahead (Triton's pipeliner), so
    the bytes in flight per warp no longer cost registers."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    n1 = tl.minimum(n0 + 1, N - 1)  # a second row past N repeats the last (its store is masked)
    acc00 = tl.zeros((1, U, 2), dtype=tl.float32)
    acc01 = tl.zeros((1, U, 2), dtype=tl.float32)
    acc02 = tl.zeros((1, U, 2), dtype=tl.float32)
    acc03 = tl.zeros((1, U, 2), dtype=tl.float32)
    acc10 = tl.zeros((1, U, 2), dtype=tl.float32)
    acc11 = tl.zeros((1, U, 2), dtype=tl.float32)
    acc12 = tl.zeros((1, U, 2), dtype=tl.float32)
    acc13 = tl.zeros((1, U, 2), dtype=tl.float32)
    i4 = tl.arange(0, 4)[None, None, :]
    for u0 in tl.range(0, NU, U, num_stages=STAGES):
        u = (u0 + tl.arange(0, U))[None, :, None]
        um = (u < NU) | EVEN
        base = (u >> 1) * 32 + (u & 1) * 8  # the unit's first activation pair (products: alignment stays known)
        wa = _words_0213(tl.load(LO + n0 * stride_lo + u * 4 + i4, mask=um, other=0))
        s_lo, s_hi, z_lo, z_hi = _unit_scale_words(D, SC, MN, n0, u, um, stride_d, stride_s, ZERO, SUPER, SHIFT,
                                                   ZP, FP4)
        if FP4:
            a0, a1, a2, a3 = _fp4_weights(wa, s_lo, s_hi)
        else:
            a0, a1, a2, a3 = _int4_weights(wa, s_lo, s_hi, z_lo, z_hi)
        a0e, a0o = _word_halves(a0)
        a1e, a1o = _word_halves(a1)
        a2e, a2o = _word_halves(a2)
        a3e, a3o = _word_halves(a3)
        if BLOCK_N == 2:
            wb = _words_0213(tl.load(LO + n1 * stride_lo + u * 4 + i4, mask=um, other=0))
            t_lo, t_hi, y_lo, y_hi = _unit_scale_words(D, SC, MN, n1, u, um, stride_d, stride_s, ZERO, SUPER,
                                                       SHIFT, ZP, FP4)
            if FP4:
                b0, b1, b2, b3 = _fp4_weights(wb, t_lo, t_hi)
            else:
                b0, b1, b2, b3 = _int4_weights(wb, t_lo, t_hi, y_lo, y_hi)
            b0e, b0o = _word_halves(b0)
            b1e, b1o = _word_halves(b1)
            b2e, b2o = _word_halves(b2)
            b3e, b3o = _word_halves(b3)
        for r in tl.static_range(BLOCK_M):
            row = pid_m * BLOCK_M + r
            xa, xb, xc, xd = _word_pairs(X + row * stride_xm, base, um & ((row < M) | EVEN))
            xa0, xa1 = _word_halves(xa)
            xb0, xb1 = _word_halves(xb)
            xc0, xc1 = _word_halves(xc)
            xd0, xd1 = _word_halves(xd)
            pa = _two_word_partial(a0e, a1e, a2e, a3e, a0o, a1o, a2o, a3o, xa0, xb0, xc0, xd0, xa1, xb1, xc1, xd1)
            if r == 0:
                acc00 += pa
            elif r == 1:
                acc01 += pa
            elif r == 2:
                acc02 += pa
            else:
                acc03 += pa
            if BLOCK_N == 2:
                pb = _two_word_partial(b0e, b1e, b2e, b3e, b0o, b1o, b2o, b3o, xa0, xb0, xc0, xd0, xa1, xb1, xc1,
                                       xd1)
                if r == 0:
                    acc10 += pb
                elif r == 1:
                    acc11 += pb
                elif r == 2:
                    acc12 += pb
                else:
                    acc13 += pb
    for c in tl.static_range(BLOCK_N):
        n = n0 + c
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(B + n, mask=n < N, other=0.0).to(tl.float32)
        for r in tl.static_range(BLOCK_M):
            row = pid_m * BLOCK_M + r
            if c == 0:
                acc = acc00 if r == 0 else acc01 if r == 1 else acc02 if r == 2 else acc03
            else:
                acc = acc10 if r == 0 else acc11 if r == 1 else acc12 if r == 2 else acc13
            y = tl.sum(tl.sum(tl.sum(acc, 2), 1), 0) + bias
            tl.store(Y + row * stride_ym + n, y.to(Y.dtype.element_ty), mask=(n < N) & (row < M))


def supports(kind) -> bool:
    """Whether a plane kind has this form: 4-bit codes without high bits, a zero point (fixed or per group) or
    NVFP4's scales, scale groups of 16 elements or more (not Q8_0 / 8-bit GPTQ / FP8: their codes have high bits;
    not the table kinds, IQ4 and bitsandbytes' NF4 / FP4, whose codes are looked up)."""
    if kind.fp4:
        return kind.sub == 16
    return (kind.hi_bits == 0 and not kind.has_min and kind.sub == 0 and not kind.fp8 and not kind.nl
            and not kind.bnb and kind.super % 16 == 0 and 0 <= kind.zero < 16)


def fits(planes) -> bool:
    """Whether the planes' scales stay finite in this form's fp16 arithmetic: NVFP4's per-16 scale times the global
    scale times 2^14 (its codes are read as the E2M1 value / 2^14) must be below fp16's maximum. Reads the scales
    (a device sync): call it once per weight, at start-up."""
    if not supports(planes.kind):
        return False
    if not planes.kind.fp4:
        return True
    top = planes.sc.view(torch.uint8) & 0x7F  # E4M3 magnitude codes order like their values
    big = int(top.max()) if top.numel() else 0
    sc_max = float(e4m3_values(torch.tensor([big], dtype=torch.uint8)))
    return sc_max * float(planes.d.float().abs().max()) * 16384.0 < FP16_MAX


def operands_ok(x: torch.Tensor, planes, out: Optional[torch.Tensor]) -> bool:
    """Whether x / the planes / out can be read as this form's int32 views (fp16, even strides, 4-byte aligned)."""
    return (x.dtype == torch.float16 and x.dim() == 2 and x.stride(1) == 1 and x.stride(0) % 2 == 0
            and x.data_ptr() % 4 == 0 and planes.lo.stride(1) == 1 and planes.lo.stride(0) % 4 == 0
            and planes.lo.data_ptr() % 4 == 0 and (out is None or out.stride(1) == 1)
            and planes.k % 64 == 0 and supports(planes.kind))


def _launch(kernel, x: torch.Tensor, planes, bias: Optional[torch.Tensor], out: Optional[torch.Tensor],
            block_n: int, units: int, warps: int, **extra) -> torch.Tensor:
    """The two tilings' common launch: views, tile clamping, grid (weight rows x groups of MAX_ROWS activation rows)."""
    x, out = checked_operands(x, planes, out)
    if not operands_ok(x, planes, out):
        raise ValueError("half2_matmul needs fp16 activations with even strides and 4-bit planes of this form")
    m = x.shape[0]
    block_m = min(MAX_ROWS, triton.next_power_of_2(m))
    nu = planes.k // 32
    units = min(units, triton.next_power_of_2(nu))
    kind = planes.kind
    lo32 = planes.lo.view(torch.int32)
    x32 = x.view(torch.int32)
    sc = planes.sc if planes.sc is not None else planes.lo
    mn = planes.mn if planes.mn is not None else planes.lo
    grid = (triton.cdiv(planes.n, block_n), triton.cdiv(m, block_m))
    if "EVEN" in extra:
        extra["EVEN"] = nu % units == 0 and m % block_m == 0 and planes.n % block_n == 0
    kernel[grid](
        x32, out, bias if bias is not None else out, lo32, planes.d, sc, mn, m, planes.n, nu, x32.stride(0),
        out.stride(0), lo32.stride(0), planes.d.stride(0), sc.stride(0) if planes.sc is not None else mn.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, U=units, ZERO=kind.zero, SUPER=kind.super, ZP=kind.zero_points,
        FP4=kind.fp4, HAS_BIAS=bias is not None, num_warps=warps, **pdl.launch_options(), **extra)
    return out


def half2_matmul(x: torch.Tensor, planes, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                 config: tuple[int, int, int] = (1, 32, 2)) -> torch.Tensor:
    """x [M, K] fp16 times the 4-bit W [N, K]^T (+ bias) -> [M, N] fp16 (into `out`, which may be a column slice of a
    wider output). config: (BLOCK_N, U, num_warps). At most MAX_ROWS rows share one read of a weight tile; more rows
    read it again per MAX_ROWS. The caller checks `operands_ok` (and `fits` once per weight)."""
    return _launch(_half2_matmul_kernel, x, planes, bias, out, *config)


def half2_rows_matmul(x: torch.Tensor, planes, bias: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, config: tuple = (1, 64, 2)) -> torch.Tensor:
    """half2_matmul by the second tiling (_half2_rows_kernel). config: (BLOCK_N 1 | 2, U, num_warps[, stages]):
    stages > 1 pipelines the loop's loads through shared memory (sm_80+: cp.async)."""
    if config[0] not in (1, 2):
        raise ValueError(f"the second tiling takes 1 or 2 weight rows per program, not {config[0]}")
    stages = config[3] if len(config) > 3 else 1
    return _launch(_half2_rows_kernel, x, planes, bias, out, *config[:3], SHIFT=planes.kind.super.bit_length() - 1,
                   EVEN=True, STAGES=stages)


_SIGNATURE = {"X": "*i32", "Y": "*fp16", "B": "*fp16", "LO": "*i32", "D": "*fp16", "SC": "*i8", "MN": "*i8", "M": "i32",
              "N": "i32", "NU": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_lo": "i32", "stride_d": "i32",
              "stride_s": "i32"}
# (kind, activation rows, weight rows) of the gate's specs
_SPEC_KINDS = ((int4_kind(128, True), 1, 1), (int4_kind(128, True), 4, 2), (int4_kind(32, False), 1, 2),
               (KINDS["Q4_0"], 1, 1), (NVFP4_KIND, 1, 1), (NVFP4_KIND, 4, 2))


def _specs(rows_tiling: bool) -> list[CompileSpec]:
    extra = ("SHIFT", "EVEN", "STAGES") if rows_tiling else ()
    sig = {**_SIGNATURE, **{k: "constexpr" for k in ("BLOCK_M", "BLOCK_N", "U", "ZERO", "SUPER", "ZP", "FP4",
                                                     "HAS_BIAS", "PDL") + extra}}
    specs = []
    for kind, rows, block_n in _SPEC_KINDS:
        consts = {"BLOCK_M": rows, "BLOCK_N": block_n, "U": 64, "ZERO": kind.zero, "SUPER": kind.super,
                  "ZP": kind.zero_points, "FP4": kind.fp4, "HAS_BIAS": kind.name == "Q4_0", "PDL": False}
        if rows_tiling:
            consts.update(SHIFT=kind.super.bit_length() - 1, EVEN=rows == 1, STAGES=1)
        specs.append(CompileSpec({**sig, "D": "*fp32"} if kind.fp4 else sig, consts,
                                 f"{kind.name} n{block_n} m{rows}"))
    return specs


# the tags of this module's tiles in the start-up tuner's choices: (HALF2, BLOCK_N, U, num_warps) for
# _half2_matmul_kernel, (HALF2_ROWS, BLOCK_N, U, num_warps) for _half2_rows_kernel
HALF2 = "half2"
HALF2_ROWS = "half2-rows"
MMA = "mma"  # kernels/quant_mma.py's tensor-core form (sm_80+, not on the compat route): (MMA, KU, num_warps)
DOT = "dot"  # the tiled dequant-GEMM (kernels/quant_dot.py): the 5-8 / 9-16-row classes' default
# where MMA competes


def few_row_matmul(x: torch.Tensor, planes, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   config: Optional[tuple] = None, dot_tiles: Optional[dict] = None) -> torch.Tensor:
    """The few-row product by the tile the tuner chose: this form's for a (HALF2 | HALF2_ROWS, ...) tile, the
    tensor-core form's for an (MMA, ...) one, when the operands suit them; quant_dot for (DOT,) (its row classes
    `dot_tiles`, kernels/quant_dot.dot_table); else quant_gemv.quant_matmul (config None: its default tile)."""
    if config is not None and config[0] == DOT:
        from voltllm.kernels.quant_dot import pick_config, quant_dot

        return quant_dot(x, planes, bias, out=out, config=pick_config(x.shape[0], dot_tiles))
    if config is not None and config[0] in (HALF2, HALF2_ROWS, MMA):
        if operands_ok(x, planes, out):
            if config[0] == MMA:
                from voltllm.kernels.quant_mma import quant_mma_matmul  # imports this module

                return quant_mma_matmul(x, planes, bias, out=out, config=tuple(config[1:]))
            form = half2_matmul if config[0] == HALF2 else half2_rows_matmul
            return form(x, planes, bias, out=out, config=tuple(config[1:]))
        config = None
    return quant_matmul(x, planes, bias, out=out, config=config)


register_kernel("quant.half2_matmul", _half2_matmul_kernel, _specs(False))
register_kernel("quant.half2_rows_matmul", _half2_rows_kernel, _specs(True))
