"""GGUF-quantized weights kept quantized on the device, as "planes" the Triton kernels read with aligned loads.

llama.cpp's blocks interleave a block's scales with its codes (18-, 20-, 34-, 144- or 210-byte records), which
a GPU can only read byte by byte. At load time each weight is re-laid (torch ops, on the target device) into
separate arrays of the same information:

- `lo`  uint8 [N, K/2]: the low 4 bits of every code. Per 64-element group of a row, byte j holds element j in
  its low nibble and element 32 + j in its high nibble (Q4_K's own order).
- `hi`  the code bits above 4, or None: 4 bits (Q8_0) in `lo`'s layout [N, K/2]; 2 bits (Q6_K) [N, K/4], where
  byte j (< 16) of a 64-group holds elements j, 16 + j, 32 + j, 48 + j at bits 0, 2, 4, 6; 1 bit (Q5_0, Q5_1,
  Q5_K) [N, K/8], where byte j (< 8) of a 64-group holds elements j + 8 s at bit s.
- `d`   fp16 [N, K/SUPER]: the block scale (SUPER = 32 for the legacy types Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and
  IQ4_NL, 256 for the K-quants and IQ4_XS).
- `m`   fp16 [N, K/SUPER] or None: Q4_1's / Q5_1's offset, Q2_K's / Q4_K's / Q5_K's dmin.
- `sc`, `mn`  int8 [N, K/SUB] or None: the K-quants' / IQ4_XS's sub-block scale (and Q2_K's / Q4_K's / Q5_K's
  sub-block min), SUB = 32 (Q4_K, Q5_K, IQ4_XS) or 16 (Q2_K, Q3_K, Q6_K); for the int4 kinds with zero points, `mn`
  holds the group's zero point [N, K/SUPER].

The low-bit types are re-laid into these same forms: Q3_K's element d * (sc - 32) * (low2 - (hbit ? 0 : 4)) becomes
the 3-bit code low2 + 4 hbit in `lo` with ZERO 4 and the int8 sub-scale sc - 32 per 16; Q2_K's d * (s & 15) * q -
dmin * (s >> 4) a 2-bit code in `lo` with `sc` / `mn` per 16 (Q4_K's form with 16-element sub-blocks). IQ4_NL's
d * kvalues[i] and IQ4_XS's d * (ls - 32) * kvalues[i] (kvalues: a 16-entry non-linear table, IQ4_VALUES) keep the
index i in `lo` (`nl` kinds, IQ4_XS with its int8 sub-scale ls - 32 per 32); the one step of their own is the
lookup, index -> kvalues[i] + 128 (IQ4_CODES), after which the code is an 8-bit one with ZERO 128 (Q8_0's). The
kernels' fma(d * sc, code, -ZERO * d * sc [- dmin * mn]) gives the same fp32 values: d * sc * code is exact (at most
11 + 5 + 8 = 24 significant bits), so the one rounding is that of the `gguf` package's last operation.

The 4-bit AWQ / GPTQ checkpoints (model/loader/int4_checkpoint.py) use the same planes: `int4_kind(group)` is a
kind whose `d` is the group's scale and, with zero points (AWQ, asymmetric GPTQ), `mn` its integer zero, so an
element dequantizes to d * (q - zero) exactly (fp16 scale times a 5-bit integer: exact in fp32). The 8-bit GPTQ
checkpoints use `int8_kind(group)`: their codes in `lo` / `hi` like Q8_0 (ZERO 128), `d` the group's scale and, with
zero points (asymmetric GPTQ), `mn` the group's zero minus 128 (int8), so d * (q - 128 - mn) = d * (q - zero), again
exact (an 11-bit significand times a 9-bit integer); so do compressed-tensors' int8 layers with zero points
(model/loader/compressed_tensors_checkpoint.py) and bitsandbytes' 8-bit (LLM.int8()) layers, symmetric with the row's
SCB / 127 rounded to fp16 in `d`, repeated per 64 inputs (model/loader/bnb_checkpoint.py). FP8 (E4M3)
checkpoints (model/loader/fp8_checkpoint.py) keep their 8-bit codes in `lo` / `hi` like Q8_0 and an fp32 `d` per 128
inputs (FP8_KIND): an element is d * e4m3(q). NVFP4 checkpoints (model/loader/nvfp4_checkpoint.py) keep their E2M1
codes in `lo`, their E4M3 per-16 scale codes in `sc` (raw bits, int8 [N, K/16]) and the tensor's fp32 global scale in
`d`, repeated per row and 256 inputs (NVFP4_KIND: 4 + 0.5 + 0.125 = 4.625 bits per weight): an element is
e2m1(q) * e4m3(sc) * d, the first product exact in fp32 (at most 6 significant bits), so the value is rounded once.
bitsandbytes 4-bit layers (model/loader/bnb_checkpoint.py) keep their NF4 / FP4 table index in `lo` and each block's
absmax in `d` (fp16, one per `super` = block of 64 or 128 inputs; bnb_kind): an element is table[q] * d, the table's
fp32 value in [-1, 1] times the absmax, rounded once as bitsandbytes does (4.25 bits per weight in blocks of 64).

An element with code q dequantizes to (d * sc) * (q - ZERO) + m (legacy types, no `sc`) or
- (dmin * mn) (Q4_K, Q5_K), computed in fp32 in the order the `gguf` package's numpy code uses, so the values equal
the ones the fp16 load path used (tests check this bit for bit). Bits per weight stay the format's own: Q4_0
4.5, Q4_1 5, Q5_0 5.5, Q5_1 6, Q8_0 8.5, Q4_K 4.625 and Q5_K 5.625 (their 6-bit sub-scales widened to int8),
Q6_K 6.56, IQ4_NL 4.5 and IQ4_XS 4.31 (4.25 in the file). Q3_K and Q2_K take more than in the file, still 3-3.5x
less than fp16: Q3_K 4.56 (3.44 in the file), Q2_K 5.125 (2.625).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

GROUP = 64  # elements per `lo` group (32 bytes of nibbles)


@dataclass(frozen=True)
class PlaneKind:
    """How one GGUF type's codes and scales combine (the Triton kernels' constexprs)."""
    name: str
    block: int  # elements per GGUF block
    block_bytes: int
    hi_bits: int  # 0, 2 or 4 code bits above the low nibble
    zero: int  # code offset
    has_min: bool
    sub: int  # elements per sub-block scale, 0 when the type has none
    super: int  # elements per `d` (and `m`)
    zero_points: bool = False  # `mn` holds a per-`super` integer zero point (AWQ / GPTQ int4): w = d * (q - zero)
    # (the int8 kinds: mn = zero - ZERO, so w = d * (q - ZERO - mn))
    fp8: bool = False  # the 8-bit codes are E4M3 floats (FP8 checkpoints): w = d * e4m3(q), `d` fp32
    fp4: bool = False  # the 4-bit codes are E2M1 floats, `sc` E4M3 codes per `sub` (NVFP4): w = e2m1(q) * e4m3(sc) * d
    nl: bool = False  # the 4-bit codes index IQ4's non-linear table (IQ4_CODES: its values + ZERO 128)
    bnb: str = ""  # "nf4" / "fp4": the 4-bit codes index bitsandbytes' table of floats in [-1, 1], w = d * table[q]


KINDS = {k.name: k for k in (
    PlaneKind("Q4_0", 32, 18, hi_bits=0, zero=8, has_min=False, sub=0, super=32),
    PlaneKind("Q4_1", 32, 20, hi_bits=0, zero=0, has_min=True, sub=0, super=32),
    PlaneKind("Q8_0", 32, 34, hi_bits=4, zero=128, has_min=False, sub=0, super=32),
    PlaneKind("Q5_0", 32, 22, hi_bits=1, zero=16, has_min=False, sub=0, super=32),
    PlaneKind("Q5_1", 32, 24, hi_bits=1, zero=0, has_min=True, sub=0, super=32),
    PlaneKind("Q5_K", 256, 176, hi_bits=1, zero=0, has_min=True, sub=32, super=256),
    PlaneKind("Q4_K", 256, 144, hi_bits=0, zero=0, has_min=True, sub=32, super=256),
    PlaneKind("Q6_K", 256, 210, hi_bits=2, zero=32, has_min=False, sub=16, super=256),
    # the low-bit types, re-laid into the forms above (module docstring): Q3_K's 3-bit code low2 + 4 hbit with the
    # zero 4, Q2_K's 2-bit code with a 4-bit scale and min per 16, the IQ4 types' 4-bit table index
    PlaneKind("Q3_K", 256, 110, hi_bits=0, zero=4, has_min=False, sub=16, super=256),
    PlaneKind("Q2_K", 256, 84, hi_bits=0, zero=0, has_min=True, sub=16, super=256),
    PlaneKind("IQ4_NL", 32, 18, hi_bits=0, zero=128, has_min=False, sub=0, super=32, nl=True),
    PlaneKind("IQ4_XS", 256, 136, hi_bits=0, zero=128, has_min=False, sub=32, super=256, nl=True),
)}
# the byte offsets of each GGUF block's fp16 scale (and min) fields
_F16_FIELDS = {"Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}
# IQ4_NL's / IQ4_XS's 16 non-linear values (llama.cpp's kvalues_iq4nl), indexed by the 4-bit code
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4_CODES = tuple(v + 128 for v in IQ4_VALUES)  # the same as 8-bit codes with ZERO 128 (what the kernels look up)


def int4_kind(group: int, zero_points: bool) -> PlaneKind:
    """The kind of a 4-bit checkpoint quantized in groups of `group` input features (a multiple of 16), with integer
    zero points per group (AWQ, asymmetric GPTQ) or the fixed zero 8 (symmetric GPTQ)."""
    if group % 16:
        raise ValueError(f"int4 group size {group} is not a multiple of 16")
    name = f"INT4_G{group}" + ("_ZP" if zero_points else "")
    return PlaneKind(name, group, 0, hi_bits=0, zero=0 if zero_points else 8, has_min=False, sub=0, super=group,
                     zero_points=zero_points)


def int8_kind(group: int, zero_points: bool) -> PlaneKind:
    """The kind of an 8-bit GPTQ checkpoint (or a compressed-tensors int8 one with zero points) quantized in groups of
    `group` input features (a multiple of 16): codes q in `lo` / `hi` (Q8_0's layout, ZERO 128); with zero points
    `mn` holds zero - 128 per group (int8: zeros 0..255; compressed-tensors' signed zero point as it is), without
    them the zero is the fixed 128 (symmetric GPTQ; bitsandbytes' 8-bit rows, int8_kind(64, False))."""
    if group % 16:
        raise ValueError(f"int8 group size {group} is not a multiple of 16")
    name = f"INT8_G{group}" + ("_ZP" if zero_points else "")
    return PlaneKind(name, group, 0, hi_bits=4, zero=128, has_min=False, sub=0, super=group, zero_points=zero_points)


# FP8 (E4M3) weights with an fp32 scale per 128 inputs of a row (block-wise checkpoints repeat their 128 x 128
# block's scale on each of its rows; per-tensor and per-channel scales are repeated along the row)
FP8_KIND = PlaneKind("FP8_E4M3", 128, 0, hi_bits=4, zero=0, has_min=False, sub=0, super=128, fp8=True)
# NVFP4 (E2M1 weights, an E4M3 scale per 16 inputs, an fp32 global scale per row): the global is repeated per 256
# inputs of a row (the last one covers a partial span when K is not a multiple of 256), so shards with different
# global scales (q / k / v, gate / up) stack into one merged projection
NVFP4_KIND = PlaneKind("NVFP4", 16, 0, hi_bits=0, zero=0, has_min=False, sub=16, super=256, fp4=True)
# bitsandbytes' 4-bit block sizes kept quantized (64: what transformers writes and vLLM quantizes at load; 128: the
# other common one); a block of other inputs is dequantized at load (model/loader/bnb_checkpoint.py)
BNB_BLOCKSIZES = (64, 128)


def bnb_kind(quant_type: str, blocksize: int) -> PlaneKind:
    """The kind of a bitsandbytes 4-bit weight (NF4 / FP4) in blocks of `blocksize` inputs (BNB_BLOCKSIZES): the
    code's table value times the block's absmax, held in `d` (fp16)."""
    if quant_type not in ("nf4", "fp4") or blocksize not in BNB_BLOCKSIZES:
        raise ValueError(f"bitsandbytes {quant_type} in blocks of {blocksize}: kept quantized for nf4 / fp4 in blocks "
                         f"of {' / '.join(map(str, BNB_BLOCKSIZES))}")
    return PlaneKind(f"BNB_{quant_type.upper()}_B{blocksize}", blocksize, 0, hi_bits=0, zero=0, has_min=False, sub=0,
                     super=blocksize, bnb=quant_type)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes (bit 3 sign, bits 2-1 exponent of bias 1, bit 0 mantissa; exponent 0 is
    the subnormal m * 0.5): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).to(torch.float32)
    mag = torch.where(e == 0, m * 0.5, torch.ldexp(1 + m * 0.5, e - 1))
    return torch.where((c & 8) != 0, -mag, mag)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E4M3 (float8_e4m3fn) codes given as uint8 / int8 bits."""
    return codes.contiguous().view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def supports(type_name: str, in_features: int) -> bool:
    """Whether a GGUF type is kept quantized for a weight with this many input features (the planes need whole
    64-element groups; other types and shapes are dequantized to the compute dtype at load)."""
    kind = KINDS.get(type_name)
    return kind is not None and in_features % max(GROUP, kind.block) == 0


@dataclass
class Planes:
    """One quantized weight [N, K] (or a row range of several with the same kind), see the module docstring."""
    kind: PlaneKind
    n: int
    k: int
    lo: torch.Tensor
    hi: Optional[torch.Tensor]
    d: torch.Tensor
    m: Optional[torch.Tensor]
    sc: Optional[torch.Tensor]
    mn: Optional[torch.Tensor]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.lo, self.hi, self.d, self.m, self.sc, self.mn) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.lo.device


# --------------------------------------------------------------------------------------------------
# GGUF blocks -> codes in element order + scales
# --------------------------------------------------------------------------------------------------
@dataclass
class Unpacked:
    codes: torch.Tensor  # uint8 [N, K], element order
    d: torch.Tensor  # fp16 [N, K/super]
    m: Optional[torch.Tensor]
    sc: Optional[torch.Tensor]  # int8 [N, K/sub]
    mn: Optional[torch.Tensor]


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 at `offset` of each block [N, nb, bytes] -> [N, nb]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 16] of a 32-block (low nibble: element j, high: 16 + j) -> codes [..., 32]."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of 6-bit scales and mins (8 sub-blocks) -> (sc, mn) [..., 8]."""
    lo4, hi4 = s[..., 0:4], s[..., 4:8]
    last = s[..., 8:12]
    sc = torch.cat([lo4 & 63, (last & 15) | ((lo4 >> 6) << 4)], dim=-1)
    mn = torch.cat([hi4 & 63, (last >> 4) | ((hi4 >> 6) << 4)], dim=-1)
    return sc, mn


def unpack_blocks(raw: torch.Tensor, kind: PlaneKind, k: int) -> Unpacked:
    """GGUF blocks, uint8 [N, K / block * block_bytes] -> codes in element order and the scales."""
    n = raw.shape[0]
    nb = k // kind.block
    b = raw.reshape(n, nb, kind.block_bytes)
    m = sc = mn = None
    if kind.name == "Q4_0":
        d, codes = _f16(b, 0), _nibbles(b[..., 2:18])
    elif kind.name == "Q4_1":
        d, m, codes = _f16(b, 0), _f16(b, 2), _nibbles(b[..., 4:20])
    elif kind.name == "Q8_0":
        d = _f16(b, 0)
        codes = (b[..., 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    elif kind.name in ("Q5_0", "Q5_1"):
        d = _f16(b, 0)
        m = _f16(b, 2) if kind.name == "Q5_1" else None
        at = 4 if kind.name == "Q5_1" else 2
        qh = b[..., at:at + 4].contiguous().view(torch.int32)  # element i's fifth bit is bit i (little-endian)
        bits = (qh >> torch.arange(32, dtype=torch.int32, device=qh.device)) & 1
        codes = _nibbles(b[..., at + 4:at + 20]) | (bits.to(torch.uint8) << 4)
    elif kind.name in ("Q4_K", "Q5_K"):
        d, m = _f16(b, 0), _f16(b, 2)
        sc, mn = _q4k_scales(b[..., 4:16])
        at = 48 if kind.name == "Q5_K" else 16
        qs = b[..., at:at + 128].reshape(n, nb, 4, 1, 32)
        codes = torch.cat([qs & 15, qs >> 4], dim=3)  # chunk c: elements 64c + l (low), 64c + 32 + l (high)
        if kind.name == "Q5_K":  # bit i of qh[l] is the fifth bit of sub-block i's element l
            qh = b[..., 16:48].reshape(n, nb, 1, 32)
            bits = (qh >> torch.arange(8, dtype=torch.uint8, device=qh.device).reshape(8, 1)) & 1
            codes = codes.reshape(n, nb, 8, 32) | (bits << 4)
    elif kind.name in ("Q2_K", "Q3_K"):
        # qs: 2 halves of 32 bytes; bits 2t of byte l of half h are element 128 h + 32 t + l (8 runs of 32)
        qs = b[..., 16:80] if kind.name == "Q2_K" else b[..., 32:96]
        qs = qs.reshape(n, nb, 2, 1, 32)
        codes = torch.cat([(qs >> (2 * t)) & 3 for t in range(4)], dim=3).reshape(n, nb, 8, 32)
        if kind.name == "Q2_K":  # per 16: the scale in the low nibble, the min in the high one
            d, m = _f16(b, 80), _f16(b, 82)
            sc, mn = b[..., 0:16] & 15, b[..., 0:16] >> 4
        else:  # bit i of hmask[l]: run i's element l; a set bit adds 4 (q = low2 - 4 where it is clear)
            hm = b[..., 0:32].reshape(n, nb, 1, 32)
            codes = codes | (((hm >> torch.arange(8, dtype=torch.uint8, device=hm.device).reshape(8, 1)) & 1) << 2)
            s, d = b[..., 96:108], _f16(b, 108)
            lo4, hi2 = s[..., 0:8], s[..., 8:12]  # 6-bit scales: low 4 bits, then 2 bits per sub-block at 2 (j // 4)
            sc = (torch.cat([lo4 & 15, lo4 >> 4], dim=-1) | (torch.cat([(hi2 >> (2 * i)) & 3 for i in range(4)],
                                                                       dim=-1) << 4)).to(torch.int16) - 32
    elif kind.name in ("IQ4_NL", "IQ4_XS"):
        d = _f16(b, 0)
        if kind.name == "IQ4_NL":
            idx = _nibbles(b[..., 2:18])
        else:  # sub-block j's 6-bit scale: nibble j % 2 of scales_l[j // 2] | bits 2 j of scales_h << 4, minus 32
            sh = b[..., 2:4].contiguous().view(torch.int16)[..., 0:1].to(torch.int32) & 0xFFFF
            lo4 = b[..., 4:8].to(torch.int32)
            ls = torch.stack([lo4 & 15, lo4 >> 4], dim=-1).reshape(n, nb, 8)
            sc = (ls | (((sh >> (2 * torch.arange(8, dtype=torch.int32, device=sh.device))) & 3) << 4)) - 32
            idx = _nibbles(b[..., 8:136].reshape(n, nb, 8, 16))
        codes = idx  # the table index (`nl`: looked up when dequantized)
    elif kind.name == "Q6_K":
        ql = b[..., 0:128].reshape(n, nb, 2, 2, 32)  # (half, first / second 32 bytes, l)
        qh = b[..., 128:192].reshape(n, nb, 2, 32)
        sc, d = b[..., 192:208].view(torch.int8), _f16(b, 208)
        low = torch.stack([ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], dim=3)
        high = torch.stack([(qh >> (2 * t)) & 3 for t in range(4)], dim=3)
        codes = low | (high << 4)  # [n, nb, half, section, 32]: element 128 * half + 32 * section + l
    else:
        raise ValueError(f"GGUF type {kind.name} has no plane layout")
    codes = codes.reshape(n, k)
    sub_per_row = None if not kind.sub else k // kind.sub
    return Unpacked(codes=codes, d=d.reshape(n, -1), m=None if m is None else m.reshape(n, -1),
                    sc=None if sc is None else sc.reshape(n, sub_per_row).to(torch.int8),
                    mn=None if mn is None else mn.reshape(n, sub_per_row).to(torch.int8))


def dequantize_unpacked(u: Unpacked, kind: PlaneKind) -> torch.Tensor:
    """fp32 [N, K], in the same operation order as the `gguf` package's numpy code (so the same values)."""
    n, k = u.codes.shape
    d = u.d.to(torch.float32).repeat_interleave(kind.super, dim=1)[:, :k]
    if kind.fp4:  # the code times its E4M3 scale is exact in fp32; the global scale rounds once
        return (e2m1_values(u.codes) * e4m3_values(u.sc).repeat_interleave(kind.sub, dim=1)) * d
    if kind.fp8:
        return d * u.codes.view(torch.float8_e4m3fn).to(torch.float32)
    if kind.bnb:  # bitsandbytes' order: the table's fp32 value times the absmax, one rounding
        from voltllm.model.loader.bnb_codec import table

        return table(kind.bnb).to(u.codes.device)[u.codes.long()] * d
    codes = torch.tensor(IQ4_CODES, dtype=torch.uint8, device=u.codes.device)[u.codes.long()] if kind.nl else u.codes
    q = codes.to(torch.float32) - kind.zero if kind.zero else codes.to(torch.float32)
    if kind.zero_points:
        return d * (q - u.mn.to(torch.float32).repeat_interleave(kind.super, dim=1))
    if kind.sub:
        d = d * u.sc.to(torch.float32).repeat_interleave(kind.sub, dim=1)
    w = d * q
    if kind.has_min:
        m = u.m.to(torch.float32).repeat_interleave(kind.super, dim=1)
        w = w - m * u.mn.to(torch.float32).repeat_interleave(kind.sub, dim=1) if kind.sub else w + m
    return w


# --------------------------------------------------------------------------------------------------
# codes <-> planes
# --------------------------------------------------------------------------------------------------
def _pair_nibbles(c: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit values [N, K] -> [N, K/2]: per 64-group, byte j = element j | element 32 + j << 4."""
    n, k = c.shape
    g = c.reshape(n, k // GROUP, 2, 32)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def _split_nibbles(b: torch.Tensor) -> torch.Tensor:
    n, half = b.shape
    g = b.reshape(n, half // 32, 1, 32)
    return torch.cat([g & 15, g >> 4], dim=2).reshape(n, half * 2)


def _pack_1bit(c: torch.Tensor) -> torch.Tensor:
    """1-bit values [N, K] -> [N, K/8]: per 64-group, byte j (< 8) = elements j + 8 s at bit s."""
    n, k = c.shape
    g = c.reshape(n, k // GROUP, 8, 8)
    out = torch.zeros(n, k // GROUP, 8, dtype=torch.uint8, device=c.device)
    for s in range(8):
        out |= g[:, :, s] << s
    return out.reshape(n, k // 8)


def _unpack_1bit(b: torch.Tensor) -> torch.Tensor:
    n, eighth = b.shape
    g = b.reshape(n, eighth // 8, 1, 8)
    return torch.cat([(g >> s) & 1 for s in range(8)], dim=2).reshape(n, eighth * 8)


def _pack_2bit(c: torch.Tensor) -> torch.Tensor:
    """2-bit values [N, K] -> [N, K/4]: per 64-group, byte j (< 16) = elements j + 16 s at bits 2 s."""
    n, k = c.shape
    g = c.reshape(n, k // GROUP, 4, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 2) | (g[:, :, 2] << 4) | (g[:, :, 3] << 6)).reshape(n, k // 4)


def _unpack_2bit(b: torch.Tensor) -> torch.Tensor:
    n, quarter = b.shape
    g = b.reshape(n, quarter // 16, 1, 16)
    return torch.cat([(g >> (2 * s)) & 3 for s in range(4)], dim=2).reshape(n, quarter * 4)


def to_planes(u: Unpacked, kind: PlaneKind) -> Planes:
    n, k = u.codes.shape
    lo = _pair_nibbles(u.codes & 15)
    hi = None
    if kind.hi_bits == 4:
        hi = _pair_nibbles(u.codes >> 4)
    elif kind.hi_bits == 2:
        hi = _pack_2bit(u.codes >> 4)
    elif kind.hi_bits == 1:
        hi = _pack_1bit(u.codes >> 4)
    return Planes(kind=kind, n=n, k=k, lo=lo.contiguous(), hi=None if hi is None else hi.contiguous(),
                  d=u.d.contiguous(), m=None if u.m is None else u.m.contiguous(),
                  sc=None if u.sc is None else u.sc.contiguous(), mn=None if u.mn is None else u.mn.contiguous())


def from_planes(p: Planes) -> Unpacked:
    codes = _split_nibbles(p.lo)
    if p.kind.hi_bits == 4:
        codes = codes | (_split_nibbles(p.hi) << 4)
    elif p.kind.hi_bits == 2:
        codes = codes | (_unpack_2bit(p.hi) << 4)
    elif p.kind.hi_bits == 1:
        codes = codes | (_unpack_1bit(p.hi) << 4)
    return Unpacked(codes=codes, d=p.d, m=p.m, sc=p.sc, mn=p.mn)


def dequantize_planes(p: Planes) -> torch.Tensor:
    """The torch reference: fp32 [N, K] (what the Triton kernels must reproduce)."""
    return dequantize_unpacked(from_planes(p), p.kind)


def planes_from_blocks(raw: torch.Tensor, type_name: str, k: int, device: Optional[torch.device] = None) -> Planes:
    """GGUF blocks [N, row bytes] (uint8, any device) -> Planes on `device` (the re-layout runs there)."""
    kind = KINDS[type_name]
    if device is not None:
        raw = raw.to(device)
    return to_planes(unpack_blocks(raw, kind, k), kind)


def concat_rows(parts: list[Planes]) -> Planes:
    """Planes of one kind stacked along N (a merged qkv / gate_up projection)."""
    kind, k = parts[0].kind, parts[0].k

    def cat(name: str) -> Optional[torch.Tensor]:
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts, dim=0)

    return Planes(kind=kind, n=sum(p.n for p in parts), k=k, lo=cat("lo"), hi=cat("hi"), d=cat("d"), m=cat("m"),
                  sc=cat("sc"), mn=cat("mn"))


def map_planes(p: Planes, fn, n: int) -> Planes:
    """Planes of `n` rows made by applying fn to each plane tensor (row slices, gathers, copies)."""
    def f(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else fn(t)

    return Planes(kind=p.kind, n=n, k=p.k, lo=f(p.lo), hi=f(p.hi), d=f(p.d), m=f(p.m), sc=f(p.sc), mn=f(p.mn))


def row_band(p: Planes, start: int, end: int) -> Planes:
    """Rows [start, end) as views (no copy)."""
    return map_planes(p, lambda t: t[start:end], end - start)


def take_rows(p: Planes, index: torch.Tensor) -> Planes:
    """The planes of rows `index` (an embedding lookup's rows), in that order."""
    return map_planes(p, lambda t: t.index_select(0, index), index.numel())


def random_blocks(type_name: str, n: int, k: int, generator: Optional[torch.Generator] = None,
                  scale: float = 0.02) -> torch.Tensor:
    """Random GGUF blocks [N, row bytes] (CPU uint8) for tests and benchmarks: every code and sub-scale bit
    pattern, finite fp16 block scales (and mins) of about `scale` (the `gguf` package cannot quantize K-quants)."""
    kind = KINDS[type_name]
    nb = k // kind.block
    raw = torch.randint(0, 256, (n, nb, kind.block_bytes), dtype=torch.uint8, generator=generator)
    offsets = _F16_FIELDS.get(kind.name, (0, 2) if kind.has_min else (0,))
    for off in offsets:
        v = (torch.randn(n, nb, generator=generator) * scale).to(torch.float16)
        raw[..., off:off + 2] = v.view(torch.uint8).reshape(n, nb, 2)
    return raw.reshape(n, nb * kind.block_bytes)


# --------------------------------------------------------------------------------------------------
# tensor-parallel shards of planes (voltllm.distributed.sharding)
# --------------------------------------------------------------------------------------------------
def column_multiple(kind: PlaneKind) -> int:
    """The input-column granularity at which planes of `kind` can be cut: whole `lo` groups (64 inputs, also the
    1- / 2-bit `hi` packing's unit), whole blocks, sub-blocks and `d` spans. NVFP4's `d` is one global scale repeated
    along the row, so it sets no boundary."""
    m = math.lcm(GROUP, kind.block, kind.sub or 1)
    return m if kind.fp4 else math.lcm(m, kind.super)


def col_band(p: Planes, start: int, end: int) -> Planes:
    """Input columns [start, end) as planes of their own (copies, so the whole weight can be freed); start and end
    must be multiples of column_multiple(p.kind) (checked: the caller names the layer)."""
    mult = column_multiple(p.kind)
    if start % mult or end % mult or not 0 <= start < end <= p.k:
        raise ValueError(f"columns [{start}, {end}) of a {p.kind.name} weight with {p.k} inputs: the cut must fall on "
                         f"multiples of {mult} inputs")

    def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        if t is p.d and p.kind.fp4:  # one value per row, repeated per 256 inputs (a partial last span)
            return t[:, :-(-(end - start) // p.kind.super)].contiguous()
        per = p.k // t.shape[1]  # inputs per column of this plane (p.k // t.shape[1] exactly: aligned kinds)
        return t[:, start // per:end // per].contiguous()

    return Planes(kind=p.kind, n=p.n, k=end - start, lo=cut(p.lo), hi=cut(p.hi), d=cut(p.d), m=cut(p.m),
                  sc=cut(p.sc), mn=cut(p.mn))


def row_shard(p: Planes, start: int, n: int) -> Planes:
    """Rows [start, start + n) as copies (so the whole weight can be freed), all-zero planes for rows past the end
    (the vocabulary's padded tail: d = m = 0 makes every kind's value 0)."""
    end = min(start + n, p.n)

    def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        part = t[start:end]
        return torch.cat([part, part.new_zeros((n - part.shape[0],) + tuple(t.shape[1:]))]) if part.shape[0] < n \
            else part.clone()

    return map_planes(p, cut, n)
