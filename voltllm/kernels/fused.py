"""Fused elementwise Triton kernels for the per-layer hot path: RMSNorm (+ residual add), per-head QK-norm,
rotate-half RoPE (optionally fused with the QK-norm), and SiLU-and-mul. One launch each.

Why: at small batch a decode step is launch-bound. The torch versions (voltllm.model.layers) cost about
8 kernels per RMSNorm, about 15 per RoPE and 2-3 per SiLU-mul, per layer; each of these is one launch here.

Numerics (the same on every route, and what keeps the SM70 compat route safe in fp16): every load is
converted to fp32, all arithmetic (sum of squares, rsqrt, rotation, sigmoid) is fp32, and results are
rounded to the storage dtype only where the torch reference rounds too (the residual sum, the norm output
before RoPE, silu(gate) before the multiply, each final store), so the fused path computes the same
function as the unfused torch code up to fp32 rounding. No bf16 is ever created inside a kernel: bf16
appears only when the caller's tensors are bf16 (native GPUs).

Every kernel wants the last dimension contiguous (stride 1); other strides are passed in, so q/k views
into a fused qkv projection output are handled in place without copies. No wrapper synchronises with the
host; all allocate only their outputs (or nothing when `out` is given), so they can be captured in CUDA graphs.

Entry points (each has a `*_ref` torch reference with the same signature, used by the tests):
  rms_norm(x, weight, eps, offset=0.0, out=None) -> out
  fused_add_rms_norm(x, residual, weight, eps, offset=0.0, out=None) -> (out, residual)  [residual in place]
  rms_norm_heads(x, weight, eps, offset=0.0, out=None) -> out          x [T, nH, D], strided T/head dims ok
  gated_rms_norm_heads(x, gate, weight, eps, out=None) -> out          rms_norm_heads(x) * silu(gate), fp32
  rope_inplace(q, k, positions, cos, sin, rotary_dim, cache_write=None) -> (q, k)    [q, k in place]
  qk_norm_rope_inplace(q, k, q_weight, k_weight, eps, positions, cos, sin, rotary_dim, offset=0.0,
                       cache_write=None) -> (q, k)                                     [q, k in place]
      cache_write (voltllm.attention.backend.CacheWrite): the same launch also stores the rotated K rows and
      the V rows in the paged KV cache (float, or fp8 codes of x / scale with CacheWrite.fmt >= 0: what the
      attention backend's kv_write / write_kv_fp8 would do next: one kernel
      less per layer, which the decode profiles say is worth ~1-2 us per layer per step).
  silu_and_mul(x, out=None) -> out
  sigmoid_gate_mul(x, gate, out=None) -> out                           x * sigmoid(gate), x / gate [T, nH, D],
                                                                       strided T/head dims ok (gated attention)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.fp8_codec import fp32_to_fp8
from voltllm.kernels.pdl import pdl_enter
from voltllm.kernels.registry import CompileSpec, register_kernel

__triton_helpers__ = ("_norm_rope_heads", "_store_kv_rows")

_MAX_SINGLE_TILE = 16384  # rows up to this many elements stay in registers; longer rows loop over tiles
_LOOP_TILE = 4096


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    X, Res, W, Out, Gate,
    stride_xt, stride_xh, stride_rt, stride_rh, stride_ot, stride_oh, stride_gt, stride_gh,
    n_h, N, eps, offset,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_TILES: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_GATE: tl.constexpr, PDL: tl.constexpr,
):
    """Rows of N elements addressed as [t, h] (program (t, head block) owns BLOCK_H rows of token t).
    HAS_RES: s = x + res is rounded to Res's dtype, stored into Res, and normalised instead of x.
    HAS_GATE: the normalised row is multiplied by silu(gate row) in fp32 (the Gated DeltaNet output norm)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = offs_h < n_h
    x_rows = X + t * stride_xt + offs_h[:, None] * stride_xh
    r_rows = Res + t * stride_rt + offs_h[:, None] * stride_rh
    o_rows = Out + t * stride_ot + offs_h[:, None] * stride_oh
    g_rows = Gate + t * stride_gt + offs_h[:, None] * stride_gh
    offs_n = tl.arange(0, BLOCK_N)
    if NUM_TILES == 1:
        mn = offs_n < N
        m = mh[:, None] & mn[None, :]
        xf = tl.load(x_rows + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_rows + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
            s = (xf + r).to(Res.dtype.element_ty)
            tl.store(r_rows + offs_n[None, :], s, mask=m)
            xf = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
        w = tl.load(W + offs_n, mask=mn, other=0.0).to(tl.float32) + offset
        y = xf * rstd[:, None] * w[None, :]
        if HAS_GATE:
            gz = tl.load(g_rows + offs_n[None, :], mask=m, other=0.0).to(tl.float32)
            y = y * (gz / (1.0 + tl.exp(-gz)))
        tl.store(o_rows + offs_n[None, :], y.to(Out.dtype.element_ty), mask=m)
    else:
        # pass 1: (residual add and store) + sum of squares; pass 2: re-read (L2-hot) and normalise
        acc = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for i in range(NUM_TILES):
            cols = i * BLOCK_N + offs_n
            m = mh[:, None] & (cols < N)[None, :]
            xf = tl.load(x_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(r_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
                s = (xf + r).to(Res.dtype.element_ty)
                tl.store(r_rows + cols[None, :], s, mask=m)
                xf = s.to(tl.float32)
            acc += xf * xf
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)
        tl.debug_barrier()  # the residual tiles stored above are read back below (also when Out aliases X)
        for i in range(NUM_TILES):
            cols = i * BLOCK_N + offs_n
            mn = cols < N
            m = mh[:, None] & mn[None, :]
            if HAS_RES:
                xf = tl.load(r_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
            else:
                xf = tl.load(x_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
            w = tl.load(W + cols, mask=mn, other=0.0).to(tl.float32) + offset
            y = xf * rstd[:, None] * w[None, :]
            if HAS_GATE:
                gz = tl.load(g_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
                y = y * (gz / (1.0 + tl.exp(-gz)))
            tl.store(o_rows + cols[None, :], y.to(Out.dtype.element_ty), mask=m)


@triton.jit
def _norm_rope_heads(
    Base, stride_t, stride_h, t, head0, n_heads, W, c, s, eps, offset, half, D, tail,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    NORM: tl.constexpr, HAS_TAIL: tl.constexpr,
):
    """In place on heads [head0, head0 + BLOCK_H) of token t: optional RMSNorm over all D channels, then
    rotate-half on the first 2 * half channels. c, s: [BLOCK_HALF] fp32 cos/sin of the token's position."""
    offs_h = head0 + tl.arange(0, BLOCK_H)
    mh = offs_h < n_heads
    offs_a = tl.arange(0, BLOCK_HALF)
    ma = offs_a < half
    m = mh[:, None] & ma[None, :]
    rows = Base + t * stride_t + offs_h[:, None] * stride_h
    p1 = rows + offs_a[None, :]
    p2 = p1 + half
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=m, other=0.0).to(tl.float32)
    if NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if HAS_TAIL:
            offs_c = tl.arange(0, BLOCK_TAIL)
            mc = offs_c < tail
            mt = mh[:, None] & mc[None, :]
            pt = rows + 2 * half + offs_c[None, :]
            xt = tl.load(pt, mask=mt, other=0.0).to(tl.float32)
            ss += tl.sum(xt * xt, axis=1)
        rstd = tl.rsqrt(ss / D + eps)[:, None]
        w1 = tl.load(W + offs_a, mask=ma, other=0.0).to(tl.float32) + offset
        w2 = tl.load(W + half + offs_a, mask=ma, other=0.0).to(tl.float32) + offset
        # round to the storage dtype as the unfused path does between its norm and its rotation
        x1 = (x1 * rstd * w1[None, :]).to(Base.dtype.element_ty).to(tl.float32)
        x2 = (x2 * rstd * w2[None, :]).to(Base.dtype.element_ty).to(tl.float32)
        if HAS_TAIL:
            wt = tl.load(W + 2 * half + offs_c, mask=mc, other=0.0).to(tl.float32) + offset
            tl.store(pt, (xt * rstd * wt[None, :]).to(Base.dtype.element_ty), mask=mt)
    c2 = c[None, :]
    s2 = s[None, :]
    tl.store(p1, (x1 * c2 - x2 * s2).to(Base.dtype.element_ty), mask=m)
    tl.store(p2, (x2 * c2 + x1 * s2).to(Base.dtype.element_ty), mask=m)


@triton.jit
def _store_kv_rows(K, V, KV, SlotMapping, KScale, VScale, t, head0, n_heads, stride_kt, stride_kh, stride_vt,
                   stride_vh, stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, n_slots, D,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, FMT: tl.constexpr):
    """K and V rows of heads [head0, head0 + BLOCK_H) of token t into the paged cache (layout (2, blocks,
    PAGE, heads, D)) at SlotMapping[t]; slot -1 and tokens t >= n_slots are skipped (CUDA-graph padding).
    FMT >= 0: a uint8 fp8 cache, codes of x / scale by fp8_codec.fp32_to_fp8 (what kv_fp8's write kernel stores;
    FP8_E4M3_HW: the GPU's conversion, the same codes)."""
    slot = tl.load(SlotMapping + t, mask=t < n_slots, other=-1).to(tl.int64)
    offs_h = head0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_h[:, None] < n_heads) & (offs_d[None, :] < D) & (slot >= 0)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=m)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=m)
    dst = KV + (slot // PAGE) * stride_c_blk + (slot % PAGE) * stride_c_slot + offs_h[:, None] * stride_c_head
    dst = dst + offs_d[None, :]
    if FMT >= 0:
        k = fp32_to_fp8(tl.math.div_rn(k.to(tl.float32), tl.load(KScale)), FMT)
        v = fp32_to_fp8(tl.math.div_rn(v.to(tl.float32), tl.load(VScale)), FMT)
    tl.store(dst, k.to(KV.dtype.element_ty), mask=m)
    tl.store(dst + stride_c_kv, v.to(KV.dtype.element_ty), mask=m)


@triton.jit
def _qk_rope_kernel(
    Q, K, Pos, Cos, Sin, QW, KW, V, KV, SlotMapping, KScale, VScale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, stride_vt, stride_vh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    n_qh, n_kh, n_qblocks, half, D, tail, eps, offset, n_slots,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    NORM: tl.constexpr, HAS_TAIL: tl.constexpr, WRITE_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, PDL: tl.constexpr, FMT: tl.constexpr,
):
    """Program (t, b): head block b of q (b < n_qblocks) or of k (the rest), token t; in place. WRITE_KV:
    a k program then stores its rotated K rows and the same heads' V rows in the paged cache (FMT >= 0: fp8
    codes with the scales KScale / VScale)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_a = tl.arange(0, BLOCK_HALF)
    ma = offs_a < half
    c = tl.load(Cos + pos * stride_cos + offs_a, mask=ma, other=0.0).to(tl.float32)
    s = tl.load(Sin + pos * stride_sin + offs_a, mask=ma, other=0.0).to(tl.float32)
    if b < n_qblocks:
        _norm_rope_heads(Q, stride_qt, stride_qh, t, b * BLOCK_H, n_qh, QW, c, s, eps, offset, half, D, tail,
                         BLOCK_H, BLOCK_HALF, BLOCK_TAIL, NORM, HAS_TAIL)
    else:
        head0 = (b - n_qblocks) * BLOCK_H
        _norm_rope_heads(K, stride_kt, stride_kh, t, head0, n_kh, KW, c, s, eps, offset,
                         half, D, tail, BLOCK_H, BLOCK_HALF, BLOCK_TAIL, NORM, HAS_TAIL)
        if WRITE_KV:
            tl.debug_barrier()  # the rotated rows were stored by other threads of this program
            _store_kv_rows(K, V, KV, SlotMapping, KScale, VScale, t, head0, n_kh, stride_kt, stride_kh, stride_vt,
                           stride_vh, stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, n_slots, D,
                           BLOCK_H, BLOCK_D, PAGE, FMT)


@triton.jit
def _silu_mul_kernel(X, Out, stride_xt, stride_ot, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Out[t, :] = silu(X[t, :I]) * X[t, I:2I]; silu in fp32, rounded to Out's dtype before the multiply
    (as torch's F.silu(gate) * up does)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(X + t * stride_xt + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(X + t * stride_xt + I + offs, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * stride_ot + offs, (a * u).to(Out.dtype.element_ty), mask=m)


@triton.jit
def _sigmoid_gate_mul_kernel(X, Gate, Out, stride_xt, stride_xh, stride_gt, stride_gh, stride_ot, stride_oh,
                             N, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Out[t, h, :] = X[t, h, :] * sigmoid(Gate[t, h, :]) over the N = heads * D elements of token t; sigmoid in
    fp32, rounded to Out's dtype before the multiply (as torch's x * torch.sigmoid(gate) does)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    h = offs // D
    d = offs % D
    x = tl.load(X + t * stride_xt + h * stride_xh + d, mask=m, other=0.0).to(tl.float32)
    g = tl.load(Gate + t * stride_gt + h * stride_gh + d, mask=m, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * stride_ot + h * stride_oh + d, (x * s).to(Out.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------------
# registry: representative fp16 / fp32 specializations for the sm_70 / sm_75 gate (no bf16 there)
# ------------------------------------------------------------------------------------------------
_ACTS = ("fp16", "fp32")


def _norm_specs() -> list[CompileSpec]:
    specs = []
    for act in _ACTS:
        for res in (False, True):
            for bh, bn, tiles, what, gate in ((1, 4096, 1, "H4096", False), (1, 1024, 1, "H576", False),
                                              (16, 128, 1, "heads D128", False), (16, 128, 1, "heads D128", True),
                                              (1, _LOOP_TILE, 8, "H32768 looped", False)):
                if res and (bh > 1 or gate):
                    continue
                sig = {"X": f"*{act}", "Res": f"*{act}", "W": "*fp32" if gate else f"*{act}", "Out": f"*{act}",
                       "Gate": f"*{act}",
                       **{n: "i32" for n in ("stride_xt", "stride_xh", "stride_rt", "stride_rh", "stride_ot",
                                             "stride_oh", "stride_gt", "stride_gh", "n_h", "N")},
                       "eps": "fp32", "offset": "fp32",
                       "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "NUM_TILES": "constexpr",
                       "HAS_RES": "constexpr", "HAS_GATE": "constexpr", "PDL": "constexpr"}
                specs.append(CompileSpec(sig, {"BLOCK_H": bh, "BLOCK_N": bn, "NUM_TILES": tiles, "HAS_RES": res,
                                               "HAS_GATE": gate, "PDL": False},
                                         label=f"{act} {what}{' +res' if res else ''}{' +gate' if gate else ''}"))
    return specs


def _rope_specs() -> list[CompileSpec]:
    specs = []
    for act in _ACTS:
        for norm in (False, True):
            for bh, bhalf, btail, has_tail, d, what in ((16, 64, 1, False, 128, "D128 full"),
                                                        (8, 32, 256, True, 256, "D256 rot64")):
                # the fused KV-cache store: fp16 activations with an fp16 cache or e4m3 / e5m2 codes (the compat
                # route's cases)
                for write, fmt in (((False, -1), (True, -1), (True, 0), (True, 1)) if act == "fp16"
                                   else ((False, -1),)):
                    if fmt == 1 and (norm or d != 128):
                        continue  # e5m2 differs from e4m3 only in the encoder: one spec
                    sig = {"Q": f"*{act}", "K": f"*{act}", "Pos": "*i64", "Cos": "*fp32", "Sin": "*fp32",
                           "QW": f"*{act}", "KW": f"*{act}", "V": f"*{act}", "KV": "*u8" if fmt >= 0 else f"*{act}",
                           "SlotMapping": "*i64", "KScale": "*fp32", "VScale": "*fp32",
                           **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_cos",
                                                 "stride_sin", "stride_vt", "stride_vh")},
                           "stride_c_kv": "i64",
                           **{n: "i32" for n in ("stride_c_blk", "stride_c_slot", "stride_c_head", "n_qh", "n_kh",
                                                 "n_qblocks", "half", "D", "tail")},
                           "eps": "fp32", "offset": "fp32", "n_slots": "i32",
                           "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr", "BLOCK_TAIL": "constexpr",
                           "NORM": "constexpr", "HAS_TAIL": "constexpr", "WRITE_KV": "constexpr",
                           "BLOCK_D": "constexpr", "PAGE": "constexpr", "PDL": "constexpr", "FMT": "constexpr"}
                    specs.append(CompileSpec(sig, {"BLOCK_H": bh, "BLOCK_HALF": bhalf, "BLOCK_TAIL": btail,
                                                   "NORM": norm, "HAS_TAIL": has_tail, "WRITE_KV": write,
                                                   "BLOCK_D": d, "PAGE": 16, "PDL": False, "FMT": fmt},
                                             label=f"{act} {what}{' +qknorm' if norm else ''}"
                                                   f"{' +kv-write' if write else ''}"
                                                   f"{['', ' e4m3', ' e5m2'][fmt + 1] if write else ''}"))
    return specs


def _silu_specs() -> list[CompileSpec]:
    return [CompileSpec({"X": f"*{act}", "Out": f"*{act}", "stride_xt": "i32", "stride_ot": "i32", "I": "i32",
                         "BLOCK": "constexpr", "PDL": "constexpr"}, {"BLOCK": 1024, "PDL": False}, label=f"{act}")
            for act in _ACTS]


register_kernel("fused.rms_norm", _rms_norm_kernel, _norm_specs(), compat=True)
register_kernel("fused.qk_norm_rope", _qk_rope_kernel, _rope_specs(), compat=True)
register_kernel("fused.silu_and_mul", _silu_mul_kernel, _silu_specs(), compat=True)
register_kernel("fused.sigmoid_gate_mul", _sigmoid_gate_mul_kernel, [
    CompileSpec({"X": f"*{act}", "Gate": f"*{act}", "Out": f"*{act}",
                 **{n: "i32" for n in ("stride_xt", "stride_xh", "stride_gt", "stride_gh", "stride_ot", "stride_oh",
                                       "N")},
                 "D": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"}, {"D": 256, "BLOCK": 1024, "PDL": False},
                label=f"{act} d256") for act in _ACTS], compat=True)


# ------------------------------------------------------------------------------------------------
# wrappers
# ------------------------------------------------------------------------------------------------
def _warps(elems: int, lo: int = 1, hi: int = 16) -> int:
    return max(lo, min(hi, elems // 512))


def _rows3(t: torch.Tensor, name: str) -> torch.Tensor:
    """A [A, B, N] view (no copy) of a tensor whose last dim is contiguous; 1-D/2-D get unit dims."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")
    if t.dim() == 1:
        return t[None, None]
    if t.dim() == 2:
        return t[:, None]
    if t.dim() == 3:
        return t
    return t.view(-1, t.shape[-2], t.shape[-1])


def _launch_norm(x: torch.Tensor, res: Optional[torch.Tensor], weight: torch.Tensor, out: torch.Tensor,
                 eps: float, offset: float, gate: Optional[torch.Tensor] = None) -> None:
    x3, o3 = _rows3(x, "x"), _rows3(out, "out")
    r3 = _rows3(res, "residual") if res is not None else x3
    g3 = _rows3(gate, "gate") if gate is not None else x3
    if gate is not None and g3.shape != x3.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and x {tuple(x.shape)} differ")
    a, b, n = x3.shape
    if x3.numel() == 0:
        return
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if weight.numel() != n:
        raise ValueError(f"weight has {weight.numel()} elements, rows have {n}")
    if n <= _MAX_SINGLE_TILE:
        block_n, tiles = triton.next_power_of_2(n), 1
        block_h = max(1, min(triton.next_power_of_2(b), 2048 // block_n))
    else:
        block_n, tiles, block_h = _LOOP_TILE, triton.cdiv(n, _LOOP_TILE), 1
    if res is not None:
        block_h = 1  # one row per program keeps the residual rows' stores simple to reason about
    grid = (a, triton.cdiv(b, block_h))
    _rms_norm_kernel[grid](
        x3, r3, weight, o3, g3,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), o3.stride(0), o3.stride(1), g3.stride(0), g3.stride(1),
        b, n, float(eps), float(offset),
        BLOCK_H=block_h, BLOCK_N=block_n, NUM_TILES=tiles, HAS_RES=res is not None, HAS_GATE=gate is not None,
        # at most 8 warps per row: 8 vs 16 at 1 / 16 / 64 rows of 4096 with the residual, 1.76 / 1.86 / 1.98 us vs
        # 1.86 / 1.94 / 2.03 (benchmarks/results/norm-warps-sweep-d67425b.txt)
        num_warps=_warps(block_h * block_n * (2 if res is not None else 1), hi=8), **pdl.launch_options(),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., H] (last dim contiguous) -> x / rms(x) * (weight + offset) in x's dtype, fp32 math.
    Mutates nothing but `out` (new tensor when None; out=x is allowed: each row is read before it is written)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, None, weight, out, eps, offset)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       offset: float = 0.0, out: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_new = x + residual (fp32 add rounded to residual's dtype), out = rms_norm(residual_new).

    MUTATES `residual`: residual_new is written into it in place, and the same tensor object is returned
    as the second result. `out` gets the normalised rows (new tensor in promote(x, residual) dtype when
    None; out=x is allowed and saves the allocation). `x` itself is only read (unless it is `out`).
    residual must be at least as wide as x (fp16 + fp16, bf16 + bf16, fp16/bf16 x + fp32 residual)."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    if residual.dtype != dtype:
        raise ValueError(f"residual ({residual.dtype}) cannot hold x + residual ({dtype}) in place")
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _launch_norm(x, residual, weight, out, eps, offset)
    return out, residual


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-head RMSNorm (QK-norm): x [T, nH, D] with any token/head strides (last dim contiguous), weight [D].
    Mutates only `out` (new contiguous tensor when None; out=x normalises in place)."""
    if x.dim() != 3:
        raise ValueError(f"rms_norm_heads wants x [T, nH, D], got {tuple(x.shape)}")
    return rms_norm(x, weight, eps, offset, out)


def gated_rms_norm_heads(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-head RMSNorm times silu(gate), fp32 math (the Gated DeltaNet output norm): x, gate [T, nH, D] with any
    token / head strides (last dim contiguous), weight [D] (fp32 in the GDN layer). Mutates only `out` (new
    contiguous tensor in x's dtype when None)."""
    if x.dim() != 3:
        raise ValueError(f"gated_rms_norm_heads wants x [T, nH, D], got {tuple(x.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, None, weight, out, eps, 0.0, gate)
    return out


def _launch_rope(q, k, positions, cos, sin, rotary_dim, q_weight, k_weight, eps, offset, cache_write=None) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, Hq, D] and k [T, Hk, D] expected, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must have a contiguous last dimension")
    if q.dtype != k.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) dtypes differ")
    t, hq, d = q.shape
    hk = k.shape[1]
    rd = int(rotary_dim)
    if rd % 2 or not 0 < rd <= d:
        raise ValueError(f"rotary_dim {rd} must be even and in (0, {d}]")
    half, tail = rd // 2, d - rd
    if cos.shape[-1] < half or sin.shape[-1] < half or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"cos/sin must be [max_pos, >= {half}] with a contiguous last dim")
    if positions.shape != (t,):
        raise ValueError(f"positions must be [T={t}], got {tuple(positions.shape)}")
    if t == 0:
        return
    positions = positions if positions.stride(0) == 1 else positions.contiguous()
    norm = q_weight is not None
    has_tail = norm and tail > 0
    block_half = triton.next_power_of_2(half)
    block_tail = triton.next_power_of_2(tail) if has_tail else 1
    row = 2 * block_half + (block_tail if has_tail else 0)
    block_h = max(1, min(16, triton.next_power_of_2(max(hq, hk)), 2048 // row))
    block_h = 1 << (block_h.bit_length() - 1)  # a power of two
    nqb, nkb = triton.cdiv(hq, block_h), triton.cdiv(hk, block_h)
    qw = q_weight if norm else cos  # unused pointers when NORM is off
    kw = k_weight if norm else cos
    if norm:
        if q_weight.numel() != d or k_weight.numel() != d:
            raise ValueError(f"q/k norm weights must have head_dim={d} elements")
        qw, kw = qw.contiguous(), kw.contiguous()
    fmt = -1
    if cache_write is None:
        v, cache, slots, n_slots, page = q, q, positions, 0, 16  # unused pointers when WRITE_KV is off
        c_strides, scales = (0, 0, 0, 0), (cos, cos)
    else:
        v, cache, slots = cache_write.v, cache_write.kv_cache, cache_write.slot_mapping
        fmt = cache_write.fmt
        _check_cache_write(v, cache, slots, t, hk, d, k.dtype, fmt, cache_write.k_scale, cache_write.v_scale)
        n_slots, page = min(t, slots.shape[0]), cache.shape[2]
        c_strides = (cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3))
        scales = (cache_write.k_scale, cache_write.v_scale) if fmt >= 0 else (cos, cos)
    _qk_rope_kernel[(t, nqb + nkb)](
        q, k, positions, cos, sin, qw, kw, v, cache, slots, *scales,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), v.stride(0), v.stride(1),
        *c_strides,
        hq, hk, nqb, half, d, tail, float(eps), float(offset), n_slots,
        BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_TAIL=block_tail, NORM=norm, HAS_TAIL=has_tail,
        WRITE_KV=cache_write is not None, BLOCK_D=triton.next_power_of_2(d), PAGE=page, FMT=fmt,
        num_warps=_warps(block_h * row, hi=8), **pdl.launch_options(),
    )


def _check_cache_write(v, cache, slots, t, hk, d, dtype, fmt=-1, k_scale=None, v_scale=None) -> None:
    if v.shape != (t, hk, d) or v.stride(-1) != 1:
        raise ValueError(f"cache_write.v must be [T={t}, {hk}, {d}] with a contiguous last dim, got {tuple(v.shape)}")
    if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[3] != hk or cache.shape[4] != d or cache.stride(4) != 1:
        raise ValueError(f"cache_write.kv_cache must be (2, blocks, page, {hk}, {d}), got {tuple(cache.shape)}")
    if v.dtype != dtype:
        raise ValueError(f"the fused KV store wants v in {dtype}, got {v.dtype}")
    if fmt >= 0:
        if cache.dtype != torch.uint8:
            raise ValueError(f"an fp8 store (fmt {fmt}) wants a uint8 cache, got {cache.dtype}")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or s.dtype != torch.float32 or s.numel() != 1 or s.device != cache.device:
                raise ValueError(f"an fp8 store wants cache_write.{name} as one fp32 element on the cache's device")
    elif not cache.dtype.is_floating_point:
        raise ValueError(f"the fused KV store wants a float cache (or fmt >= 0 with uint8 codes), got {cache.dtype}")
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError("cache_write.slot_mapping must be a 1-D int64 tensor")


def rope_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, rotary_dim: int, cache_write=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on the first rotary_dim channels of every head, IN PLACE on q [T, Hq, D] and
    k [T, Hk, D] (any token/head strides, last dim contiguous: views into a fused qkv output are fine).
    positions [T] int (int64); cos/sin [max_pos, rotary_dim/2] fp32. Channels >= rotary_dim are not
    touched. Returns (q, k), the same tensor objects. cache_write: also store K and V in the paged cache
    (module docstring)."""
    _launch_rope(q, k, positions, cos, sin, rotary_dim, None, None, 0.0, 0.0, cache_write)
    return q, k


def qk_norm_rope_inplace(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         rotary_dim: int, offset: float = 0.0, cache_write=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-style per-head RMSNorm of q and k (weights [D], `offset` for the (1 + w) variant) followed by
    rope_inplace, in one launch, IN PLACE on q and k (all D channels are rewritten). Returns (q, k)."""
    _launch_rope(q, k, positions, cos, sin, rotary_dim, q_weight, k_weight, eps, offset, cache_write)
    return q, k


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I] in x's dtype. Mutates only `out`."""
    i = x.shape[-1] // 2
    if out is None:
        out = torch.empty(*x.shape[:-1], i, dtype=x.dtype, device=x.device)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    o2 = out if out.dim() == 2 else out.view(-1, i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if o2.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dimension")
    if x2.shape[0] == 0 or i == 0:
        return out
    block = min(1024, triton.next_power_of_2(i))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](
        x2, o2, x2.stride(0), o2.stride(0), i, BLOCK=block, num_warps=4, **pdl.launch_options())
    return out


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x, gate [T, nH, D] (any token / head strides, last dim contiguous) -> x * sigmoid(gate) in x's dtype, one
    launch (torch: sigmoid, then the multiply). Mutates only `out` (new when None; `out=x` allowed)."""
    if gate.shape != x.shape or gate.dtype != x.dtype or x.dim() != 3:
        raise ValueError(f"sigmoid_gate_mul: x and gate must be [T, nH, D] of one dtype, got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(gate.shape)} {gate.dtype}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3, g3, o3 = _rows3(x, "x"), _rows3(gate, "gate"), _rows3(out, "out")
    t, h, d = x.shape
    if t == 0 or h * d == 0:
        return out
    block = min(1024, triton.next_power_of_2(h * d))
    _sigmoid_gate_mul_kernel[(t, triton.cdiv(h * d, block))](
        x3, g3, o3, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), o3.stride(0), o3.stride(1), h * d,
        D=d, BLOCK=block, num_warps=4, **pdl.launch_options())
    return out


# ------------------------------------------------------------------------------------------------
# torch references (the same semantics as voltllm.model.layers.{norm, rotary, activation})
# ------------------------------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + offset)).to(x.dtype)
    return y if out is None else out.copy_(y)


def gated_rms_norm_heads_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * F.silu(gate.float())
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           offset: float = 0.0, out: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    y = rms_norm_ref(s, weight, eps, offset)
    residual.copy_(s)
    return (y if out is None else out.copy_(y)), residual


def rms_norm_heads_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return rms_norm_ref(x, weight, eps, offset, out)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> None:
    xr = x[..., :rd].float()
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    x[..., :rd] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_inplace_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    half = rotary_dim // 2
    c = cos[positions][:, None, :half].float()
    s = sin[positions][:, None, :half].float()
    _rotate_ref(q, c, s, rotary_dim)
    _rotate_ref(k, c, s, rotary_dim)
    return q, k


def qk_norm_rope_inplace_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                             eps: float, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             rotary_dim: int, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    q.copy_(rms_norm_ref(q, q_weight, eps, offset))
    k.copy_(rms_norm_ref(k, k_weight, eps, offset))
    return rope_inplace_ref(q, k, positions, cos, sin, rotary_dim)


def silu_and_mul_ref(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    i = x.shape[-1] // 2
    y = F.silu(x[..., :i]) * x[..., i:]
    return y if out is None else out.copy_(y)


def sigmoid_gate_mul_ref(x: torch.Tensor, gate: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    y = x * torch.sigmoid(gate)
    return y if out is None else out.copy_(y)
