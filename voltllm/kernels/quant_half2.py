"""4-bit kept-quantized weights times a few activation rows in packed fp16 (f16x2) arithmetic: the decode GEMV.

quant_gemv.quant_matmul dequantizes each weight in fp32 and multiplies it there: some seven instructions per weight
(byte extract, code to float, scale, convert the activation, FMA), which at batch 1 holds an H200 to 1.0-1.25 TB/s of
4-bit codes (~35 % of the read limit). This form works on 32-bit words of `lo` (8 weights each) with the fp16
"magic number" conversion and f16x2 instructions (sm_53+, so SM70 too; no tensor cores, no fp8 / bf16):

- a word's bytes become halves (prmt), a nibble OR 0x6400 is the fp16 1024 + q (lop3), and a high nibble left in
  place is 1024 + 16 q; one f16x2 subtract (or FMA by 1/16) gives q - zero exactly, one f16x2 multiply the weight
  (q - zero) * scale, rounded once to fp16: the value dequantize() writes in fp16.
- NVFP4 codes become fp16 bits directly ((q & 7) << 9 | sign << 15: the E2M1 value / 2^14), multiplied by the
  per-16 scale times the global times 2^14 in fp16 (the caller checks that product stays finite: `fits`).
- each row's products accumulate in f16x2 over one word (4 per lane), then in fp32.
About 3.5 instructions per weight for int4 (4.5 for NVFP4) instead of ~7. Activations must be fp16 (f16x2 has no
bf16 form before sm_80). Kinds: the 4-bit planes without high bits and without a separate minimum: int4 (AWQ / GPTQ,
any group of 16 or more), Q4_0 and NVFP4.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel
from voltllm.model.layers.gguf_planes import KINDS, NVFP4_KIND, int4_kind

__triton_helpers__ = ("_half2_bits", "_unit_weights", "_unit_partial")

FP16_MAX = 65504.0
MAX_ROWS = 4  # activation rows per program: each shares the dequantized words
DEFAULT_CONFIG = (64, 2)  # (U, num_warps)


@triton.jit
def _half2_bits(h):
    """An fp16 tensor as int32 words holding it twice (both f16x2 lanes)."""
    b = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


_INT4_WORD = """
        prmt.b32 t0, {w}, z, 0x4140;
        prmt.b32 t1, {w}, z, 0x4342;
        lop3.b32 {o0}, t0, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 {o1}, t1, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 {o2}, t0, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 {o3}, t1, 0x00F000F0, 0x64006400, 0xEA;
        sub.f16x2 {o0}, {o0}, $18;
        sub.f16x2 {o1}, {o1}, $18;
        fma.rn.f16x2 {o2}, {o2}, c16, $19;
        fma.rn.f16x2 {o3}, {o3}, c16, $19;
        mul.rn.f16x2 {o0}, {o0}, $16;
        mul.rn.f16x2 {o1}, {o1}, $16;
        mul.rn.f16x2 {o2}, {o2}, $17;
        mul.rn.f16x2 {o3}, {o3}, $17;"""

_FP4_WORD = """
        prmt.b32 t0, {w}, z, 0x4140;
        prmt.b32 t1, {w}, z, 0x4342;
        shl.b32 a, t0, 9;
        shl.b32 b, t0, 12;
        and.b32 b, b, 0x80008000;
        lop3.b32 {o0}, a, 0x0E000E00, b, 0xEA;
        shl.b32 a, t1, 9;
        shl.b32 b, t1, 12;
        and.b32 b, b, 0x80008000;
        lop3.b32 {o1}, a, 0x0E000E00, b, 0xEA;
        shl.b32 a, t0, 5;
        shl.b32 b, t0, 8;
        and.b32 b, b, 0x80008000;
        lop3.b32 {o2}, a, 0x0E000E00, b, 0xEA;
        shl.b32 a, t1, 5;
        shl.b32 b, t1, 8;
        and.b32 b, b, 0x80008000;
        lop3.b32 {o3}, a, 0x0E000E00, b, 0xEA;
        mul.rn.f16x2 {o0}, {o0}, $16;
        mul.rn.f16x2 {o1}, {o1}, $16;
        mul.rn.f16x2 {o2}, {o2}, $17;
        mul.rn.f16x2 {o3}, {o3}, $17;"""


def _unit_asm(word_form: str) -> str:
    """PTX for one 16-byte unit (words as two int64 $20, $21) -> 16 f16x2 outputs $0..$15 in the order: word k's
    low-nibble pairs (4k, 4k + 1), then its high-nibble pairs (4k + 2, 4k + 3)."""
    body = ["{", ".reg .b32 t0, t1, a, b, z, c16, w0, w1, w2, w3;", "mov.b32 z, 0;", "mov.b32 c16, 0x2C002C00;",
            "mov.b64 {w0, w1}, $20;", "mov.b64 {w2, w3}, $21;"]
    for k in range(4):
        body.append(word_form.format(w=f"w{k}", o0=f"${4 * k}", o1=f"${4 * k + 1}", o2=f"${4 * k + 2}",
                                     o3=f"${4 * k + 3}"))
    body.append("}")
    return "\n".join(body)


# the strings as constexprs: a jit function may read module globals only in that form
_INT4_UNIT_ASM = tl.constexpr(_unit_asm(_INT4_WORD))
_FP4_UNIT_ASM = tl.constexpr(_unit_asm(_FP4_WORD))
_UNIT_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 16) + ",r,r,r,r,l,l")


@triton.jit
def _unit_weights(words_a, words_b, s_lo, s_hi, z_lo, z_hi, FP4: tl.constexpr):
    """A unit's 32 weights as 16 f16x2 words (see _unit_asm). s_*: the scale in both lanes (NVFP4: times 2^14);
    z_lo: fp16 1024 + zero, z_hi: fp16 -(64 + zero), both lanes (unused for NVFP4)."""
    if FP4:
        out = tl.inline_asm_elementwise(
            asm=_FP4_UNIT_ASM, constraints=_UNIT_CONSTRAINTS,
            args=[s_lo, s_hi, z_lo, z_hi, words_a, words_b], dtype=(tl.int32,) * 16, is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise(
            asm=_INT4_UNIT_ASM, constraints=_UNIT_CONSTRAINTS,
            args=[s_lo, s_hi, z_lo, z_hi, words_a, words_b], dtype=(tl.int32,) * 16, is_pure=True, pack=1)
    return out


_DOT_ASM = tl.constexpr("\n".join(
    ["{", ".reg .b32 lo, hi, xa, xb;", ".reg .b16 h0, h1;", ".reg .f32 f;"]
    + [f"mov.b64 {{xa, xb}}, ${17 + k};\n"
       + (f"mul.rn.f16x2 lo, ${1 + 4 * k}, xa;\n" if k == 0 else f"fma.rn.f16x2 lo, ${1 + 4 * k}, xa, lo;\n")
       + f"fma.rn.f16x2 lo, ${2 + 4 * k}, xb, lo;\n"
       + f"mov.b64 {{xa, xb}}, ${21 + k};\n"
       + (f"mul.rn.f16x2 hi, ${3 + 4 * k}, xa;\n" if k == 0 else f"fma.rn.f16x2 hi, ${3 + 4 * k}, xa, hi;\n")
       + f"fma.rn.f16x2 hi, ${4 + 4 * k}, xb, hi;" for k in range(4)]
    + ["mov.b32 {h0, h1}, lo;", "cvt.f32.f16 $0, h0;", "cvt.f32.f16 f, h1;", "add.f32 $0, $0, f;",
       "mov.b32 {h0, h1}, hi;", "cvt.f32.f16 f, h0;", "add.f32 $0, $0, f;", "cvt.f32.f16 f, h1;", "add.f32 $0, $0, f;",
       "}"]))
_DOT_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 16) + "," + ",".join(["l"] * 8))


@triton.jit
def _unit_partial(w, x_lo0, x_lo1, x_lo2, x_lo3, x_hi0, x_hi1, x_hi2, x_hi3):
    """fp32 dot of a unit's 16 f16x2 weight words `w` with its 32 activations (x_lo k: the 4 fp16 of elements
    e0 + 4k .. + 3 as an int64; x_hi k: e0 + 32 + 4k ..), the low and high nibbles' products summed in f16x2 apart."""
    return tl.inline_asm_elementwise(
        asm=_DOT_ASM, constraints=_DOT_CONSTRAINTS,
        args=[w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], w[10], w[11], w[12], w[13], w[14], w[15],
              x_lo0, x_lo1, x_lo2, x_lo3, x_hi0, x_hi1, x_hi2, x_hi3], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _half2_matmul_kernel(X, Y, B, LO, D, SC, MN, M, N, NU, stride_xm, stride_ym, stride_lo, stride_d, stride_s,
                         BLOCK_M: tl.constexpr, U: tl.constexpr, ZERO: tl.constexpr, SUPER: tl.constexpr,
                         ZP: tl.constexpr, FP4: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                         SHIFT: tl.constexpr):
    """Y[M, N] = X[M, K] W^T (+ B): one weight row and BLOCK_M (<= 4) activation rows per program. LO: the codes as
    int64 [N, K / 16] (unit u = 2 int64 = 16 bytes: elements e0 = 64 (u // 2) + 16 (u % 2) + [0, 16) in its low
    nibbles, e0 + 32 + [0, 16) in its high ones); X: fp16 quadruples as int64 [M, K / 4]. Every tensor is [U] (one
    unit each), so the codes, scales and activations share one layout: no exchange between threads until the sum.
    EVEN: U divides the row's units and BLOCK_M the rows (no masks). Indices are shifts: they are never negative."""
    n = tl.program_id(0)
    pid_m = tl.program_id(1)
    acc0 = tl.zeros((U,), dtype=tl.float32)
    acc1 = tl.zeros((U,), dtype=tl.float32)
    acc2 = tl.zeros((U,), dtype=tl.float32)
    acc3 = tl.zeros((U,), dtype=tl.float32)
    for u0 in range(0, NU, U):
        u = u0 + tl.arange(0, U)
        um = (u < NU) | EVEN
        words_a = tl.load(LO + n * stride_lo + 2 * u, mask=um, other=0)
        words_b = tl.load(LO + n * stride_lo + 2 * u + 1, mask=um, other=0)
        e0 = ((u >> 1) << 6) | ((u & 1) << 4)
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
                zr_lo = tl.full((U,), ZERO, tl.int32)
                zr_hi = zr_lo
            z_lo = (0x6400 + zr_lo) | ((0x6400 + zr_lo) << 16)
            z_hi = (0xD400 + zr_hi * 16) | ((0xD400 + zr_hi * 16) << 16)
        w = _unit_weights(words_a, words_b, s_lo, s_hi, z_lo, z_hi, FP4)
        xo = e0 >> 2
        for r in tl.static_range(BLOCK_M):
            row = pid_m * BLOCK_M + r
            xr = X + row * stride_xm + xo
            rm = um & ((row < M) | EVEN)
            part = _unit_partial(w, tl.load(xr, mask=rm, other=0), tl.load(xr + 1, mask=rm, other=0),
                                 tl.load(xr + 2, mask=rm, other=0), tl.load(xr + 3, mask=rm, other=0),
                                 tl.load(xr + 8, mask=rm, other=0), tl.load(xr + 9, mask=rm, other=0),
                                 tl.load(xr + 10, mask=rm, other=0), tl.load(xr + 11, mask=rm, other=0))
            if r == 0:
                acc0 += part
            elif r == 1:
                acc1 += part
            elif r == 2:
                acc2 += part
            else:
                acc3 += part
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(B + n).to(tl.float32)
    for r in tl.static_range(BLOCK_M):
        row = pid_m * BLOCK_M + r
        acc = acc0 if r == 0 else acc1 if r == 1 else acc2 if r == 2 else acc3
        tl.store(Y + row * stride_ym + n, (tl.sum(acc, 0) + bias).to(Y.dtype.element_ty), mask=row < M)


def supports(kind) -> bool:
    """Whether a plane kind has this form: 4-bit codes without high bits, a zero point (fixed or per group) or
    NVFP4's scales, scale groups of 16 elements or more."""
    if kind.fp4:
        return kind.sub == 16
    return (kind.hi_bits == 0 and not kind.has_min and kind.sub == 0 and not kind.fp8 and kind.super % 16 == 0
            and 0 <= kind.zero < 16)


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
    from voltllm.model.layers.gguf_planes import e4m3_values

    sc_max = float(e4m3_values(torch.tensor([big], dtype=torch.uint8)))
    return sc_max * float(planes.d.float().abs().max()) * 16384.0 < FP16_MAX


def operands_ok(x: torch.Tensor, planes, out: Optional[torch.Tensor]) -> bool:
    """Whether x / the planes / out suit this form's int32 / int64 views (fp16 activations; x's rows are copied when
    their stride is not a multiple of 4)."""
    return (x.dtype == torch.float16 and x.dim() == 2 and x.stride(1) == 1 and x.data_ptr() % 8 == 0 and planes.lo.stride(1) == 1 and planes.lo.stride(0) % 8 == 0
            and planes.lo.data_ptr() % 8 == 0 and (out is None or out.stride(1) == 1)
            and planes.k % 64 == 0 and supports(planes.kind))


def half2_matmul(x: torch.Tensor, planes, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                 config: tuple[int, int, int] = DEFAULT_CONFIG) -> torch.Tensor:
    """x [M, K] fp16 times the 4-bit W [N, K]^T (+ bias) -> [M, N] fp16 (into `out`, which may be a column slice of a
    wider output). config: (U units of 16 bytes per K step, num_warps): one weight row per program. At most
    MAX_ROWS activation rows share one read of a weight tile; more rows read it again per MAX_ROWS. The caller
    checks `operands_ok` (and `fits` once per weight)."""
    from voltllm.kernels.quant_gemv import checked_operands

    x, out = checked_operands(x, planes, out)
    if not operands_ok(x, planes, out):
        raise ValueError("half2_matmul needs fp16 activations with even strides and 4-bit planes of this form")
    m = x.shape[0]
    block_m = min(MAX_ROWS, triton.next_power_of_2(m))
    units, warps = config
    nu = planes.k // 32  # units: 16 bytes of `lo`, 32 elements
    units = min(units, triton.next_power_of_2(nu))
    kind = planes.kind
    lo64 = planes.lo.view(torch.int64)
    x64 = x.view(torch.int64) if x.stride(0) % 4 == 0 else x.contiguous().view(torch.int64)
    sc = planes.sc if planes.sc is not None else planes.lo
    mn = planes.mn if planes.mn is not None else planes.lo
    grid = (planes.n, triton.cdiv(m, block_m))
    _half2_matmul_kernel[grid](
        x64, out, bias if bias is not None else out, lo64, planes.d, sc, mn, m, planes.n, nu, x64.stride(0),
        out.stride(0), lo64.stride(0), planes.d.stride(0), sc.stride(0) if planes.sc is not None else mn.stride(0),
        BLOCK_M=block_m, U=units, EVEN=nu % units == 0 and m % block_m == 0, SHIFT=kind.super.bit_length() - 1, ZERO=kind.zero, SUPER=kind.super, ZP=kind.zero_points,
        FP4=kind.fp4, HAS_BIAS=bias is not None, num_warps=warps)
    return out


def _specs() -> list[CompileSpec]:
    sig = {"X": "*i64", "Y": "*fp16", "B": "*fp16", "LO": "*i64", "D": "*fp16", "SC": "*i8", "MN": "*i8", "M": "i32",
           "N": "i32", "NU": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_lo": "i32", "stride_d": "i32",
           "stride_s": "i32"}
    sig.update({k: "constexpr" for k in ("BLOCK_M", "U", "EVEN", "SHIFT", "ZERO", "SUPER", "ZP", "FP4", "HAS_BIAS")})
    specs = []
    for kind, rows in ((int4_kind(128, True), 1), (int4_kind(128, True), 4), (int4_kind(32, False), 1),
                       (KINDS["Q4_0"], 1), (NVFP4_KIND, 1), (NVFP4_KIND, 4)):
        s = {**sig, "D": "*fp32"} if kind.fp4 else sig
        specs.append(CompileSpec(s, {"BLOCK_M": rows, "U": 64, "EVEN": rows == 1, "SHIFT": kind.super.bit_length() - 1,
                                     "ZERO": kind.zero, "SUPER": kind.super,
                                     "ZP": kind.zero_points, "FP4": kind.fp4, "HAS_BIAS": kind.name == "Q4_0"},
                                 f"{kind.name} m{rows}"))
    return specs


register_kernel("quant.half2_matmul", _half2_matmul_kernel, _specs())
