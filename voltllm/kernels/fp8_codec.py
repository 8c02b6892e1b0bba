"""Software FP8 codec (E4M3FN and E5M2) with integer bit operations, for GPUs without FP8 hardware.

V100 (sm_70) and T4 (sm_75) have no FP8 conversion instructions, and Triton refuses the fp8 types
there. An FP8 tensor on those GPUs is stored as uint8 and encoded/decoded here with integer
operations on the float32 bit pattern. Three layers, bit-exact with each other (NaN payloads aside
where an fp16 conversion is involved):

* plain-torch reference (`encode_e4m3`, `decode_e4m3`, `encode_e5m2`, `decode_e5m2`): runs on any
  device, equals torch's `x.to(torch.float8_e4m3fn)` / `.to(torch.float8_e5m2)` bit for bit;
* Triton device helpers (`fp32_to_e4m3`, `e4m3_to_fp32`, ...; listed in `__triton_helpers__`) that
  other kernels call to decode uint8 pages in registers;
* two Triton kernels (`fp8_encode_kernel`, `fp8_decode_kernel`, registered for the sm_70 gate) that
  apply a per-tensor scale: stored = encode(x / scale), decoded = decode(u8) * scale.

Semantics (those of torch 2.13's own conversions, checked in tests/unit/test_fp8_codec.py):

=========  =====  ====  ==========  ==============================  ===========================
format     bias   max   min sub.    overflow (finite or inf)        NaN
=========  =====  ====  ==========  ==============================  ===========================
e4m3fn     7      448   2**-9       saturates to +-448 (0x7E/0xFE)  0x7F / 0xFF (sign kept)
e5m2       15     57344 2**-16      +-inf (0x7C/0xFC), as IEEE RNE  0x7F / 0xFF (sign kept)
=========  =====  ====  ==========  ==============================  ===========================

Rounding is round-to-nearest-even everywhere (subnormals included); -0.0 encodes to 0x80.
fp16/bf16 inputs are widened to fp32 first (exact), so there is one rounding only.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel

__triton_helpers__ = (
    "_fp32_to_fp8_bits", "fp32_to_e4m3", "fp32_to_e5m2", "fp32_to_fp8",
    "_fp8_finite_to_fp32_bits", "e4m3_to_fp32", "e5m2_to_fp32", "fp8_to_fp32",
    "e4m3_to_fp16", "e5m2_to_fp16", "fp8_to_fp16",
)

# FMT constexpr values of the kernels
FP8_E4M3 = 0
FP8_E5M2 = 1
# E4M3 through the GPU's own conversions (sm_89+): decode cvt e4m3x2 -> f16x2, encode cvt.rn.satfinite (RNE, overflow
# and inf to +-448, as the software encoder): the attention kernels' and the RoPE launch's KV_FMT / FMT on the native
# route of such GPUs. Codes and values equal the software codec's (GPU test test_hardware_e4m3_codec_equals_software;
# NaN: some NaN); the fp32 decode treats it as FP8_E4M3. Never on the compat route (the sm_70 / sm_75 gate rejects
# the cvt).
FP8_E4M3_HW = 2
_FORMATS = {"e4m3": FP8_E4M3, "e4m3fn": FP8_E4M3, "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3,
            "e5m2": FP8_E5M2, "fp8_e5m2": FP8_E5M2}
FP8_MAX = {FP8_E4M3: 448.0, FP8_E5M2: 57344.0}
TORCH_FP8_DTYPES = {FP8_E4M3: torch.float8_e4m3fn, FP8_E5M2: torch.float8_e5m2}


def fp8_format(fmt: Union[str, int]) -> int:
    """'e4m3' | 'fp8' | 'fp8_e4m3' -> FP8_E4M3; 'e5m2' | 'fp8_e5m2' -> FP8_E5M2 (ints pass through)."""
    if isinstance(fmt, int) and fmt in (FP8_E4M3, FP8_E5M2):
        return fmt
    try:
        return _FORMATS[str(fmt).lower()]
    except KeyError:
        raise ValueError(f"unknown fp8 format {fmt!r}; expected e4m3 or e5m2") from None


# ---------------------------------------------------------------------------------------------
# plain-torch reference
# ---------------------------------------------------------------------------------------------
# (exponent bits, mantissa bits, bias, largest code before NaN handling)
_E4M3 = (4, 3, 7, 0x7E)  # saturate: everything above 448 (and inf) -> 448
_E5M2 = (5, 2, 15, 0x7C)  # no saturation: overflow rounds to inf (0x7C)


def _check_float(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"fp8 encode takes fp16/bf16/fp32, got {x.dtype}")


def _encode_bits(x: torch.Tensor, params: tuple[int, int, int, int]) -> torch.Tensor:
    _, mb, bias, max_code = params
    bits = x.to(torch.float32).view(torch.int32)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal target: drop (23 - mb) mantissa bits with round-to-nearest-even, rebias the exponent
    shift = 23 - mb
    lsb = (a >> shift) & 1
    normal = ((a + ((1 << (shift - 1)) - 1) + lsb) >> shift) - ((127 - bias) << mb)
    # subnormal target: code = RNE(m * 2**(e - 150) / 2**(1 - bias - mb)) = RNE(m >> s)
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    s = (151 - bias - mb - e).clamp(1, 31)
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(torch.int32)
    code = torch.where(e >= 128 - bias, normal, sub).clamp(max=max_code)
    code = torch.where(a > 0x7F800000, 0x7F, code)
    return (code | sign).to(torch.uint8)


def _decode_bits(u8: torch.Tensor, params: tuple[int, int, int, int]) -> torch.Tensor:
    """float32 bit patterns (int32) of the codes, NaN payloads exactly as torch produces them."""
    eb, mb, bias, _ = params
    if u8.dtype != torch.uint8:
        raise TypeError(f"fp8 decode takes uint8 codes, got {u8.dtype}")
    c = u8.to(torch.int32)
    sign = (c & 0x80) << 24  # int32, wraps to the sign bit
    e = (c >> mb) & ((1 << eb) - 1)
    m = c & ((1 << mb) - 1)
    normal = ((e + (127 - bias)) << 23) | (m << (23 - mb))
    # subnormal m * 2**(1 - bias - mb): normalise on the leading bit p of m
    p = torch.zeros_like(m)
    for k in range(1, mb):
        p += (m >= (1 << k)).to(torch.int32)
    sub = ((p + (128 - bias - mb)) << 23) | ((m << (23 - p)) & 0x7FFFFF)
    sub = torch.where(m == 0, 0, sub)
    bits = torch.where(e == 0, sub, normal)
    emax = (1 << eb) - 1
    if mb == 3:  # e4m3fn: only S.1111.111 is NaN, there is no inf
        bits = torch.where((e == emax) & (m == 7), 0x7F800000 | (m << 20), bits)
    else:  # e5m2: IEEE-like specials; NaN quieted (bit 22) as torch does through fp16
        special = torch.where(m == 0, 0x7F800000, 0x7FC00000 | (m << 21))
        bits = torch.where(e == emax, special, bits)
    return bits | sign


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16/fp32 -> uint8 E4M3FN codes; equals x.to(torch.float8_e4m3fn).view(torch.uint8)."""
    _check_float(x)
    return _encode_bits(x, _E4M3)


def encode_e5m2(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16/fp32 -> uint8 E5M2 codes; equals x.to(torch.float8_e5m2).view(torch.uint8)."""
    _check_float(x)
    return _encode_bits(x, _E5M2)


def _bits_to(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        # every fp8 value fits bf16 exactly: keep the high half; torch gives NaN as 0x7FC0 (no sign)
        bits = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, bits)
        return ((bits >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    return bits.view(torch.float32).to(dtype)


def decode_e4m3(u8: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 E4M3FN codes -> dtype; equals u8.view(torch.float8_e4m3fn).to(dtype), NaN bits included."""
    return _bits_to(_decode_bits(u8, _E4M3), dtype)


def decode_e5m2(u8: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 E5M2 codes -> dtype; equals u8.view(torch.float8_e5m2).to(dtype), NaN bits included."""
    return _bits_to(_decode_bits(u8, _E5M2), dtype)


def encode_fp8_ref(x: torch.Tensor, fmt: Union[str, int] = "e4m3") -> torch.Tensor:
    return encode_e4m3(x) if fp8_format(fmt) == FP8_E4M3 else encode_e5m2(x)


def decode_fp8_ref(u8: torch.Tensor, fmt: Union[str, int] = "e4m3",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return decode_e4m3(u8, dtype) if fp8_format(fmt) == FP8_E4M3 else decode_e5m2(u8, dtype)


def _scale_value(scale: Union[float, torch.Tensor, None], device: torch.device) -> torch.Tensor:
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32).reshape(-1)[:1]
    return torch.tensor([float(scale)], dtype=torch.float32, device=device)


def scaled_encode_ref(x: torch.Tensor, scale: Union[float, torch.Tensor, None] = None,
                      fmt: Union[str, int] = "e4m3") -> torch.Tensor:
    """Reference of fp8_encode_kernel: encode(fp32(x) / scale) (IEEE fp32 division)."""
    _check_float(x)
    s = _scale_value(scale, x.device)
    return encode_fp8_ref(x.to(torch.float32) / s, fmt)


def scaled_decode_ref(u8: torch.Tensor, scale: Union[float, torch.Tensor, None] = None,
                      fmt: Union[str, int] = "e4m3", dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Reference of fp8_decode_kernel: dtype(decode_fp32(u8) * scale) (fp32 multiply, one rounding)."""
    s = _scale_value(scale, u8.device)
    return (decode_fp8_ref(u8, fmt, torch.float32) * s).to(dtype)


# ---------------------------------------------------------------------------------------------
# Triton device helpers: integer ops + fp32/fp16 arithmetic only (no tl.float8*, no bf16)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _fp32_to_fp8_bits(x, MB: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MB
    lsb = (a >> SHIFT) & 1
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + lsb) >> SHIFT) - ((127 - BIAS) << MB)
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum(151 - BIAS - MB - e, 1), 31)
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    code = tl.where(e >= 128 - BIAS, normal, sub)
    code = tl.minimum(code, MAX_CODE)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def fp32_to_e4m3(x):
    """fp32 (or fp16) tensor -> uint8 E4M3FN codes (RNE, saturating to +-448, NaN -> 0x7F|sign)."""
    return _fp32_to_fp8_bits(x, 3, 7, 0x7E)


@triton.jit
def fp32_to_e5m2(x):
    """fp32 (or fp16) tensor -> uint8 E5M2 codes (RNE, overflow -> inf, NaN -> 0x7F|sign)."""
    return _fp32_to_fp8_bits(x, 2, 15, 0x7C)


@triton.jit
def fp32_to_fp8(x, FMT: tl.constexpr):
    if FMT == 2:  # FP8_E4M3_HW: the hardware conversion (cvt.rn.satfinite, sm_89+): the software encoder's codes
        out = x.to(tl.float32).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    elif FMT == 1:
        out = fp32_to_e5m2(x)
    else:
        out = fp32_to_e4m3(x)
    return out


@triton.jit
def _fp8_finite_to_fp32_bits(ci, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """fp32 bit patterns (sign excluded) of the finite fp8 codes ci (int32, 0..255), exact: normals rebias the
    exponent; a subnormal m * 2**(1 - BIAS - MBITS) is renormalised at its leading one (bit p of m)."""
    e = (ci >> MBITS) & ((1 << (7 - MBITS)) - 1)
    m = ci & ((1 << MBITS) - 1)
    normal = ((e + (127 - BIAS)) << 23) | (m << (23 - MBITS))
    p = (m >= 2).to(tl.int32) + (m >= 4).to(tl.int32)
    sub = ((p + (128 - BIAS - MBITS)) << 23) | ((m << (23 - p)) & 0x7FFFFF)
    sub = tl.where(m == 0, 0, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def e4m3_to_fp32(c):
    """uint8 E4M3FN codes -> fp32, exact (NaN code -> NaN with the sign kept)."""
    ci = c.to(tl.int32) & 0xFF
    bits = _fp8_finite_to_fp32_bits(ci, 3, 7)
    bits = tl.where((ci & 0x7F) == 0x7F, 0x7FF00000, bits)
    return (bits | ((ci & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e5m2_to_fp32(c):
    """uint8 E5M2 codes -> fp32, exact (inf and NaN kept, NaN quieted)."""
    ci = c.to(tl.int32) & 0xFF
    bits = _fp8_finite_to_fp32_bits(ci, 2, 15)
    m = ci & 0x3
    special = tl.where(m == 0, 0x7F800000, 0x7FC00000 | (m << 21))
    bits = tl.where(((ci >> 2) & 0x1F) == 31, special, bits)
    return (bits | ((ci & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def fp8_to_fp32(c, FMT: tl.constexpr):
    if FMT != 1:  # FP8_E4M3, FP8_E4M3_HW
        out = e4m3_to_fp32(c)
    else:
        out = e5m2_to_fp32(c)
    return out


@triton.jit
def e4m3_to_fp16(c):
    """uint8 E4M3FN codes -> fp16, exact, with integer ops and one fp16 multiply by 2**8.

    (c & 0x7F) << 7 reads the E4M3 exponent/mantissa as an fp16 with bias 15 instead of 7
    (subnormals included); multiplying by 2**(15 - 7) rebiases it exactly.
    """
    ci = c.to(tl.int32) & 0xFF
    mag = ((ci & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
    bits = mag.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    bits = tl.where((ci & 0x7F) == 0x7F, 0x7E00, bits)
    bits = bits | ((ci & 0x80) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def e5m2_to_fp16(c):
    """uint8 E5M2 codes -> fp16: E5M2 is the high byte of an fp16, so this is a shift (exact)."""
    ci = c.to(tl.int32) & 0xFF
    return (ci << 8).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def fp8_to_fp16(c, FMT: tl.constexpr):
    if FMT == 2:  # FP8_E4M3_HW: the hardware conversion (sm_89+)
        out = c.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif FMT == 0:
        out = e4m3_to_fp16(c)
    else:
        out = e5m2_to_fp16(c)
    return out


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
_BLOCK = 1024


@triton.jit
def fp8_encode_kernel(x_ptr, out_ptr, scale_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = encode(fp32(x[i]) / scale), uint8 codes."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    y = tl.math.div_rn(x, scale)
    tl.store(out_ptr + offs, fp32_to_fp8(y, FMT), mask=mask)


@triton.jit
def fp8_decode_kernel(u8_ptr, out_ptr, scale_ptr, n, FMT: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = out_dtype(decode(u8[i]) * scale), the product in fp32.

    Decodes through the fp16 helpers (exact, fewer integer ops); kv_fp8_gather_kernel uses the
    fp32 ones, so the gate and the interpreter tests cover both.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(u8_ptr + offs, mask=mask, other=0)
    scale = tl.load(scale_ptr)
    y = fp8_to_fp16(c, FMT).to(tl.float32) * scale
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _codec_specs(kind: str) -> list[CompileSpec]:
    # the e5m2 variant differs only in the codec helper: one float type represents it
    specs = []
    for fmt_name, fmt, fdt in (("e4m3", FP8_E4M3, "fp16"), ("e4m3", FP8_E4M3, "fp32"), ("e5m2", FP8_E5M2, "fp16")):
        src, dst = (f"*{fdt}", "*u8") if kind == "encode" else ("*u8", f"*{fdt}")
        first = "x_ptr" if kind == "encode" else "u8_ptr"
        sig = {first: src, "out_ptr": dst, "scale_ptr": "*fp32", "n": "i32", "FMT": "constexpr",
               "BLOCK": "constexpr"}
        specs.append(CompileSpec(signature=sig, constexprs={"FMT": fmt, "BLOCK": _BLOCK}, label=f"{fdt} {fmt_name}"))
    return specs


register_kernel("fp8.encode", fp8_encode_kernel, _codec_specs("encode"), compat=True)
register_kernel("fp8.decode", fp8_decode_kernel, _codec_specs("decode"), compat=True)


def fp8_encode(x: torch.Tensor, scale: Union[float, torch.Tensor, None] = None, fmt: Union[str, int] = "e4m3",
               out: Optional[torch.Tensor] = None, use_triton: Optional[bool] = None) -> torch.Tensor:
    """uint8 codes of x / scale. Triton on CUDA tensors (or use_triton=True), torch reference otherwise."""
    f = fp8_format(fmt)
    use_triton = x.is_cuda if use_triton is None else use_triton
    if not use_triton:
        res = scaled_encode_ref(x, scale, f)
        return res if out is None else out.copy_(res)
    if x.dtype not in (torch.float16, torch.float32):
        raise TypeError(f"fp8_encode kernel takes fp16/fp32, got {x.dtype}")
    x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    n = x.numel()
    if n:
        fp8_encode_kernel[(triton.cdiv(n, _BLOCK),)](x, out, _scale_value(scale, x.device), n,
                                                      FMT=f, BLOCK=_BLOCK)
    return out


def fp8_decode(u8: torch.Tensor, scale: Union[float, torch.Tensor, None] = None, fmt: Union[str, int] = "e4m3",
               dtype: torch.dtype = torch.float16, out: Optional[torch.Tensor] = None,
               use_triton: Optional[bool] = None) -> torch.Tensor:
    """dtype(decode(u8) * scale). Triton on CUDA tensors (or use_triton=True), torch reference otherwise."""
    f = fp8_format(fmt)
    use_triton = u8.is_cuda if use_triton is None else use_triton
    if not use_triton:
        res = scaled_decode_ref(u8, scale, f, dtype)
        return res if out is None else out.copy_(res)
    if dtype not in (torch.float16, torch.float32):
        raise TypeError(f"fp8_decode kernel writes fp16/fp32, got {dtype}")
    u8 = u8.contiguous()
    if out is None:
        out = torch.empty(u8.shape, dtype=dtype, device=u8.device)
    n = u8.numel()
    if n:
        fp8_decode_kernel[(triton.cdiv(n, _BLOCK),)](u8, out, _scale_value(scale, u8.device), n,
                                                      FMT=f, BLOCK=_BLOCK)
    return out
