"""Triton kernels for the chunked gated delta rule (Gated DeltaNet prefill), fp32 state, chunks of 64 tokens.

Same math and entry point as voltllm.kernels.gdn_ref.gated_delta_rule_varlen (the non-decode path): per value
head h, a sequence is cut into chunks of C tokens (each request's chunks start at its own first token); inside
a chunk with incoming state S0, gamma = cumsum(g), D[t, s] = exp(gamma_t - gamma_s):

    A      = tril_strict((beta K) K^T * D)                    T = (I + A)^-1      (unit lower triangular)
    U      = T (beta V - (beta e^gamma K) S0)                 the deltas
    O      = (e^gamma Q) S0 + (tril(Q K^T * D)) U
    S_next = e^gamma_last S0 + (K e^(gamma_last - gamma))^T U

Two launches per layer (three with HOIST, below):
  _gdn_chunk_prep_kernel   grid (chunk, value head): A from l2-normalized k, beta, g, then T = (I + A)^-1 by
                           blocks: forward substitution inside the four 16-row diagonal blocks at once (16
                           steps; was 64 row steps over [C, C] until session 19), then two pairwise merges of
                           two products each (L^-1 = Tb - Tb L_offdiag Tb; exact like a triangular solve, no
                           power series), stored to a [chunks, Hv, C, C] fp32 workspace (which also carries
                           the diagonal blocks between the program's threads). Every chunk of every request in
                           parallel.
  _gdn_chunk_fwd_kernel    grid (request, value head, block of value columns): walks the request's chunks in
                           order with its S[:, cols] in registers (columns of S are independent given k, q),
                           reads the slot's state first (zeros for a request without initial state), writes
                           the outputs, and stores S back into the slot pool in place.
HOIST (Tile.hoist; session 20): the S-independent products, Wk = T (beta e^gamma K), Wv = T (beta V) and the
decayed Q K^T, are computed for every chunk in parallel before the walk by a third launch, _gdn_chunk_hoist_kernel
(grid chunk x value head x 3, one product per program, T read back from the prep workspace), so the fwd kernel
does four products per chunk instead of six (U = Wv - Wk S; two on the chain from S to the next S instead of
three), at the price of two more [chunks, Hv, C, d] fp32 workspaces. H200, 27B heads (session 20 sweep): the
rule takes 4.71 / 4.51 / 4.58 ms at 1 x 8192 / 4 x 2048 / 16 x 512 with 32 value columns per fwd program,
against 6.02 / 5.60 / 5.39 plain (64 columns; plain 32 is slower: 8.4 ms); the same products done by the prep
kernel after its inverse cost 2.6 ms there against 0.99 + 1.14 in two kernels (that form was removed).
All products are tl.dot with fp32 operands and fp32 accumulation; the state stays fp32 end to end. Their
input precision is the caller's choice (`precision_for` picks it per dtype and route):
  "tf32x3"  tensor cores (sm_80+), three tf32 products per fp32 one (Triton's split of each operand into a
            tf32 high and low part): fp32-level results, for half-precision models on the native route.
            H200, qwen3.5-27b-shape GDN heads (benchmarks/micro/gdn_chunk_sweep.py, session 22 tile): one
            8192-token prompt 4.15 ms against 18-36 in the torch chunked form and 88-103 with "ieee"; 4 x 2048
            3.8 vs 35-51; output error vs the fp32 reference 1.7e-5 relative ("ieee": 1.4e-5).
  "tf32"    one tf32 product (10 mantissa bits): 4.7 ms there, but 1.8e-3 relative error, enough to move a
            greedy token of a tiny fp16 MoE hybrid where the reference's top-2 margin was 0.29 logit (the
            GPU engine test, session 18). Not chosen by default; kept for timing.
  "ieee"    exact fp32 FMA products: fp32 models (the CPU-parity tests), and the compat route (sm_70/75 have no
            tf32: tl.dot lowers to FMAs there anyway; a forced --compat on a newer GPU must not use tensor cores).
Each precision has its tiles (TILES: value columns per program, fwd / prep warps, pipeline stages, HOIST, split),
fixed, not tuned: first the fastest that fit the H200's shared memory at dk = dv = 128 in that sweep (tf32x3 fits
only unpipelined; tf32 with 8 warps gave wrong outputs, relative error 0.16, Triton 3.6), then smaller ones for
GPUs with less shared memory, tried in order when a launch runs out of it. Since session 22 all but "tf32"'s
split the prep and hoist kernels' dots into pieces of the key / value dimension (KS: (beta K) K^T and Q K^T as
sums over pieces, T (beta e^gamma K) and T (beta V) by column pieces; the row norms of the l2-normalised q / k
first, from one pass over the pieces), which halves their dot operands in shared memory: with HOIST they fit a
V100, a T4 and the 99 KB of an RTX 30xx / 40xx card.
q/k/v/out may be fp16, bf16 (native GPUs) or fp32.

Tests: tests/unit/test_gdn_chunk_interp.py (interpreter, vs gdn_ref), tests/gpu/test_hybrid_gpu.py (CUDA,
timings against the torch reference).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from voltllm.host_to_device import to_device
from voltllm.kernels.registry import CompileSpec, register_kernel

CHUNK = 64
SUB = 16  # rows of the diagonal blocks the prep kernel inverts by substitution before merging them
logger = logging.getLogger("voltllm")


@dataclass(frozen=True)
class Tile:
    block_v: int  # value columns per fwd program
    warps: int  # fwd kernel
    prep_warps: int
    stages: Optional[int]  # num_stages of both kernels (None: Triton's default)
    hoist: bool = False  # a third kernel computes U's S-independent parts and Q K^T first (HOIST, module docstring)
    split: int = 1  # pieces of the key / value dimension per dot in the prep and hoist kernels (less shared memory)


# Per dot precision, fastest first, then tiles that need less shared memory, tried when a launch runs out of it
# (then the "ieee" tiles); what ran is remembered per device and shape (_chosen). Per block, Triton's figure compiled
# for the target (an A100 allows 163 KB, sm_86 / sm_89 cards 99 KB, a V100 96 KB, a T4 64 KB, the H200 227 KB):
# the first "tf32x3" tile 64 / 64 / 96 KB (prep / hoist / fwd) on sm_86, the first "ieee" one 32 / 32 / 64 KB on
# sm_70 and sm_75 (tests/unit/test_sm70_gate.py checks both); the unsplit tiles needed 112-128 KB there. H200,
# qwen3.5-27b-shape heads (session 22, results/gdn-chunk-small-tiles-6c58690/): tf32x3 with split 2 4.15 / 3.79 /
# 4.10 ms at 1 x 8192 / 4 x 2048 / 64 x 128 tokens against 5.19 / 4.74 / 4.63 unsplit (the prep and hoist kernels
# 2.2 -> 1.3 ms); ieee with HOIST and split 2 103 / 61 / 61 ms against 88 / 74 / 74 for the plain 64:8 tile, whose
# single long prompts run the torch form anyway (GatedDeltaNet._triton_prefill_fits).
TILES: dict[str, tuple[Tile, ...]] = {
    "tf32x3": (Tile(32, 4, 4, 1, True, 2), Tile(16, 4, 4, 1, True, 2)),
    "tf32": (Tile(16, 4, 2, None), Tile(16, 4, 2, 1)),
    "ieee": (Tile(64, 4, 4, 1, True, 2), Tile(16, 4, 4, 1, True, 2)),
}
_chosen: dict[tuple, tuple[str, Tile]] = {}


class ChunkKernelsDoNotFit(RuntimeError):
    """No tile of the chunk kernels fits the device's shared memory per block. Compiled for sm_70 / sm_75 /
    sm_86 / sm_89 (session 21) the unsplit tiles needed 112-128 KB, more than a V100 (96 KB), a T4 (64 KB) or a
    consumer Ampere / Ada card (99 KB) has; since session 22 the tiles (TILES: HOIST, dots in pieces) fit all
    three, so this is left for a GPU with less shared memory per block. Raised before anything is written: the
    caller runs the torch form instead (GatedDeltaNet does)."""


@triton.jit
def _chunk_rows(ChunkStart, ChunkLen, c, C: tl.constexpr, BLOCK_K: tl.constexpr, DK: tl.constexpr):
    """Chunk c's first token (int64), its row offsets and row mask, the key-dim offsets and mask."""
    t0 = tl.load(ChunkStart + c).to(tl.int64)
    rows = tl.arange(0, C)
    offk = tl.arange(0, BLOCK_K)
    return t0, rows, rows < tl.load(ChunkLen + c), offk, offk < DK


@triton.jit
def _key_piece(X, tok, mc, stride_t, head_off, p, PW: tl.constexpr, DK: tl.constexpr):
    """Columns [p * PW, (p + 1) * PW) of the chunk's rows of X (keys / queries / values), fp32."""
    offp = p * PW + tl.arange(0, PW)
    return tl.load(X + tok[:, None] * stride_t + head_off + offp[None, :], mask=mc[:, None] & (offp < DK)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _row_scale(X, tok, mc, stride_t, head_off, C: tl.constexpr, PW: tl.constexpr, KS: tl.constexpr,
               DK: tl.constexpr, L2NORM: tl.constexpr):
    """1 / ||row|| of the chunk's rows of X over all KS pieces (ones without L2NORM)."""
    ss = tl.zeros([C], dtype=tl.float32)
    if L2NORM:
        for p in tl.static_range(KS):
            x = _key_piece(X, tok, mc, stride_t, head_off, p, PW, DK)
            ss += tl.sum(x * x, axis=1)
        return tl.rsqrt(ss + 1e-6)
    else:
        return ss + 1.0


# The step's chunk table is one upload sliced into rows (chunk_meta), so a row's 16-byte alignment changes with the
# step's chunk and request counts; the kernels read it one scalar per program, so its alignment class would only
# compile another variant inside a step (as the compat bridge's plan rows did, session 43)
@triton.jit(do_not_specialize_on_alignment=["ChunkStart", "ChunkLen"])
def _gdn_chunk_prep_kernel(
    K, G, Beta, ChunkStart, ChunkLen, Tinv,
    stride_kt, stride_kh, stride_gt, stride_bt, stride_tc, stride_th,
    HV_PER_K: tl.constexpr, DK: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr, L2NORM: tl.constexpr,
    PRECISION: tl.constexpr, SUB: tl.constexpr, MERGES: tl.constexpr, KS: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // HV_PER_K
    t0, rows, mc, offk, mk = _chunk_rows(ChunkStart, ChunkLen, c, C, BLOCK_K, DK)
    tok = t0 + rows
    PK: tl.constexpr = BLOCK_K // KS
    g = tl.load(G + tok * stride_gt + h, mask=mc, other=0.0).to(tl.float32)
    beta = tl.load(Beta + tok * stride_bt + h, mask=mc, other=0.0).to(tl.float32)
    gam = tl.cumsum(g, axis=0)
    strict = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(strict, gam[:, None] - gam[None, :], float("-inf")))
    # (beta K) K^T summed over KS pieces of the key dimension (smaller dot operands: less shared memory)
    rk = _row_scale(K, tok, mc, stride_kt, hk * stride_kh, C, PK, KS, DK, L2NORM)
    a = tl.zeros([C, C], dtype=tl.float32)
    for p in tl.static_range(KS):
        k = _key_piece(K, tok, mc, stride_kt, hk * stride_kh, p, PK, DK) * rk[:, None]
        a += tl.dot(k * beta[:, None], tl.trans(k), input_precision=PRECISION)
    a = a * decay  # zero on and above the diagonal
    # T = (I + A)^-1 by blocks of SUB rows: forward substitution inside the C / SUB diagonal blocks at once
    # (SUB steps), then merged pairwise: for L = [[L11, 0], [L21, L22]], L^-1 = Tb - Tb [[0, 0], [L21, 0]] Tb
    # with Tb = blockdiag(L11^-1, L22^-1), as full [C, C] products masked to the off-diagonal block. Exact like
    # row-by-row substitution (no power series). The diagonal blocks go through this program's T workspace.
    w_ptrs = Tinv + c.to(tl.int64) * stride_tc + h * stride_th
    full = rows[:, None] * C + rows[None, :]
    tl.store(w_ptrs + full, a)
    tl.debug_barrier()
    blk = tl.arange(0, C // SUB)[:, None, None] * SUB
    r = tl.arange(0, SUB)
    diag = (blk + r[None, :, None]) * C + blk + r[None, None, :]  # [C/SUB, SUB, SUB]: the diagonal blocks
    ab = tl.load(w_ptrs + diag)
    tb = tl.zeros([C // SUB, SUB, SUB], dtype=tl.float32)
    for i in range(0, SUB):  # row i of every block: T[i] = e_i - sum_{j<i} A[i, j] T[j] (rows >= i still zero)
        a_i = tl.sum(tl.where(r[None, :, None] == i, ab, 0.0), axis=1)  # [C/SUB, SUB]: row i, by column j
        row = tl.where(r[None, :] == i, 1.0, 0.0) - tl.sum(a_i[:, :, None] * tb, axis=1)
        tb = tl.where(r[None, :, None] == i, row[:, None, :], tb)
    tl.debug_barrier()  # every diagonal block has been read before the workspace takes the inverses
    rb = rows // SUB
    tl.store(w_ptrs + full, tl.zeros([C, C], dtype=tl.float32), mask=rb[:, None] != rb[None, :])
    tl.store(w_ptrs + diag, tb)
    tl.debug_barrier()
    t = tl.load(w_ptrs + full)  # blockdiag of the SUB-row inverses
    for lvl in tl.static_range(MERGES):  # merge pairs of (SUB << lvl)-row blocks: each pair's lower-left block
        half = rows // (SUB << lvl)
        off = ((half % 2 == 1)[:, None] & (half % 2 == 0)[None, :]) & ((half // 2)[:, None] == (half // 2)[None, :])
        t = t - tl.dot(tl.dot(t, tl.where(off, a, 0.0), input_precision=PRECISION), t, input_precision=PRECISION)
    tl.debug_barrier()
    tl.store(w_ptrs + full, t)


@triton.jit(do_not_specialize_on_alignment=["ChunkStart", "ChunkLen"])
def _gdn_chunk_hoist_kernel(
    Q, K, V, G, Beta, ChunkStart, ChunkLen, Tinv, Attn, Wk, Wv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_tc, stride_th,
    stride_wkc, stride_wkh, stride_wvc, stride_wvh,
    scale,
    HV_PER_K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr, KS: tl.constexpr,
):
    """HOIST: grid (chunk, value head, 3); product 0 is Wk = T (beta e^gamma K), 1 is Wv = T (beta V), 2 the
    decayed Q K^T, each in its own program, by KS pieces of the key / value dimension (Wk, Wv: column pieces;
    Q K^T: a sum over pieces)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    which = tl.program_id(2)
    hk = h // HV_PER_K
    t0, rows, mc, offk, mk = _chunk_rows(ChunkStart, ChunkLen, c, C, BLOCK_K, DK)
    tok = t0 + rows
    PK: tl.constexpr = BLOCK_K // KS
    PV: tl.constexpr = BLOCK_DV // KS
    c64 = c.to(tl.int64)
    g = tl.load(G + tok * stride_gt + h, mask=mc, other=0.0).to(tl.float32)
    gam = tl.cumsum(g, axis=0)
    full = rows[:, None] * C + rows[None, :]
    if which == 1:
        beta = tl.load(Beta + tok * stride_bt + h, mask=mc, other=0.0).to(tl.float32)
        t = tl.load(Tinv + c64 * stride_tc + h * stride_th + full)
        for p in tl.static_range(KS):
            offv = p * PV + tl.arange(0, PV)
            v = _key_piece(V, tok, mc, stride_vt, h * stride_vh, p, PV, DV)
            wv = tl.dot(t, v * beta[:, None], input_precision=PRECISION)
            tl.store(Wv + c64 * stride_wvc + h * stride_wvh + rows[:, None] * DV + offv[None, :], wv,
                     mask=(offv < DV)[None, :])
    else:
        rk = _row_scale(K, tok, mc, stride_kt, hk * stride_kh, C, PK, KS, DK, L2NORM)
        if which == 0:
            beta = tl.load(Beta + tok * stride_bt + h, mask=mc, other=0.0).to(tl.float32)
            t = tl.load(Tinv + c64 * stride_tc + h * stride_th + full)
            for p in tl.static_range(KS):
                offp = p * PK + tl.arange(0, PK)
                k = _key_piece(K, tok, mc, stride_kt, hk * stride_kh, p, PK, DK) * rk[:, None]
                wk = tl.dot(t, k * (beta * tl.exp(gam))[:, None], input_precision=PRECISION)
                tl.store(Wk + c64 * stride_wkc + h * stride_wkh + rows[:, None] * DK + offp[None, :], wk,
                         mask=(offp < DK)[None, :])
        else:
            rq = _row_scale(Q, tok, mc, stride_qt, hk * stride_qh, C, PK, KS, DK, L2NORM)
            qk = tl.zeros([C, C], dtype=tl.float32)
            for p in tl.static_range(KS):
                q = _key_piece(Q, tok, mc, stride_qt, hk * stride_qh, p, PK, DK) * rq[:, None]
                k = _key_piece(K, tok, mc, stride_kt, hk * stride_kh, p, PK, DK) * rk[:, None]
                qk += tl.dot(q * scale, tl.trans(k), input_precision=PRECISION)
            incl = rows[:, None] >= rows[None, :]
            attn = qk * tl.exp(tl.where(incl, gam[:, None] - gam[None, :], float("-inf")))
            tl.store(Attn + c64 * stride_tc + h * stride_th + full, attn)


@triton.jit(do_not_specialize_on_alignment=["SeqStart", "SeqChunk", "Slots", "HasInit"])
def _gdn_chunk_fwd_kernel(
    Q, K, V, G, Beta, Mat, State, Slots, HasInit, Out, SeqStart, SeqChunk, Wk, Wv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_tc, stride_th, stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    stride_wkc, stride_wkh, stride_wvc, stride_wvh,
    scale,
    HV_PER_K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr, HOIST: tl.constexpr,
):
    sq = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // HV_PER_K
    t_begin = tl.load(SeqStart + sq)
    t_end = tl.load(SeqStart + sq + 1)
    c_begin = tl.load(SeqChunk + sq)
    c_end = tl.load(SeqChunk + sq + 1)
    rows = tl.arange(0, C)
    offk = tl.arange(0, BLOCK_K)
    mk = offk < DK
    offv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = offv < DV
    slot = tl.load(Slots + sq).to(tl.int64)
    init = tl.load(HasInit + sq)
    s_ptrs = State + slot * stride_ss + h * stride_sh + offk[:, None] * stride_sk + offv[None, :]
    s_mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=s_mask & (init != 0), other=0.0).to(tl.float32)
    incl = rows[:, None] >= rows[None, :]
    for c in range(c_begin, c_end):
        t0 = t_begin + (c - c_begin) * C
        mc = (t0 + rows) < t_end
        tok = (t0 + rows).to(tl.int64)
        m_ck = mc[:, None] & mk[None, :]
        q = tl.load(Q + tok[:, None] * stride_qt + hk * stride_qh + offk[None, :], mask=m_ck, other=0.0).to(tl.float32)
        k = tl.load(K + tok[:, None] * stride_kt + hk * stride_kh + offk[None, :], mask=m_ck, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
            k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        q = q * scale
        g = tl.load(G + tok * stride_gt + h, mask=mc, other=0.0).to(tl.float32)
        gam = tl.cumsum(g, axis=0)
        g_last = tl.sum(g, axis=0)
        eg = tl.exp(gam)
        if HOIST:  # U = T beta V - T (beta e^gamma K) S and the masked Q K^T, from the hoist kernel
            wk = tl.load(Wk + c * stride_wkc + h * stride_wkh + rows[:, None] * DK + offk[None, :],
                         mask=mk[None, :], other=0.0)
            wv = tl.load(Wv + c * stride_wvc + h * stride_wvh + rows[:, None] * DV + offv[None, :],
                         mask=mv[None, :], other=0.0)
            u = wv - tl.dot(wk, s, input_precision=PRECISION)
            attn = tl.load(Mat + c * stride_tc + h * stride_th + rows[:, None] * C + rows[None, :])
        else:
            v = tl.load(V + tok[:, None] * stride_vt + h * stride_vh + offv[None, :],
                        mask=mc[:, None] & mv[None, :], other=0.0).to(tl.float32)
            beta = tl.load(Beta + tok * stride_bt + h, mask=mc, other=0.0).to(tl.float32)
            tinv = tl.load(Mat + c * stride_tc + h * stride_th + rows[:, None] * C + rows[None, :])
            rhs = v * beta[:, None] - tl.dot(k * (beta * eg)[:, None], s, input_precision=PRECISION)
            u = tl.dot(tinv, rhs, input_precision=PRECISION)
            decay = tl.exp(tl.where(incl, gam[:, None] - gam[None, :], float("-inf")))
            attn = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        o = tl.dot(q * eg[:, None], s, input_precision=PRECISION) + tl.dot(attn, u, input_precision=PRECISION)
        tl.store(Out + tok[:, None] * stride_ot + h * stride_oh + offv[None, :], o.to(Out.dtype.element_ty),
                 mask=mc[:, None] & mv[None, :])
        kd = k * tl.exp(g_last - gam)[:, None]
        s = s * tl.exp(g_last) + tl.dot(tl.trans(kd), u, input_precision=PRECISION)
    tl.store(s_ptrs, s.to(State.dtype.element_ty), mask=s_mask)


def _prep_specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        for split in (1, 2):
            sig = {"K": f"*{act}", "G": "*fp32", "Beta": "*fp32", "ChunkStart": "*i32", "ChunkLen": "*i32",
                   "Tinv": "*fp32", **{n: "i32" for n in ("stride_kt", "stride_kh", "stride_gt", "stride_bt")},
                   "stride_tc": "i64", "stride_th": "i32",
                   **{n: "constexpr" for n in ("HV_PER_K", "DK", "C", "BLOCK_K", "L2NORM", "PRECISION", "SUB",
                                               "MERGES", "KS")}}
            specs.append(CompileSpec(signature=sig, constexprs={
                "HV_PER_K": 3, "DK": 128, "C": CHUNK, "BLOCK_K": 128, "L2NORM": True, "PRECISION": "ieee",
                "SUB": SUB, "MERGES": 2, "KS": split}, label=f"{act} dk128 c64 ks{split}"))
    return specs


def _fwd_specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        # TILES["ieee"], the compat route's: both HOIST. Without HOIST (only an explicit hoist=False) the forward needs
        # 112 KB per block, more than sm_70 / sm_75 have, so it never runs there and is not gated (its 4 compiles
        # were 250 of the gate's 1,380 CPU-s)
        for hoist, block_v in ((True, 64), (True, 16)):
            sig = {"Q": f"*{act}", "K": f"*{act}", "V": f"*{act}", "G": "*fp32", "Beta": "*fp32", "Mat": "*fp32",
                   "State": "*fp32", "Slots": "*i64", "HasInit": "*i32", "Out": f"*{act}", "SeqStart": "*i32",
                   "SeqChunk": "*i32", "Wk": "*fp32", "Wv": "*fp32",
                   **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                                         "stride_vh", "stride_gt", "stride_bt")},
                   "stride_tc": "i64", "stride_th": "i32", "stride_ss": "i64", "stride_sh": "i32",
                   "stride_sk": "i32", "stride_ot": "i32", "stride_oh": "i32",
                   "stride_wkc": "i64", "stride_wkh": "i32", "stride_wvc": "i64", "stride_wvh": "i32",
                   "scale": "fp32",
                   **{n: "constexpr" for n in ("HV_PER_K", "DK", "DV", "C", "BLOCK_K", "BLOCK_V", "L2NORM",
                                               "PRECISION", "HOIST")}}
            specs.append(CompileSpec(signature=sig, constexprs={
                "HV_PER_K": 3, "DK": 128, "DV": 128, "C": CHUNK, "BLOCK_K": 128, "BLOCK_V": block_v, "L2NORM": True,
                "PRECISION": "ieee", "HOIST": hoist},
                label=f"{act} dk128 dv128 bv{block_v} c64" + (" hoist" if hoist else "")))
    return specs


def _hoist_specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        for split in (1, 2):
            sig = {"Q": f"*{act}", "K": f"*{act}", "V": f"*{act}", "G": "*fp32", "Beta": "*fp32",
                   "ChunkStart": "*i32", "ChunkLen": "*i32", "Tinv": "*fp32", "Attn": "*fp32", "Wk": "*fp32",
                   "Wv": "*fp32",
                   **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                                         "stride_vh", "stride_gt", "stride_bt")},
                   "stride_tc": "i64", "stride_th": "i32",
                   "stride_wkc": "i64", "stride_wkh": "i32", "stride_wvc": "i64", "stride_wvh": "i32",
                   "scale": "fp32",
                   **{n: "constexpr" for n in ("HV_PER_K", "DK", "DV", "C", "BLOCK_K", "BLOCK_DV", "L2NORM",
                                               "PRECISION", "KS")}}
            specs.append(CompileSpec(signature=sig, constexprs={
                "HV_PER_K": 3, "DK": 128, "DV": 128, "C": CHUNK, "BLOCK_K": 128, "BLOCK_DV": 128, "L2NORM": True,
                "PRECISION": "ieee", "KS": split}, label=f"{act} dk128 dv128 c64 ks{split}"))
    return specs


# (gated_delta_rule_chunked retries smaller tiles when a launch runs out of shared memory, TILES, and GatedDeltaNet
# runs the torch form when none fits: ChunkKernelsDoNotFit)
register_kernel("gdn.chunk_prep", _gdn_chunk_prep_kernel, _prep_specs(), compat=True, shared_fallback=True)
register_kernel("gdn.chunk_hoist", _gdn_chunk_hoist_kernel, _hoist_specs(), compat=True, shared_fallback=True)
register_kernel("gdn.chunk_fwd", _gdn_chunk_fwd_kernel, _fwd_specs(), compat=True, shared_fallback=True)


def chunk_table(qsl: Sequence[int], chunk: int = CHUNK) -> tuple[list[int], list[int], list[int]]:
    """-> (chunk start token, chunk length, first chunk of each request + total) for the flat batch `qsl`."""
    starts, lens, seq_chunk = [], [], [0]
    for i in range(len(qsl) - 1):
        for t0 in range(qsl[i], qsl[i + 1], chunk):
            starts.append(t0)
            lens.append(min(chunk, qsl[i + 1] - t0))
        seq_chunk.append(len(starts))
    return starts, lens, seq_chunk


@dataclass
class ChunkMeta:
    """The step's chunk table on the device (built once per forward, shared by every GDN layer)."""
    num_chunks: int
    chunk_start: torch.Tensor  # int32 [num_chunks]: first token of each chunk
    chunk_len: torch.Tensor  # int32 [num_chunks]
    seq_chunk: torch.Tensor  # int32 [B + 1]: first chunk of each request
    seq_start: torch.Tensor  # int32 [B + 1]: qsl
    has_init: torch.Tensor  # int32 [B]


def chunk_meta(qsl: Sequence[int], has_initial_state: torch.Tensor) -> ChunkMeta:
    starts, lens, seq_chunk = chunk_table(qsl)
    nc, nseq = len(starts), len(qsl) - 1
    flat = to_device(starts + lens + seq_chunk + list(qsl), torch.int32, has_initial_state.device)
    return ChunkMeta(nc, flat[:nc], flat[nc:2 * nc], flat[2 * nc:2 * nc + nseq + 1], flat[2 * nc + nseq + 1:],
                     has_initial_state.to(torch.int32))


def workspace_bytes(num_chunks: int, hv: int, dk: int, dv: int) -> int:
    """The most fp32 workspace one call with `num_chunks` chunks allocates, over every tile (T, and with HOIST the
    decayed Q K^T, Wk and Wv); freed when the call returns. The runner's memory sizing counts the chunks a step
    can have beyond its profiled forward (voltllm.worker.memory.chunk_workspace_slack_bytes)."""
    hoist = any(t.hoist for tiles in TILES.values() for t in tiles)
    per_chunk = CHUNK * CHUNK + (CHUNK * CHUNK + CHUNK * dk + CHUNK * dv if hoist else 0)
    return num_chunks * hv * per_chunk * 4


def precision_for(dtype: torch.dtype, capability: Optional[tuple[int, int]], compat: bool = False) -> str:
    """The chunk kernels' dot precision: "tf32x3" for half-precision activations on a GPU with Triton tensor cores
    (capability >= 8.0) off the compat route, else "ieee" (see the module docstring). capability None: CPU."""
    fast = (capability is not None and tuple(capability) >= (8, 0) and not compat
            and dtype in (torch.float16, torch.bfloat16))
    return "tf32x3" if fast else "ieee"


def auto_precision(dtype: torch.dtype, device: torch.device, compat: bool = False) -> str:
    """precision_for on `device`'s capability."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return precision_for(dtype, cap, compat)


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, ssm_states: torch.Tensor, slots: torch.Tensor,
                             qsl: Sequence[int], has_initial_state: torch.Tensor, scale: Optional[float] = None,
                             use_qk_l2norm: bool = True, block_v: Optional[int] = None,
                             precision: Optional[str] = None, num_warps: Optional[int] = None,
                             meta: Optional[ChunkMeta] = None, num_stages: Optional[int] = None,
                             prep_warps: Optional[int] = None, prep_stages: Optional[int] = None,
                             hoist: Optional[bool] = None, split: Optional[int] = None) -> torch.Tensor:
    """Flat batch (request i owns rows qsl[i]:qsl[i+1], any lengths): q, k [T, Hk, Dk]; v [T, Hv, Dv];
    g, beta [T, Hv] (used in fp32); ssm_states [num_slots, Hv, Dk, Dv] fp32, read and written in place at
    `slots` (long [B]); has_initial_state bool [B]. Returns out [T, Hv, Dv] in v's dtype (rows past qsl[-1]
    are zero), like gdn_ref.gated_delta_rule_varlen. `meta`: chunk_meta(qsl, has_initial_state), if the
    caller keeps it for several layers (else it is built here: one host-to-device copy). `precision`: "ieee",
    "tf32x3" or "tf32" (None: auto_precision for v's dtype and device); its tiles are tried in order until one
    fits the device's shared memory (then the "ieee" ones; ChunkKernelsDoNotFit when none does). block_v,
    num_warps (the fwd kernel's), num_stages, prep_warps, prep_stages, hoist and split run one explicit tile
    instead (no fallback: the sweeps)."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    out = torch.zeros(t, hv, dv, dtype=v.dtype, device=v.device)
    nseq = len(qsl) - 1
    if nseq == 0 or qsl[-1] == 0:
        return out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    assert ssm_states.stride(-1) == 1 and ssm_states.dtype == torch.float32
    if meta is None:
        meta = chunk_meta(qsl, has_initial_state)
    dev = v.device
    if precision is None:
        precision = auto_precision(v.dtype, dev)
    if precision not in TILES:
        raise ValueError(f"gated_delta_rule_chunked: precision must be one of {sorted(TILES)}, got {precision!r}")

    def run(prec: str, tile: Tile, p_stages: Optional[int] = None) -> None:
        _launch(prec, tile, p_stages, q, k, v, g, beta, ssm_states, slots, meta, out, scale, use_qk_l2norm, nseq)

    if any(x is not None for x in (block_v, num_warps, num_stages, prep_warps, prep_stages, hoist, split)):
        first = TILES[precision][0]  # an explicit tile: the first one's fields where not given
        run(precision, Tile(block_v or first.block_v, num_warps or first.warps, prep_warps or first.prep_warps,
                            num_stages or first.stages, first.hoist if hoist is None else hoist,
                            split or first.split), prep_stages)
        return out
    key = (dev, precision, k.shape[1], k.shape[2], v.shape[1], v.shape[2], v.dtype, use_qk_l2norm)
    if key in _chosen:
        run(*_chosen[key])
        return out
    candidates = [(precision, tile) for tile in TILES[precision]]
    if precision != "ieee":
        candidates += [("ieee", tile) for tile in TILES["ieee"]]
    last = None
    for prec, tile in candidates:
        try:
            run(prec, tile)  # a tile that does not fit fails compiling, before anything runs
        except OutOfResources as e:
            last = e
            continue
        if (prec, tile) != candidates[0]:
            logger.warning("Gated DeltaNet chunk kernels: %s products with %s (the faster tiles need more shared "
                           "memory than %s has: %s)", prec, tile, dev, last)
        _chosen[key] = (prec, tile)
        return out
    raise ChunkKernelsDoNotFit(f"Gated DeltaNet chunk kernels: no tile fits the shared memory of {dev} "
                               f"(dk {k.shape[2]}, dv {v.shape[2]})") from last


def _launch(precision, tile, prep_stages, q, k, v, g, beta, ssm_states, slots, meta, out, scale, use_qk_l2norm,
            nseq) -> None:
    """The two launches of one call (prep fills the workspaces; fwd walks the chunks, writes out and the state
    pool) with a given precision and tile."""
    hk, dk = k.shape[1], k.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    launch = {"num_stages": tile.stages} if tile.stages else {}
    prep_launch = {"num_stages": prep_stages} if prep_stages else launch
    nc = meta.num_chunks
    mat = torch.empty(nc, hv, CHUNK, CHUNK, dtype=torch.float32, device=v.device)  # T
    block_k = max(16, triton.next_power_of_2(dk))
    block_dv = max(16, triton.next_power_of_2(dv))
    split = min(tile.split, block_k // 16, block_dv // 16)  # pieces of at least 16 columns (tl.dot's minimum)
    scale = float(scale if scale is not None else dk ** -0.5)
    _gdn_chunk_prep_kernel[(nc, hv)](
        k, g, beta, meta.chunk_start, meta.chunk_len, mat,
        k.stride(0), k.stride(1), g.stride(0), beta.stride(0), mat.stride(0), mat.stride(1),
        HV_PER_K=hv // hk, DK=dk, C=CHUNK, BLOCK_K=block_k, L2NORM=use_qk_l2norm, PRECISION=precision, SUB=SUB,
        MERGES=(CHUNK // SUB).bit_length() - 1, KS=split, num_warps=tile.prep_warps, **prep_launch)
    if tile.hoist:  # T stays in `mat`; the fwd kernel reads Wk, Wv and the decayed Q K^T instead
        wk = torch.empty(nc, hv, CHUNK, dk, dtype=torch.float32, device=v.device)
        wv = torch.empty(nc, hv, CHUNK, dv, dtype=torch.float32, device=v.device)
        attn = torch.empty_like(mat)
        _gdn_chunk_hoist_kernel[(nc, hv, 3)](
            q, k, v, g, beta, meta.chunk_start, meta.chunk_len, mat, attn, wk, wv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), mat.stride(0), mat.stride(1), wk.stride(0), wk.stride(1), wv.stride(0), wv.stride(1),
            scale,
            HV_PER_K=hv // hk, DK=dk, DV=dv, C=CHUNK, BLOCK_K=block_k, BLOCK_DV=block_dv,
            L2NORM=use_qk_l2norm, PRECISION=precision, KS=split, num_warps=tile.prep_warps, **prep_launch)
        mat = attn
    else:
        wk = wv = mat  # not read
    block_v = min(max(16, triton.next_power_of_2(dv)), tile.block_v)
    _gdn_chunk_fwd_kernel[(nseq, hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, mat, ssm_states, slots, meta.has_init, out, meta.seq_start, meta.seq_chunk, wk, wv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        mat.stride(0), mat.stride(1), ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        out.stride(0), out.stride(1), wk.stride(0), wk.stride(1), wv.stride(0), wv.stride(1),
        scale,
        HV_PER_K=hv // hk, DK=dk, DV=dv, C=CHUNK, BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm,
        PRECISION=precision, HOIST=tile.hoist, num_warps=tile.warps, **launch)
