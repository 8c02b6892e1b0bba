"""GGUF-quantized weights on the device: dequant-GEMM for decode rows, dequant-to-fp16 for prompts.

The weights are voltllm.model.layers.gguf_planes.Planes (codes and scales in separate aligned arrays). A tile is
[BLOCK_N rows, U units of 16 bytes of `lo`]; a 64-element group's 32 bytes of `lo` hold its first 32 elements in the
low nibbles and its last 32 in the high ones, so a unit dequantizes as two halves of 16 weights each (elements
e0 + j and e0 + 32 + j) sharing their scales, and the activations are read in the same two halves.

- `quant_matmul`: y = x W^T (+ b) for a few rows: each program dequantizes its tile in registers (fp32, no tensor
  cores: the same kernel on every route, SM70 included) and multiplies it by up to FMA_MAX_ROWS activation rows.
  The weight is read at its quantized size (4.5-bit weights: ~3.5x fewer bytes than fp16). The codes become floats
  through their bits (2^23 + q, minus 2^23): the integer conversion instruction runs at a quarter of the FMA rate
  and bounded the first version.
- `dequantize`: the whole weight (or a band of its rows) to fp16 / bf16 in a workspace, for prompt steps and larger
  decode batches, whose GEMM goes to cuBLAS (the SM70 discipline: tensor-core work through the vendor library,
  DESIGN.md).

Dequantized values equal the `gguf` package's (fp32, same operation order); kernels.md has the measured speeds.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel
from voltllm.model.layers.gguf_planes import FP8_KIND, KINDS, NVFP4_KIND, bnb_kind, int4_kind, int8_kind

__triton_helpers__ = ("_dequant_units", "_unit_scales", "_codes_to_float", "_scaled", "_pick8", "_bnb_value")


@triton.jit
def _unit_scales(e0, n3, mask3, D, Mp, SC, MN, stride_d, stride_s, ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                 SUB: tl.constexpr, SUPER: tl.constexpr, ZP: tl.constexpr, FP8: tl.constexpr,
                 FP4: tl.constexpr = False):
    """(s, b) [BLOCK_N, U, 1] for the 16 elements from index e0 [1, U, 1] on: the weight is s * q + b, i.e.
    s = d * sc and b = (m or -(dmin * mn) or -(d * zero point)) - s * ZERO. One load per scale per 16 elements, not
    per element. FP4 (NVFP4): s is the E4M3 scale read as fp16 bits (value / 2^8) and b the global scale times
    2^22 (2^8 for the scale, 2^14 for the E2M1 codes read as fp16 bits): the weight is (s * q) * b."""
    s = tl.load(D + n3 * stride_d + e0 // SUPER, mask=mask3, other=0.0).to(tl.float32)
    if FP8:  # the codes decode with the exponent bias of fp16 (15), not E4M3's (7): 2^8 rebiases them, exactly
        s = s * 256.0
    if FP4:
        c = tl.load(SC + n3 * stride_s + e0 // SUB, mask=mask3, other=0).to(tl.int32)
        b = s * 4194304.0  # exact: a power of two
        s = (((c & 0x7F) << 7) | ((c & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        if SUB > 0:
            s = s * tl.load(SC + n3 * stride_s + e0 // SUB, mask=mask3, other=0).to(tl.float32)
        b = s * (-ZERO)  # exact: ZERO is 0, 8, 16, 32 or 128
        if ZP:  # an int4 / int8 checkpoint's zero point (int8: minus ZERO 128): b = -s * zero and s * q + b are exact
            # in fp32 (an fp16 scale times integers of at most 9 bits)
            b = b - s * tl.load(MN + n3 * stride_s + e0 // SUPER, mask=mask3, other=0).to(tl.float32)
        elif HAS_MIN:
            m = tl.load(Mp + n3 * stride_d + e0 // SUPER, mask=mask3, other=0.0).to(tl.float32)
            if SUB > 0:
                b = b - m * tl.load(MN + n3 * stride_s + e0 // SUB, mask=mask3, other=0).to(tl.float32)
            else:
                b = b + m
    return s, b


@triton.jit
def _pick8(q, v0, v1, v2, v3, v4, v5, v6, v7):
    """v[q & 7] for 3-bit codes q: a tree of selects on the code's bits (fp32 constants, exact)."""
    b0 = (q & 1) != 0
    b1 = (q & 2) != 0
    low = tl.where(b1, tl.where(b0, v3, v2), tl.where(b0, v1, v0))
    high = tl.where(b1, tl.where(b0, v7, v6), tl.where(b0, v5, v4))
    return tl.where((q & 4) != 0, high, low)


@triton.jit
def _bnb_value(q, NL: tl.constexpr):
    """bitsandbytes' table value (fp32, in [-1, 1]) of 4-bit codes q: NL 2 NF4, NL 3 FP4 (bnb_codec.table's fp32
    values; the interpreter checks compare every code with it)."""
    if NL == 2:
        neg = _pick8(q, -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                     -0.18477343022823334, -0.09105003625154495, 0.0)
        pos = _pick8(q, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
        v = tl.where((q & 8) != 0, pos, neg)
    else:  # FP4: bit 3 the sign, codes 0..7 the magnitudes (0, 0.0625, 8, 12, 4, 6, 2, 3) / 12
        mag = _pick8(q, 0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5,
                     0.1666666716337204, 0.25)
        v = tl.where((q & 8) != 0, -mag, mag)
    return v


@triton.jit
def _codes_to_float(q, FP8: tl.constexpr, FP4: tl.constexpr, NL: tl.constexpr = 0):
    """Integer codes (int32) as fp32: plain integers, E4M3 / E2M1 codes read as fp16 bits (see below), (NL 1) 4-bit
    indices into IQ4's table as its 8-bit codes (gguf_planes.IQ4_CODES) or (NL 2 / 3) 4-bit indices into
    bitsandbytes' NF4 / FP4 table of floats (TABLE_IDS)."""
    if NL == 1:  # the table's 16 bytes packed 4 per word (int32 literals): pick the word, then the byte; exact
        word = tl.where(q < 8, tl.where(q < 4, 1059919873, 1986682191), tl.where(q < 12, -1499886207, -237386315))
        q = (word >> ((q & 3) * 8)) & 0xFF
    if NL >= 2:
        f = _bnb_value(q, NL)
    elif FP8:  # E4M3 codes read as fp16 bits (sign, then exponent and mantissa moved up 7 bits): the value / 2^8,
        # subnormals included; the fp16 -> fp32 conversion is exact (no fp8 instructions: SM70 has none)
        f = (((q & 0x7F) << 7) | ((q & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    elif FP4:  # E2M1 codes read as fp16 bits (exponent and mantissa at fp16's top mantissa bit, sign at bit 15): the
        # value / 2^14 for every code, the subnormal 0.5 included; exact
        f = (((q & 7) << 9) | ((q & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:  # codes to fp32 without the (quarter-rate) integer conversion: the bits of 2^23 + q, minus 2^23 (exact)
        f = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return f


@triton.jit
def _scaled(s, q, b, FP4: tl.constexpr):
    """The weights from float codes q and _unit_scales' (s, b)."""
    if FP4:  # code times scale is exact (at most 6 significant bits): the global scale rounds once
        w = (s * q) * b
    else:
        w = tl.fma(s, q, b)
    return w


@triton.jit
def _dequant_units(LO, HI, D, Mp, SC, MN, offs_n, mask_n, u0, NU, stride_lo, stride_hi, stride_d, stride_s,
                   U: tl.constexpr, HI_BITS: tl.constexpr, ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                   SUB: tl.constexpr, SUPER: tl.constexpr, ZP: tl.constexpr, FP8: tl.constexpr,
                   FP4: tl.constexpr = False, NL: tl.constexpr = 0):
    """fp32 weights of rows offs_n for `lo` units u0 .. u0 + U (16 bytes each): (lo, hi, e0), the weights [BLOCK_N,
    U, 16] of elements e0 + j and e0 + 32 + j, with e0 [1, U, 1] = 64 (u // 2) + 16 (u % 2)."""
    u = u0 + tl.arange(0, U)
    j = tl.arange(0, 16)
    n3 = offs_n[:, None, None]
    mask3 = mask_n[:, None, None] & (u < NU)[None, :, None]
    byte = tl.load(LO + n3 * stride_lo + (u * 16)[None, :, None] + j[None, None, :], mask=mask3, other=0)
    byte = byte.to(tl.int32)
    q_lo = byte & 15
    q_hi = byte >> 4
    if HI_BITS == 4:
        hb = tl.load(HI + n3 * stride_hi + (u * 16)[None, :, None] + j[None, None, :], mask=mask3, other=0)
        hb = hb.to(tl.int32)
        q_lo |= (hb & 15) << 4
        q_hi |= (hb >> 4) << 4
    elif HI_BITS == 1:
        hb = tl.load(HI + n3 * stride_hi + ((u // 2) * 8)[None, :, None] + (j % 8)[None, None, :], mask=mask3,
                     other=0)
        hb = hb.to(tl.int32)
        bit = ((u % 2) * 2)[None, :, None] + (j // 8)[None, None, :]
        q_lo |= ((hb >> bit) & 1) << 4
        q_hi |= ((hb >> (bit + 4)) & 1) << 4
    elif HI_BITS == 2:
        hb = tl.load(HI + n3 * stride_hi + ((u // 2) * 16)[None, :, None] + j[None, None, :], mask=mask3, other=0)
        hb = hb.to(tl.int32)
        shift = ((u % 2) * 2)[None, :, None]
        q_lo |= ((hb >> shift) & 3) << 4
        q_hi |= ((hb >> (shift + 4)) & 3) << 4
    q_lo = _codes_to_float(q_lo, FP8, FP4, NL)
    q_hi = _codes_to_float(q_hi, FP8, FP4, NL)
    e0 = ((u // 2) * 64 + (u % 2) * 16)[None, :, None]
    s_lo, b_lo = _unit_scales(e0, n3, mask3, D, Mp, SC, MN, stride_d, stride_s, ZERO, HAS_MIN, SUB, SUPER, ZP,
                              FP8, FP4)
    s_hi, b_hi = _unit_scales(e0 + 32, n3, mask3, D, Mp, SC, MN, stride_d, stride_s, ZERO, HAS_MIN, SUB,
                               SUPER, ZP, FP8, FP4)
    return _scaled(s_lo, q_lo, b_lo, FP4), _scaled(s_hi, q_hi, b_hi, FP4), e0


@triton.jit
def _quant_matmul_kernel(X, Y, B, LO, HI, D, Mp, SC, MN, ROWS, EXPERTS, M, N, NU, stride_xm, stride_ym, stride_lo,
                         stride_hi, stride_d, stride_s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, U: tl.constexpr,
                         HI_BITS: tl.constexpr, ZERO: tl.constexpr, HAS_MIN: tl.constexpr, SUB: tl.constexpr,
                         SUPER: tl.constexpr, ZP: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
                         GATHER: tl.constexpr, FP4: tl.constexpr, NL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    j = tl.arange(0, 16)
    if GATHER:  # MoE pairs (BLOCK_M 1): output row pid_m is x row ROWS[pid_m] times expert EXPERTS[pid_m]'s block
        x_row = tl.load(ROWS + pid_m)  # of N rows in a weight stacked by expert
        expert = tl.load(EXPERTS + pid_m)
        if expert < 0:  # expert parallelism: another rank's expert; the pair's row is zero, no weight read
            tl.store(Y + pid_m * stride_ym + offs_n, tl.zeros([BLOCK_N], dtype=Y.dtype.element_ty), mask=mask_n)
            return
        plane_n = expert.to(tl.int64) * N + offs_n
    else:
        x_row = pid_m
        plane_n = offs_n
    if BLOCK_M == 1:
        acc3 = tl.zeros((BLOCK_N, U, 16), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, U * 16), dtype=tl.float32)
    for u0 in range(0, NU, U):
        w_lo, w_hi, e0 = _dequant_units(LO, HI, D, Mp, SC, MN, plane_n, mask_n, u0, NU, stride_lo, stride_hi,
                                        stride_d, stride_s, U, HI_BITS, ZERO, HAS_MIN, SUB, SUPER, ZP, FP8, FP4, NL)
        umask = (u0 + tl.arange(0, U)) < NU
        if BLOCK_M == 1:  # one row: stay in the tile's own [BLOCK_N, U, 16] layout
            xp = X + x_row * stride_xm + e0 + j[None, None, :]
            xm = (umask & (pid_m < M))[None, :, None]
            acc3 += w_lo * tl.load(xp, mask=xm, other=0.0).to(tl.float32)
            acc3 += w_hi * tl.load(xp + 32, mask=xm, other=0.0).to(tl.float32)
        else:
            e = tl.reshape(e0 + j[None, None, :], (U * 16,))
            xm = mask_m[:, None] & tl.reshape(umask[:, None] & (j < 16)[None, :], (U * 16,))[None, :]
            xp = X + offs_m[:, None] * stride_xm + e[None, :]
            w_lo = tl.reshape(w_lo, (BLOCK_N, U * 16))
            w_hi = tl.reshape(w_hi, (BLOCK_N, U * 16))
            acc3 += tl.load(xp, mask=xm, other=0.0).to(tl.float32)[:, None, :] * w_lo[None, :, :]
            acc3 += tl.load(xp + 32, mask=xm, other=0.0).to(tl.float32)[:, None, :] * w_hi[None, :, :]
    if BLOCK_M == 1:
        acc = tl.reshape(tl.sum(tl.sum(acc3, 2), 1), (1, BLOCK_N))
    else:
        acc = tl.sum(acc3, 2)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    ymask = mask_m[:, None] & mask_n[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=ymask)


@triton.jit
def _dequant_kernel(OUT, LO, HI, D, Mp, SC, MN, N, NU, stride_out, stride_lo, stride_hi, stride_d, stride_s,
                    BLOCK_N: tl.constexpr, U: tl.constexpr, HI_BITS: tl.constexpr, ZERO: tl.constexpr,
                    HAS_MIN: tl.constexpr, SUB: tl.constexpr, SUPER: tl.constexpr, ZP: tl.constexpr,
                    FP8: tl.constexpr, FP4: tl.constexpr, NL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    u0 = tl.program_id(1) * U
    mask_n = offs_n < N
    w_lo, w_hi, e0 = _dequant_units(LO, HI, D, Mp, SC, MN, offs_n, mask_n, u0, NU, stride_lo, stride_hi, stride_d,
                                    stride_s, U, HI_BITS, ZERO, HAS_MIN, SUB, SUPER, ZP, FP8, FP4, NL)
    j = tl.arange(0, 16)
    mask = mask_n[:, None, None] & ((u0 + tl.arange(0, U)) < NU)[None, :, None]
    ptr = OUT + offs_n[:, None, None] * stride_out + e0 + j[None, None, :]
    tl.store(ptr, w_lo.to(OUT.dtype.element_ty), mask=mask)
    tl.store(ptr + 32, w_hi.to(OUT.dtype.element_ty), mask=mask)


_PLANE_ARGS = {"LO": "*u8", "HI": "*u8", "D": "*fp16", "Mp": "*fp16", "SC": "*i8", "MN": "*i8"}


# NL: the table a 4-bit code indexes (0: none, the code is the value): IQ4's integers, bitsandbytes' NF4 / FP4 floats
TABLE_IDS = {"iq4": 1, "nf4": 2, "fp4": 3}


def table_id(kind) -> int:
    """The kernels' NL constexpr of a gguf_planes.PlaneKind (TABLE_IDS)."""
    return TABLE_IDS["iq4"] if kind.nl else TABLE_IDS[kind.bnb] if kind.bnb else 0


def _constexprs(kind) -> dict:
    """A gguf_planes.PlaneKind as the kernels' constexprs."""
    return {"HI_BITS": kind.hi_bits, "ZERO": kind.zero, "HAS_MIN": kind.has_min, "SUB": kind.sub, "SUPER": kind.super,
            "ZP": kind.zero_points, "FP8": kind.fp8, "FP4": kind.fp4, "NL": table_id(kind)}


def _distinct_forms(kinds) -> list:
    """The kinds with constexprs no earlier one has (one spec per distinct form)."""
    seen, out = set(), []
    for kind in kinds:
        key = tuple(sorted(_constexprs(kind).items()))
        if key not in seen:
            seen.add(key)
            out.append(kind)
    return out


# every GGUF kind's form, the int4 checkpoints' common forms (AWQ / asymmetric GPTQ, symmetric GPTQ), 8-bit GPTQ's
# (asymmetric, symmetric), FP8, NVFP4 and bitsandbytes' NF4 / FP4, for the sm70 gate
_GATED_KINDS = _distinct_forms(list(KINDS.values()) + [int4_kind(128, True), int4_kind(128, False),
                                                       int4_kind(32, True), int8_kind(128, True),
                                                       int8_kind(128, False), FP8_KIND, NVFP4_KIND,
                                                       bnb_kind("nf4", 64), bnb_kind("fp4", 64)])


def _with_scale_type(sig: dict, kind) -> dict:
    """The signature with the `d` plane's element type of the kind (fp32 for FP8 and NVFP4 checkpoints' scales)."""
    return {**sig, "D": "*fp32"} if kind.fp8 or kind.fp4 else sig


def _matmul_specs() -> list[CompileSpec]:
    sig = {"X": "*fp16", "Y": "*fp16", "B": "*fp16", **_PLANE_ARGS, "ROWS": "*i32", "EXPERTS": "*i32", "M": "i32",
           "N": "i32", "NU": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_lo": "i32", "stride_hi": "i32",
           "stride_d": "i32", "stride_s": "i32"}
    sig.update({k: "constexpr" for k in ("BLOCK_M", "BLOCK_N", "U", "HI_BITS", "ZERO", "HAS_MIN", "SUB", "SUPER",
                                          "ZP", "FP8", "HAS_BIAS", "GATHER", "FP4", "NL")})
    return [CompileSpec(_with_scale_type(sig, kind), {"BLOCK_M": 1, "BLOCK_N": 8, "U": 16, **_constexprs(kind),
                                                      "HAS_BIAS": kind.name == "Q8_0", "GATHER": False},
                        f"{kind.name} m1")
            for kind in _GATED_KINDS] + [
        CompileSpec(sig, {"BLOCK_M": 4, "BLOCK_N": 8, "U": 8, **_constexprs(int4_kind(128, True)), "HAS_BIAS": True,
                          "GATHER": False}, "INT4_G128_ZP m4"),
        CompileSpec(sig, {"BLOCK_M": 4, "BLOCK_N": 8, "U": 8, **_constexprs(KINDS["Q4_K"]), "HAS_BIAS": False,
                          "GATHER": False}, "Q4_K m4"),
        CompileSpec(sig, {"BLOCK_M": 1, "BLOCK_N": 1, "U": 64, **_constexprs(int4_kind(128, True)), "HAS_BIAS": False,
                          "GATHER": True}, "INT4_G128_ZP MoE pairs"),
        CompileSpec(_with_scale_type(sig, NVFP4_KIND), {"BLOCK_M": 4, "BLOCK_N": 8, "U": 8, **_constexprs(NVFP4_KIND),
                                                        "HAS_BIAS": False, "GATHER": False}, "NVFP4 m4"),
        CompileSpec(_with_scale_type(sig, NVFP4_KIND), {"BLOCK_M": 1, "BLOCK_N": 1, "U": 64, **_constexprs(NVFP4_KIND),
                                                        "HAS_BIAS": False, "GATHER": True}, "NVFP4 MoE pairs")]


def _dequant_specs() -> list[CompileSpec]:
    sig = {"OUT": "*fp16", **_PLANE_ARGS, "N": "i32", "NU": "i32", "stride_out": "i32", "stride_lo": "i32",
           "stride_hi": "i32", "stride_d": "i32", "stride_s": "i32"}
    sig.update({k: "constexpr" for k in ("BLOCK_N", "U", "HI_BITS", "ZERO", "HAS_MIN", "SUB", "SUPER", "ZP", "FP8",
                                          "FP4", "NL")})
    return [CompileSpec(_with_scale_type(sig, kind), {"BLOCK_N": 16, "U": 16, **_constexprs(kind)}, kind.name)
            for kind in _GATED_KINDS]


register_kernel("quant.matmul", _quant_matmul_kernel, _matmul_specs())
register_kernel("quant.dequantize", _dequant_kernel, _dequant_specs())

FMA_MAX_ROWS = 4  # rows per program of the FMA form (its accumulator holds rows x BLOCK_N x U * 16 fp32)
# (BLOCK_N, U, num_warps): U units of 16 bytes of `lo` (512 elements at U = 16) per K step
# the fastest at 1 / 4 rows over the qwen3-8b shapes, Q4_K and Q8_0, in the H200 sweep (results/gguf-quant/)
FMA_CONFIG = (1, 64, 2)
FMA_ROWS_CONFIG = (16, 8, 4)
DEQUANT_CONFIG = (16, 16, 4)


def _plane_args(p) -> list:
    dummy = p.d
    return [p.lo, p.hi if p.hi is not None else dummy, p.d, p.m if p.m is not None else dummy,
            p.sc if p.sc is not None else p.lo, p.mn if p.mn is not None else p.lo]


def _plane_strides(p) -> list[int]:
    return [p.lo.stride(0), p.hi.stride(0) if p.hi is not None else 0, p.d.stride(0),
            (p.sc if p.sc is not None else p.mn).stride(0) if p.sc is not None or p.mn is not None else 0]


def checked_operands(x: torch.Tensor, planes, out: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with a contiguous last dim and the output [M, N] (a fresh one when `out` is None) of x W^T; a clear
    error when x's width is not the weight's."""
    m, k = x.shape
    if k != planes.k:
        raise ValueError(f"input of {k} features for a weight of {planes.k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, planes.n, dtype=x.dtype, device=x.device)
    return x, out


def checked_expert_operands(x: torch.Tensor, planes, rows_per_expert: int, pairs: int, out: Optional[torch.Tensor]
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """checked_operands for MoE pairs over experts stacked by expert: the output is [pairs, rows_per_expert]."""
    k = x.shape[1]
    if k != planes.k or planes.n % rows_per_expert:
        raise ValueError(f"input of {k} features / {planes.n} rows for experts of {rows_per_expert} x {planes.k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(pairs, rows_per_expert, dtype=x.dtype, device=x.device)
    return x, out


def quant_matmul(x: torch.Tensor, planes, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                 config: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """x [M, K] (last dim contiguous) times the quantized W [N, K]^T (+ bias) -> [M, N] in x's dtype (into `out`,
    which may be a column slice of a wider output). config: (BLOCK_N, U, num_warps). Rows beyond FMA_MAX_ROWS run
    in further programs, each reading the weight again (meant for a few rows)."""
    x, out = checked_operands(x, planes, out)
    m = x.shape[0]
    block_m = min(FMA_MAX_ROWS, triton.next_power_of_2(m))
    block_n, units, warps = config or (FMA_CONFIG if block_m == 1 else FMA_ROWS_CONFIG)
    units = min(units, triton.next_power_of_2(planes.k // 32))  # short rows (SmolLM2: 18 units) mask less
    grid = (triton.cdiv(planes.n, block_n), triton.cdiv(m, block_m))
    _quant_matmul_kernel[grid](
        x, out, bias if bias is not None else out, *_plane_args(planes), planes.lo, planes.lo, m, planes.n,
        planes.k // 32, x.stride(0), out.stride(0), *_plane_strides(planes), BLOCK_M=block_m, BLOCK_N=block_n,
        U=units, **_constexprs(planes.kind), HAS_BIAS=bias is not None, GATHER=False, num_warps=warps)
    return out


def quant_moe_matmul(x: torch.Tensor, planes, rows_per_expert: int, x_rows: torch.Tensor, experts: torch.Tensor,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MoE (token, expert) pairs over a weight stacked by expert (expert e: rows [e * rows_per_expert, (e + 1) *
    rows_per_expert) of `planes`): out[p] = x[x_rows[p]] @ W_{experts[p]}^T, [pairs, rows_per_expert] in x's
    dtype. x_rows / experts: int32 on x's device; an expert -1 (expert parallelism: another rank's) gives a zero
    row. One program per pair and output tile, each reading its expert's block at its quantized size (meant for
    decode-sized batches; no host sync, so CUDA graphs can capture it)."""
    pairs = x_rows.shape[0]
    x, out = checked_expert_operands(x, planes, rows_per_expert, pairs, out)
    block_n, units, warps = FMA_CONFIG
    units = min(units, triton.next_power_of_2(planes.k // 32))
    grid = (triton.cdiv(rows_per_expert, block_n), pairs)
    _quant_matmul_kernel[grid](
        x, out, out, *_plane_args(planes), x_rows, experts, pairs, rows_per_expert, planes.k // 32, x.stride(0),
        out.stride(0), *_plane_strides(planes), BLOCK_M=1, BLOCK_N=block_n, U=units, **_constexprs(planes.kind),
        HAS_BIAS=False, GATHER=True, num_warps=warps)
    return out


def dequantize(planes, dtype: torch.dtype = torch.float16, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weight [N, K] in `dtype` (into `out`, e.g. a reused workspace)."""
    if out is None:
        out = torch.empty(planes.n, planes.k, dtype=dtype, device=planes.device)
    block_n, units, warps = DEQUANT_CONFIG
    grid = (triton.cdiv(planes.n, block_n), triton.cdiv(planes.k // 32, units))
    _dequant_kernel[grid](out, *_plane_args(planes), planes.n, planes.k // 32, out.stride(0),
                          *_plane_strides(planes), BLOCK_N=block_n, U=units, **_constexprs(planes.kind),
                          num_warps=warps)
    return out
