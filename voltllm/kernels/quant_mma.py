"""4-bit kept-quantized weights times a few (1-16 per weight read) activation rows with the dot products on tensor
cores (sm_80+): the decode GEMV for cards whose bandwidth outruns their issue rate.

On the H200 the packed-fp16 form (quant_half2.py) issues ~3.4 instructions per weight, about half of them the
f16x2 products and their conversions to fp32: at 4.8 TB/s of 4-bit codes that is more than the SMs can issue
(docs/kernels.md). Here the products run as `mma.sync.m16n8k16` (fp16 in, fp32 accumulate), which leaves the
dequantization (the same prmt / lop3 / f16x2 words as quant_half2, scale applied in fp16) as the per-weight work.

Fragment mapping (one warp = 8 groups g x 4 lanes t; lane = 4 g + t, as the mma's fragments are laid out):
- lane (g, t) holds weight rows R + g and R + g + 8 (the mma's A rows g and g + 8) of the units u0 + 4 j + t: all
  lanes with the same t hold the same units, so the mma's k slots of lane t (2t, 2t + 1, 2t + 8, 2t + 9) are one
  word's activation pairs for every row. A word (8 weights of a row) is 4 f16x2 registers = 4 pairs: pairs 0 / 1
  feed one mma (k slots 2t.. / 2t + 8..), pairs 2 / 3 a second one.
- lane (g, t) holds B's column g: activation row g's pairs at the same units. So D[i, j] = row R + i times
  activation row j, and lane (g, t) ends with rows R + g, R + g + 8 times activation rows 2t, 2t + 1 (c0 .. c3):
  up to 8 activation rows share one read of the weights; with WIDE (9+ rows) a second B fragment (activation rows
  8..15) meets the same dequantized A registers in two more mmas per word.
Each lane's tensors are [4, 8, KU, 4] (t x g x its KU units per iteration x the unit's 4 words: Triton's layout
follows the loads' contiguity, then the dims in index order, so t and g first give exactly lane = 4 g + t, the
words stay in the thread, the warps take KU). Accumulators
are per (unit, word) slot, summed once at the end (across warps too: the warps split K).
Only for sm_80+ (mma.m16n8k16 with fp16 inputs): the compat route keeps quant_half2 (on a V100 that form is
bandwidth-bound anyway).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.pdl import pdl_enter
from voltllm.kernels.quant_gemv import checked_operands
from voltllm.kernels.quant_half2 import _fp4_weights, _int4_weights, _unit_scale_words, operands_ok
from voltllm.kernels.registry import CompileSpec, register_kernel
from voltllm.model.layers.gguf_planes import NVFP4_KIND, int4_kind

__triton_helpers__ = ("_word_mma", "_unit_pairs")

MAX_ROWS = 8  # activation rows per program: B's 8 columns


@triton.jit
def _word_mma(a0, a1, a2, a3, b0, b1, b2, b3, x0, x1, x2, x3, c0, c1, c2, c3):
    """Two m16n8k16 mmas over one word of weight rows g (a*) and g + 8 (b*): pairs 0 / 1 (a0, a1 with x0, x1) then
    pairs 2 / 3, accumulated onto (c0 .. c3) in fp32."""
    return tl.inline_asm_elementwise(
        asm="""
        mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $8, $5, $9}, {$12, $13},
            {$16, $17, $18, $19};
        mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$6, $10, $7, $11}, {$14, $15},
            {$0, $1, $2, $3};
        """,
        constraints="=&f,=&f,=&f,=&f,r,r,r,r,r,r,r,r,r,r,r,r,f,f,f,f",
        args=[a0, a1, a2, a3, b0, b1, b2, b3, x0, x1, x2, x3, c0, c1, c2, c3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _unit_pairs(X32, base, mask):  # X32: the activation rows' pointers [1, 8, 1, 1]
    """A unit's 16 activation pairs as its 4 words' (pair 0, 1, 2, 3), each [4, 8, KU, 4]: low-nibble pairs
    base + 2 w + (0, 1), high-nibble pairs base + 16 + 2 w + (0, 1). Read as 16-byte vectors [4, 8, KU, 2, 4] (the
    vector dims last, so the lanes stay on t and g) and split inside the thread."""
    v = tl.arange(0, 2)[None, None, None, :, None]
    i = tl.arange(0, 4)[None, None, None, None, :]
    p = X32[:, :, :, :, None] + base[:, :, :, :, None]
    m = mask[:, :, :, :, None]
    lo = tl.load(p + v * 4 + i, mask=m, other=0)  # [4, 8, KU, 2, 4]: pairs base + 4 v + i
    hi = tl.load(p + 16 + v * 4 + i, mask=m, other=0)
    shape: tl.constexpr = (4, 8, lo.shape[2], 2, 2, 2)
    words: tl.constexpr = (4, 8, lo.shape[2], 4)
    lo_e, lo_o = tl.split(tl.reshape(lo, shape))  # [4, 8, KU, 2 (v), 2 (word in v)]: word = 2 v + its index
    hi_e, hi_o = tl.split(tl.reshape(hi, shape))
    return (tl.reshape(lo_e, words), tl.reshape(lo_o, words), tl.reshape(hi_e, words), tl.reshape(hi_o, words))


@triton.jit
def _quant_mma_kernel(X, Y, B, LO, D, SC, MN, M, N, NU, stride_xm, stride_ym, stride_lo, stride_d, stride_s,
                      KU: tl.constexpr, ZERO: tl.constexpr, SUPER: tl.constexpr, SHIFT: tl.constexpr,
                      ZP: tl.constexpr, FP4: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
                      STAGES: tl.constexpr, WIDE: tl.constexpr):
    """Y[M, N] = X[M, K] W^T (+ B) for 16 weight rows and up to 8 activation rows per program (see the module
    docstring); WIDE: up to 16, as two B fragments (columns g and 8 + g) multiplied by the same dequantized weight
    registers (twice the mmas and activation loads, one weight read). LO: int32 words [N, K / 8]; X: fp16 pairs as
    int32 [M, K / 2]; strides in those views' elements."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    # [4 (t), 8 (g), KU, 4 (word)]: t and g first, so Triton's layout puts the lanes on them (lane = 4 g + t) and the
    # warps on KU (they split K); the words (contiguous 16 bytes) stay in the thread
    t = tl.arange(0, 4)[:, None, None, None]
    g = tl.arange(0, 8)[None, :, None, None]
    j = tl.arange(0, KU)[None, None, :, None]
    w = tl.arange(0, 4)[None, None, None, :]
    row_a = tl.minimum(pid_n * 16 + g, N - 1)  # rows past N repeat the last (their stores are masked)
    row_b = tl.minimum(pid_n * 16 + 8 + g, N - 1)
    MR: tl.constexpr = 16 if WIDE else 8  # activation rows per program
    xrow = pid_m * MR + g  # B's column g
    xmask_row = xrow < M
    xmask_wide = xrow + 8 < M  # the second fragment's column g: activation row 8 + g
    acc0 = tl.zeros((4, 8, KU, 4), dtype=tl.float32)
    acc1 = tl.zeros((4, 8, KU, 4), dtype=tl.float32)
    acc2 = tl.zeros((4, 8, KU, 4), dtype=tl.float32)
    acc3 = tl.zeros((4, 8, KU, 4), dtype=tl.float32)
    acc4 = tl.zeros((4, 8, KU, 4), dtype=tl.float32)  # WIDE only: activation rows 8..15 of the program
    acc5 = tl.zeros((4, 8, KU, 4), dtype=tl.float32)
    acc6 = tl.zeros((4, 8, KU, 4), dtype=tl.float32)
    acc7 = tl.zeros((4, 8, KU, 4), dtype=tl.float32)
    for u0 in tl.range(0, NU, 4 * KU, num_stages=STAGES):
        u = u0 + j * 4 + t  # [4, 1, KU, 1]
        um = u < NU
        wa = tl.load(LO + row_a * stride_lo + u * 4 + w, mask=um, other=0)
        wb = tl.load(LO + row_b * stride_lo + u * 4 + w, mask=um, other=0)
        sa_lo, sa_hi, za_lo, za_hi = _unit_scale_words(D, SC, MN, row_a, u, um, stride_d, stride_s, ZERO, SUPER,
                                                       SHIFT, ZP, FP4)
        sb_lo, sb_hi, zb_lo, zb_hi = _unit_scale_words(D, SC, MN, row_b, u, um, stride_d, stride_s, ZERO, SUPER,
                                                       SHIFT, ZP, FP4)
        if FP4:
            a0, a1, a2, a3 = _fp4_weights(wa, sa_lo, sa_hi)
            b0, b1, b2, b3 = _fp4_weights(wb, sb_lo, sb_hi)
        else:
            a0, a1, a2, a3 = _int4_weights(wa, sa_lo, sa_hi, za_lo, za_hi)
            b0, b1, b2, b3 = _int4_weights(wb, sb_lo, sb_hi, zb_lo, zb_hi)
        base = (u >> 1) * 32 + (u & 1) * 8  # the unit's first activation pair
        x0, x1, x2, x3 = _unit_pairs(X + xrow * stride_xm, base, um & xmask_row)
        acc0, acc1, acc2, acc3 = _word_mma(a0, a1, a2, a3, b0, b1, b2, b3, x0, x1, x2, x3, acc0, acc1, acc2, acc3)
        if WIDE:
            v0, v1, v2, v3 = _unit_pairs(X + (xrow + 8) * stride_xm, base, um & xmask_wide)
            acc4, acc5, acc6, acc7 = _word_mma(a0, a1, a2, a3, b0, b1, b2, b3, v0, v1, v2, v3, acc4, acc5, acc6,
                                               acc7)
    # lane (g, t): c0 / c1 = rows R + g times activation rows 2t / 2t + 1, c2 / c3 = rows R + g + 8
    tt = tl.arange(0, 4)[:, None]
    gg = tl.arange(0, 8)[None, :]
    for half in tl.static_range(2):
        n = pid_n * 16 + half * 8 + gg  # [1, 8]
        bias = tl.zeros((1, 8), dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(B + n, mask=n < N, other=0.0).to(tl.float32)
        for odd in tl.static_range(2):
            acc = (acc0 if odd == 0 else acc1) if half == 0 else (acc2 if odd == 0 else acc3)
            y = tl.sum(tl.sum(acc, 3), 2) + bias  # [4, 8]: (lane t, row) -> activation row 2t + odd
            m = pid_m * MR + 2 * tt + odd
            tl.store(Y + m * stride_ym + n, y.to(Y.dtype.element_ty), mask=(n < N) & (m < M))
            if WIDE:
                acc = (acc4 if odd == 0 else acc5) if half == 0 else (acc6 if odd == 0 else acc7)
                y = tl.sum(tl.sum(acc, 3), 2) + bias
                tl.store(Y + (m + 8) * stride_ym + n, y.to(Y.dtype.element_ty), mask=(n < N) & (m + 8 < M))


def quant_mma_matmul(x: torch.Tensor, planes, bias: Optional[torch.Tensor] = None,
                     out: Optional[torch.Tensor] = None, config: tuple = (4, 4)) -> torch.Tensor:
    """x [M, K] fp16 times the 4-bit W [N, K]^T (+ bias) -> [M, N] fp16 on tensor cores (sm_80+). config: (KU units
    per lane and iteration across the program's warps, num_warps[, stages]). Operands as quant_half2.operands_ok."""
    x, out = checked_operands(x, planes, out)
    if not operands_ok(x, planes, out):
        raise ValueError("quant_mma_matmul needs fp16 activations with even strides and 4-bit planes of that form")
    m = x.shape[0]
    ku, warps = config[0], config[1]
    stages = config[2] if len(config) > 2 else 1
    nu = planes.k // 32
    ku = max(1, min(ku, triton.next_power_of_2(triton.cdiv(nu, 4))))
    warps = min(warps, ku)  # the warps split KU (more would hold copies)
    kind = planes.kind
    lo32 = planes.lo.view(torch.int32)
    x32 = x.view(torch.int32)
    sc = planes.sc if planes.sc is not None else planes.lo
    mn = planes.mn if planes.mn is not None else planes.lo
    wide = m > MAX_ROWS  # 9+ rows: 16 per program (one weight read for twice the rows)
    grid = (triton.cdiv(planes.n, 16), triton.cdiv(m, 2 * MAX_ROWS if wide else MAX_ROWS))
    _quant_mma_kernel[grid](
        x32, out, bias if bias is not None else out, lo32, planes.d, sc, mn, m, planes.n, nu, x32.stride(0),
        out.stride(0), lo32.stride(0), planes.d.stride(0), sc.stride(0) if planes.sc is not None else mn.stride(0),
        KU=ku, ZERO=kind.zero, SUPER=kind.super, SHIFT=kind.super.bit_length() - 1, ZP=kind.zero_points,
        FP4=kind.fp4, HAS_BIAS=bias is not None, STAGES=stages, WIDE=wide, num_warps=warps, **pdl.launch_options())
    return out


def supported_device(device: torch.device) -> bool:
    """mma.m16n8k16 with fp16 inputs: sm_80 and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


_SIGNATURE = {"X": "*i32", "Y": "*fp16", "B": "*fp16", "LO": "*i32", "D": "*fp16", "SC": "*i8", "MN": "*i8", "M": "i32",
              "N": "i32", "NU": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_lo": "i32", "stride_d": "i32",
              "stride_s": "i32", **{k: "constexpr" for k in ("KU", "ZERO", "SUPER", "SHIFT", "ZP", "FP4", "HAS_BIAS",
                                                              "PDL", "STAGES", "WIDE")}}


def _specs() -> list[CompileSpec]:
    specs = []
    for kind in (int4_kind(128, True), NVFP4_KIND):
        for wide in (False, True):
            consts = {"KU": 4, "ZERO": kind.zero, "SUPER": kind.super, "SHIFT": kind.super.bit_length() - 1,
                      "ZP": kind.zero_points, "FP4": kind.fp4, "HAS_BIAS": False, "PDL": False, "STAGES": 1,
                      "WIDE": wide}
            specs.append(CompileSpec({**_SIGNATURE, "D": "*fp32"} if kind.fp4 else _SIGNATURE, consts,
                                     kind.name + ("-wide" if wide else "")))
    return specs


# sm_80+ only (never launched on the compat route): registered for the SASS tools, not for the sm_70 / sm_75 gate
register_kernel("quant.mma_matmul", _quant_mma_kernel, _specs(), compat=False)
