"""Paged decode attention: one query row per sequence, GQA, optional split-KV ("flash-decoding").

Grid: (num_seqs, num_kv_heads, num_splits). One program loads the q heads of one kv-head group
(GROUP = num_heads // num_kv_heads rows) and streams its slice of the context once, so each KV tile is
read once per group. Online softmax in fp32 (base-2 exponent). With num_splits > 1 each program covers
a contiguous, BLOCK_N-aligned slice of its sequence's context (the slice size is computed in the kernel
from the actual seq_len, so a split count sized for a longer bound only leaves trailing programs empty)
and writes a normalized partial output + log-sum-exp to fp32 scratch; `_decode_reduce_kernel` combines
them. Empty partitions write lse = -inf and a zero vector, which the reduction weights by 0.

Two inner products:
  USE_DOT=True : tl.dot over a [BLOCK_G>=16, D] tile of q heads (tensor cores on sm_80+).
  USE_DOT=False: broadcast-multiply + sum in fp32 (CUDA-core FMA): for sm_70/sm_75, where tl.dot is
                 FMA anyway and padding the group to 16 rows would waste 16/GROUP of the work.
Reference: voltllm.attention.torch_ref (gather_kv + attend_one).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.fp8_codec import fp8_to_fp16, fp32_to_fp8
from voltllm.kernels.pdl import pdl_enter, prefetch_l2
from voltllm.kernels.registry import CompileSpec, register_kernel

LOG2E = 1.4426950408889634


@triton.jit
def _block_offsets(blk, pos, stride_c_blk, stride_c_slot, head_off, PAGE: tl.constexpr):
    """Element offsets of the K rows of context positions `pos` of one kv head, whose pages are `blk` (V: +
    stride_c_kv)."""
    return blk.to(tl.int64) * stride_c_blk + (pos % PAGE) * stride_c_slot + head_off


@triton.jit
def _kv_token_offsets(bt_row, pos, n_mask, stride_c_blk, stride_c_slot, head_off, PAGE: tl.constexpr):
    """_block_offsets with the pages read from the sequence's block-table row."""
    blk = tl.load(bt_row + pos // PAGE, mask=n_mask, other=0)
    return _block_offsets(blk, pos, stride_c_blk, stride_c_slot, head_off, PAGE)


@triton.jit
def _decode_codes(k, v, KV_FMT: tl.constexpr, DT: tl.constexpr):
    """K / V as loaded (fp8 codes when KV_FMT >= 0) in DT (_load_kv_decoded)."""
    if KV_FMT >= 0:
        k = fp8_to_fp16(k, KV_FMT).to(DT)
        v = fp8_to_fp16(v, KV_FMT).to(DT)
    return k, v


@triton.jit
def _load_kv_decoded(KV, offs, kv_mask, stride_c_kv, KV_FMT: tl.constexpr, DT: tl.constexpr):
    """K and V at offsets `offs` (masked elements read as 0), fp8 codes decoded to DT.

    KV_FMT >= 0: the cache holds uint8 fp8 codes (fp8_codec FP8_E4M3 / FP8_E5M2: integer ops; FP8_E4M3_HW: the GPU's
    conversion), decoded in registers to fp16 (exact) and then to DT, the query dtype (exact too: fp8 values fit
    fp16, bf16 and fp32). The per-layer scales are applied by the caller (k_scale folded into the softmax scale,
    v_scale into the output), so the inner products use the exact decoded codes."""
    k = tl.load(KV + offs, mask=kv_mask, other=0)
    v = tl.load(KV + stride_c_kv + offs, mask=kv_mask, other=0)
    return _decode_codes(k, v, KV_FMT, DT)


@triton.jit
def _load_kv_tile(KV, bt_row, pos, n_mask, d, d_mask, stride_c_kv, stride_c_blk, stride_c_slot, head_off,
                  PAGE: tl.constexpr, KV_FMT: tl.constexpr, DT: tl.constexpr):
    """K and V rows [BLOCK_N, BLOCK_D] of context positions `pos` (masked rows read as 0; _load_kv_decoded)."""
    tok_off = _kv_token_offsets(bt_row, pos, n_mask, stride_c_blk, stride_c_slot, head_off, PAGE)
    return _load_kv_decoded(KV, tok_off[:, None] + d[None, :], n_mask[:, None] & d_mask[None, :], stride_c_kv,
                            KV_FMT, DT)


@triton.jit
def _load_kv_tile3(KV, bt_row, pos, n_mask, d, d_mask, stride_c_kv, stride_c_blk, stride_c_slot, head_off,
                   PAGE: tl.constexpr, KV_FMT: tl.constexpr, DT: tl.constexpr):
    """_load_kv_tile as [1, BLOCK_N, BLOCK_D] tensors: the FMA-lanes route computes on [GROUP, BLOCK_N, BLOCK_D]
    in the layout of these loads (rows over warps, 16-byte vectors of a row over lanes), so the tile never
    goes through shared memory and the dot products over D reduce within a warp."""
    tok_off = _kv_token_offsets(bt_row, pos, n_mask, stride_c_blk, stride_c_slot, head_off, PAGE)
    kv_mask = n_mask[None, :, None] & d_mask[None, None, :]
    return _load_kv_decoded(KV, tok_off[None, :, None] + d[None, None, :], kv_mask, stride_c_kv, KV_FMT, DT)


@triton.jit
def _prefetch_kv_l2(KV, bt_row, start, end, n, stride_c_kv, stride_c_blk, stride_c_slot, head_off,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    """L2 prefetch hints for the K and V rows of context positions [start, end) of one kv head: every 128-byte
    line of each row. A hint only (no registers, no ordering), and L2 is the point of coherence, so a line the
    predecessor is still writing (the newest token) is never read stale afterwards."""
    LINE: tl.constexpr = 1024 // KV.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    LINES: tl.constexpr = (HEAD_DIM + LINE - 1) // LINE
    cols = tl.minimum(tl.arange(0, triton.next_power_of_2(LINES)) * LINE, HEAD_DIM - 1)
    BLOCK: tl.constexpr = n.shape[0]
    for n0 in range(start, end, BLOCK):
        pos = n0 + n
        blk = tl.load(bt_row + pos // PAGE, mask=pos < end, other=0).to(tl.int64)  # masked rows: block 0's lines
        rows = blk * stride_c_blk + (pos % PAGE) * stride_c_slot + head_off
        ptrs = KV + rows[:, None] + cols[None, :]
        prefetch_l2(ptrs)
        prefetch_l2(ptrs + stride_c_kv)


@triton.jit
def _norm_rope_rows(rows, row_mask, d, W, c, sn, eps, offset,
                    HEAD_DIM: tl.constexpr, NORM: tl.constexpr, DT: tl.constexpr):
    """[R, HEAD_DIM] rows at pointers rows[:, None] + d: optional per-head RMSNorm (weight W, `offset` for the
    (1 + w) variant), then rotate-half RoPE over all HEAD_DIM channels (c / sn: cos / sin of the token's position,
    indexed by d mod HEAD_DIM/2). The same arithmetic as kernels.fused's QK-norm + RoPE launch, rounding to DT
    between the norm and the rotation, so the fused decode sees the q and k that launch would have written."""
    HALF: tl.constexpr = HEAD_DIM // 2
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    m = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(rows[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(rows[:, None] + partner[None, :], mask=m, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(W + d).to(tl.float32) + offset
        wp = tl.load(W + partner).to(tl.float32) + offset
        x = (x * rstd * w[None, :]).to(DT).to(tl.float32)
        xp = (xp * rstd * wp[None, :]).to(DT).to(tl.float32)
    rot = tl.where(first[None, :], x * c[None, :] - xp * sn[None, :], x * c[None, :] + xp * sn[None, :])
    return rot.to(DT)


@triton.jit
def _attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """One KV tile into the online softmax state (m_i, l_i, acc) of the group's q rows; the tile has at least one
    valid position. USE_DOT: q is in the model dtype and unscaled; else fp32 and pre-scaled by qk_scale."""
    if USE_DOT:
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
    else:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the tile has a valid position
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc * alpha[:, None] + pv


# a mixed step's sequence lengths / query starts may be slices at any offset; they are read one scalar per program,
# so their alignment class would only compile another variant inside that step (micro/bench_compiles.py). The split
# count follows the step's longest context in eager steps (the graphs' follows --max-model-len): a divisor only
@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["SeqLens", "QueryStartLoc"])
def _paged_decode_kernel(
    Q, KV, Out, PartO, PartLse, BlockTables, SeqLens, QueryStartLoc, KScale, VScale,
    KNew, VNew, SlotMapping, Pos, Cos, Sin, QW, KW,  # ROPE only: the step's raw K / V rows and what rotates them
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, eps, norm_offset,
    num_splits,
    window,  # WINDOW only: the layer's sliding window (the row at position p sees keys from p - window + 1 on; a
    # constant of the layer, so specialised as Triton does)
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, USE_DOT: tl.constexpr, LANES: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, KV_FMT: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_N: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr, NEXT_TILE: tl.constexpr = False,
    EARLY_TILE: tl.constexpr = False, WINDOW: tl.constexpr = False, WIN_POS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    DT: tl.constexpr = Q.dtype.element_ty
    n = tl.arange(0, BLOCK_N)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    head_off = kvh * stride_c_head
    # seq_lens, query_start_loc and the block tables are the step's inputs (uploaded before its first kernel), so
    # they may be read before the PDL wait; q and the newest K/V come from the predecessor, so only after it
    seq_len = tl.load(SeqLens + seq)
    q_start = tl.load(QueryStartLoc + seq)
    q_end = tl.load(QueryStartLoc + seq + 1)
    has_row = q_end > q_start
    q_row = tl.maximum(q_end - 1, 0).to(tl.int64)

    # the keys the row sees: [ctx_lo, seq_len); a sliding window starts them at the row's position - window + 1
    # (WIN_POS: that position is Pos[row], for rows that see past it; else the context's last position)
    ctx_lo = 0
    if WINDOW:
        if WIN_POS:
            last = tl.load(Pos + q_row).to(tl.int32)
        else:
            last = seq_len - 1
        ctx_lo = tl.minimum(tl.maximum(last - window + 1, 0), seq_len)
    # this program's slice of the context (whole BLOCK_N tiles from ctx_lo; may be empty)
    chunk = tl.cdiv(tl.cdiv(seq_len - ctx_lo, num_splits), BLOCK_N) * BLOCK_N
    start = ctx_lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    end = tl.where(has_row, end, 0)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    read_end = end
    if ROPE:
        # Q / KNew / VNew hold this step's projections before QK-norm and RoPE. Every program rotates its q; the
        # program whose slice ends at the newest position also rotates that position's K, stores K and V in the
        # cache (fp8: encoded with the layer's scales) and attends to them from registers (merged after its
        # loop), so nothing reads that cache row in this launch. Positions, slots, cos / sin and the norm weights
        # are step inputs or constants: read before the PDL wait.
        newest = has_row & (start < end) & (end == seq_len)
        read_end = tl.where(newest, end - 1, end)
        pos_t = tl.load(Pos + q_row).to(tl.int64)
        slot = tl.load(SlotMapping + q_row, mask=has_row, other=-1).to(tl.int64)
        dh = d % (HEAD_DIM // 2)
        c = tl.load(Cos + pos_t * stride_cos + dh).to(tl.float32)
        sn = tl.load(Sin + pos_t * stride_cos + dh).to(tl.float32)
    if PREFETCH_N > 0:  # PDL: pull the slice's first KV lines into L2 while the predecessor (RoPE) finishes
        _prefetch_kv_l2(KV, bt_row, start, tl.minimum(end, start + PREFETCH_N), n, stride_c_kv, stride_c_blk,
                        stride_c_slot, head_off, HEAD_DIM, PAGE)
    if ROPE and not LANES:
        # With the store fused, every cache row this program reads ([start, read_end): the newest is attended from
        # registers) was written by an earlier step, so the first tile's loads may go out before the PDL wait,
        # while the predecessor (the qkv projection) still runs; the loop pipelines the rest.
        pos0 = start + n
        k0, v0 = _load_kv_tile(KV, bt_row, pos0, pos0 < read_end, d, d_mask, stride_c_kv, stride_c_blk,
                               stride_c_slot, head_off, PAGE, KV_FMT, DT)
    elif EARLY_TILE and not LANES:
        # The predecessor (RoPE + KV store) writes this step's rows, [seq_len - query rows, seq_len); a first tile
        # wholly below them was written by earlier steps, so its loads may go out before the PDL wait
        early = has_row & (start + BLOCK_N <= seq_len - (q_end - q_start)) & (start < read_end)
        pos0 = start + n
        k0, v0 = _load_kv_tile(KV, bt_row, pos0, (pos0 < read_end) & early, d, d_mask, stride_c_kv, stride_c_blk,
                               stride_c_slot, head_off, PAGE, KV_FMT, DT)
    pdl_enter(PDL)
    if KV_FMT >= 0:  # fp8 cache: s = q . (decode(k) * k_scale) = (q . decode(k)) * k_scale
        qk_scale = qk_scale * tl.load(KScale)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    loop_start = start
    if ROPE:
        q = _norm_rope_rows(Q + q_row * stride_qt + heads * stride_qh, g_mask & has_row, d, QW, c, sn, eps,
                            norm_offset, HEAD_DIM, NORM, DT)
        one = tl.zeros([1], tl.int64)
        k_new = _norm_rope_rows(KNew + q_row * stride_kt + kvh * stride_kh + one, newest & (one == 0), d, KW, c, sn,
                                eps, norm_offset, HEAD_DIM, NORM, DT)
        v_new = tl.load(VNew + q_row * stride_vt + kvh * stride_vh + one[:, None] + d[None, :],
                        mask=newest & (one[:, None] == 0), other=0.0)
        dst = KV + (slot // PAGE) * stride_c_blk + (slot % PAGE) * stride_c_slot + head_off + one[:, None] + d[None, :]
        store = newest & (slot >= 0)
        if KV_FMT >= 0:  # attend to the decoded codes, as a later step reading the cache will
            k_code = fp32_to_fp8(tl.math.div_rn(k_new.to(tl.float32), tl.load(KScale)), KV_FMT)
            v_code = fp32_to_fp8(tl.math.div_rn(v_new.to(tl.float32), tl.load(VScale)), KV_FMT)
            tl.store(dst, k_code, mask=store)
            tl.store(dst + stride_c_kv, v_code, mask=store)
            k_new = fp8_to_fp16(k_code, KV_FMT).to(tl.float32)
            v_new = fp8_to_fp16(v_code, KV_FMT).to(tl.float32)
        else:
            tl.store(dst, k_new.to(KV.dtype.element_ty), mask=store)
            tl.store(dst + stride_c_kv, v_new.to(KV.dtype.element_ty), mask=store)
            k_new = k_new.to(KV.dtype.element_ty).to(tl.float32)
            v_new = v_new.to(KV.dtype.element_ty).to(tl.float32)
        if not USE_DOT:
            q = q.to(tl.float32) * qk_scale
        if not LANES:
            if start < read_end:
                m_i, l_i, acc = _attend_tile(q, k0, v0, pos0 < read_end, m_i, l_i, acc, qk_scale, USE_DOT, IEEE)
            loop_start = start + BLOCK_N
    else:
        q = tl.load(Q + q_row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :] & has_row, other=0.0)
        if not USE_DOT:
            q = q.to(tl.float32) * qk_scale
        if EARLY_TILE and not LANES:
            if early:
                m_i, l_i, acc = _attend_tile(q, k0, v0, pos0 < read_end, m_i, l_i, acc, qk_scale, USE_DOT, IEEE)
                loop_start = start + BLOCK_N
    if LANES:
        # FMA route, one online softmax per (head, lane n): no cross-warp reduction inside the loop;
        # the BLOCK_N lanes are merged once at the end (like split-KV partitions).
        NEG: tl.constexpr = -1.0e30
        m3 = tl.full([BLOCK_G, BLOCK_N], NEG, tl.float32)
        l3 = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
        acc3 = tl.zeros([BLOCK_G, BLOCK_N, BLOCK_D], tl.float32)
        q3 = q[:, None, :]
        if NEXT_TILE:  # the first tile's codes, the second tile's block ids
            pos = start + n
            off3 = _kv_token_offsets(bt_row, pos, pos < read_end, stride_c_blk, stride_c_slot, head_off, PAGE)
            kv_mask3 = (pos < read_end)[None, :, None] & d_mask[None, None, :]
            k_raw = tl.load(KV + off3[None, :, None] + d[None, None, :], mask=kv_mask3, other=0)
            v_raw = tl.load(KV + stride_c_kv + off3[None, :, None] + d[None, None, :], mask=kv_mask3, other=0)
            blk_next = tl.load(bt_row + (pos + BLOCK_N) // PAGE, mask=pos + BLOCK_N < read_end, other=0)
        for n0 in range(start, read_end, BLOCK_N):
            pos = n0 + n
            n_mask = pos < read_end
            if NEXT_TILE:
                # a register prefetch (no cp.async below sm_80, and Triton pipelines no load without a dot): the
                # next tile's codes are requested before this tile is computed, from block ids loaded an iteration
                # earlier, and the ids of the tile after it go out with them
                pos_n = pos + BLOCK_N
                mask_n3 = (pos_n < read_end)[None, :, None] & d_mask[None, None, :]
                off_n = _block_offsets(blk_next, pos_n, stride_c_blk, stride_c_slot, head_off, PAGE)
                k_next = tl.load(KV + off_n[None, :, None] + d[None, None, :], mask=mask_n3, other=0)
                v_next = tl.load(KV + stride_c_kv + off_n[None, :, None] + d[None, None, :], mask=mask_n3, other=0)
                blk_next = tl.load(bt_row + (pos_n + BLOCK_N) // PAGE, mask=pos_n + BLOCK_N < read_end, other=0)
                k, v = _decode_codes(k_raw, v_raw, KV_FMT, DT)
                k_raw, v_raw = k_next, v_next
            else:
                k, v = _load_kv_tile3(KV, bt_row, pos, n_mask, d, d_mask, stride_c_kv, stride_c_blk, stride_c_slot,
                                      head_off, PAGE, KV_FMT, DT)
            s = tl.sum(q3 * k.to(tl.float32), axis=2)
            s = tl.where(n_mask[None, :], s, NEG)
            m_new = tl.maximum(m3, s)
            alpha = tl.exp2(m3 - m_new)
            p = tl.where(n_mask[None, :], tl.exp2(s - m_new), 0.0)
            l3 = l3 * alpha + p
            acc3 = acc3 * alpha[:, :, None] + p[:, :, None] * v.to(tl.float32)
            m3 = m_new
        m_i = tl.max(m3, axis=1)
        w = tl.where(l3 > 0.0, tl.exp2(m3 - m_i[:, None]), 0.0)
        l_i = tl.sum(l3 * w, axis=1)
        acc = tl.sum(acc3 * w[:, :, None], axis=1)
        m_i = tl.where(l_i > 0.0, m_i, float("-inf"))  # (an empty slice: no state, as on the per-row route)
    else:
        # Each tile's block ids are loaded one tile ahead and carried into the next iteration: K / V addresses that
        # come from a load in the same iteration make Triton's pipeliner keep one K / V buffer whatever num_stages
        # says (loads then wait for the previous tile's compute); carried ids give it num_stages - 1 buffers.
        pos = loop_start + n
        blk_next = tl.load(bt_row + pos // PAGE, mask=pos < read_end, other=0)
        for n0 in range(loop_start, read_end, BLOCK_N):
            pos = n0 + n
            n_mask = pos < read_end
            blk = blk_next
            blk_next = tl.load(bt_row + (pos + BLOCK_N) // PAGE, mask=pos + BLOCK_N < read_end, other=0)
            tok_off = _block_offsets(blk, pos, stride_c_blk, stride_c_slot, head_off, PAGE)
            k, v = _load_kv_decoded(KV, tok_off[:, None] + d[None, :], n_mask[:, None] & d_mask[None, :],
                                    stride_c_kv, KV_FMT, DT)
            m_i, l_i, acc = _attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, USE_DOT, IEEE)
    if ROPE:  # the newest position, from registers (q is pre-scaled on the FMA route)
        s_new = tl.sum(q.to(tl.float32) * k_new, axis=1)
        if USE_DOT:
            s_new = s_new * qk_scale
        s_new = tl.where(newest, s_new, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p_new = tl.exp2(s_new - m_safe)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new
        m_i = m_new

    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if KV_FMT >= 0:  # sum_j p_j (decode(v_j) * v_scale) = v_scale * sum_j p_j decode(v_j)
        o = o * tl.load(VScale)
    if SPLIT:
        # scratch: PartO [num_seqs, num_heads, num_splits, HEAD_DIM], PartLse [num_seqs, num_heads, num_splits]
        num_heads = tl.num_programs(1) * GROUP
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(PartLse + row, lse, mask=g_mask)
        tl.store(PartO + row[:, None] * HEAD_DIM + d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
    else:
        tl.store(Out + q_row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :] & has_row)


@triton.jit(do_not_specialize=["num_splits"])  # (a loop bound; follows the step, as the decode kernel's)
def _decode_reduce_kernel(
    Out, PartO, PartLse, QueryStartLoc,
    stride_ot, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    q_start = tl.load(QueryStartLoc + seq)
    q_end = tl.load(QueryStartLoc + seq + 1)
    has_row = q_end > q_start
    q_row = tl.maximum(q_end - 1, 0).to(tl.int64)

    base = (seq.to(tl.int64) * num_heads + head) * num_splits
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(PartLse + base + s, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_D], tl.float32)
    for i in range(0, num_splits):
        w = tl.exp2(tl.load(PartLse + base + i) - m)
        o = tl.load(PartO + (base + i) * HEAD_DIM + d, mask=d_mask, other=0.0)
        acc += w * o
        den += w
    out = acc / tl.where(den > 0.0, den, 1.0)  # all-empty (seq_len 0): zeros
    tl.store(Out + q_row * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty),
             mask=d_mask & has_row)


def _specs():
    decode, reduce = [], []
    # float caches (KV_FMT -1) and fp8 caches (uint8 codes): e4m3 at every head size and route, e5m2 (only
    # the decode helper differs) at d128
    kv_kinds = [("fp16", -1, None), ("e4m3", 0, None), ("e5m2", 1, 128)]
    for d in (64, 128, 256):
        for use_dot in (False, True):
            for kv_name, kv_fmt, only_d in kv_kinds:
                if only_d is not None and d != only_d:
                    continue
                sig = {"Q": "*fp16", "KV": "*u8" if kv_fmt >= 0 else "*fp16", "Out": "*fp16", "PartO": "*fp32",
                       "PartLse": "*fp32", "BlockTables": "*i32", "SeqLens": "*i32", "QueryStartLoc": "*i32",
                       "KScale": "*fp32", "VScale": "*fp32", "KNew": "*fp16", "VNew": "*fp16",
                       "SlotMapping": "*i64", "Pos": "*i64", "Cos": "*fp32", "Sin": "*fp32", "QW": "*fp16",
                       "KW": "*fp16", "qk_scale": "fp32",
                       "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
                       "stride_c_kv": "i64", "stride_c_blk": "i32", "stride_c_slot": "i32",
                       "stride_c_head": "i32", "stride_bt": "i32", "stride_kt": "i32", "stride_kh": "i32",
                       "stride_vt": "i32", "stride_vh": "i32", "stride_cos": "i32", "eps": "fp32",
                       "norm_offset": "fp32", "num_splits": "i32", "window": "i32",
                       "GROUP": "constexpr", "BLOCK_G": "constexpr", "HEAD_DIM": "constexpr",
                       "BLOCK_D": "constexpr", "BLOCK_N": "constexpr", "PAGE": "constexpr",
                       "USE_DOT": "constexpr", "LANES": "constexpr", "SPLIT": "constexpr", "IEEE": "constexpr",
                       "KV_FMT": "constexpr", "PDL": "constexpr", "PREFETCH_N": "constexpr",
                       "ROPE": "constexpr", "NORM": "constexpr", "NEXT_TILE": "constexpr", "EARLY_TILE": "constexpr",
                       "WINDOW": "constexpr", "WIN_POS": "constexpr"}
                block_g = 16 if use_dot else 4
                for lanes in ((False,) if use_dot else (False, True)):
                    route = 'dot' if use_dot else 'fma-lanes' if lanes else 'fma'
                    # the fused QK-norm + RoPE + KV-store prologue at d128 (without the norm at d64); the per-lane
                    # route's smaller tile for many programs (LANES_HALF_TILE_PER_SM) at d128
                    fused = ((True, d == 128, False, False),) if d in (64, 128) else ()
                    small = ((False, False, True, False),) if lanes and d == 128 else ()
                    # the per-lane route's next-tile register prefetch at d128 where LANES_NEXT_TILE takes it: the
                    # half tile, and an fp8 cache's full tile (e4m3; e5m2 differs only in the decode helper)
                    ahead = ()
                    if lanes and d == 128 and kv_fmt <= 0:
                        ahead = ((False, False, True, True),) + (((False, False, False, True),) if kv_fmt == 0 else ())
                    # a sliding window placed by the rows' positions (the DFlash drafter's layers) at d128, fp16
                    window = ((False, False, False, False, True),) if d == 128 and kv_fmt < 0 else ()
                    variants = tuple(v + (False,) for v in ((False, False, False, False),) + fused + small + ahead)
                    for rope, norm, half, next_tile, win in variants + window:
                        block_n = _default_block_n(d, block_g, use_dot, lanes, many=half)
                        decode.append(CompileSpec(signature=sig, constexprs={
                            "GROUP": 4, "BLOCK_G": block_g, "HEAD_DIM": d, "BLOCK_D": d, "BLOCK_N": block_n,
                            "PAGE": 16, "USE_DOT": use_dot, "LANES": lanes, "SPLIT": True, "IEEE": False,
                            "KV_FMT": kv_fmt, "PDL": False, "PREFETCH_N": 0, "ROPE": rope, "NORM": norm,
                            "NEXT_TILE": next_tile, "EARLY_TILE": False, "WINDOW": win, "WIN_POS": win},
                            label=f"fp16 d{d} gqa4 {route}" + ("" if kv_fmt < 0 else f" kv-{kv_name}")
                            + (" +qk-norm" if norm else "") + (" +rope+kv-store" if rope else "")
                            + (f" block_n {block_n}" if half else "") + (" next-tile" if next_tile else "")
                            + (" sliding-window" if win else ""), compat=not use_dot))
        rsig = {"Out": "*fp16", "PartO": "*fp32", "PartLse": "*fp32", "QueryStartLoc": "*i32",
                "stride_ot": "i32", "stride_oh": "i32", "num_splits": "i32",
                "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr", "BLOCK_S": "constexpr", "PDL": "constexpr"}
        reduce.append(CompileSpec(signature=rsig, constexprs={"HEAD_DIM": d, "BLOCK_D": d, "BLOCK_S": 32, "PDL": False},
                                  label=f"fp16 d{d}"))
    return decode, reduce


def _default_block_n(block_d: int, block_g: int, use_dot: bool, lanes: bool = False, many: bool = False) -> int:
    """many: the launch has enough programs to fill the SMs several times over (LANES_HALF_TILE_PER_SM on the FMA
    per-lane route, DOT_SMALL_TILE_PER_SM on the tl.dot route)."""
    if use_dot:
        return 32 if many or block_d > 128 else 64
    # keep the [BLOCK_G, BLOCK_N, BLOCK_D] fp32 product (FMA-lanes: the accumulator) near 8K values
    block_n = max(4 if lanes else 8, min(64, 8192 // (block_g * block_d)))
    if lanes and many:
        block_n = max(4, block_n // 2)  # a smaller accumulator, so more programs are resident per SM
    return block_n


_decode_specs, _reduce_specs = _specs()
# its tl.dot specs are native-route only (compat=False): below sm_80 and under --compat the decode runs on FMA
# (TritonAttentionBackend._use_dot)
register_kernel("attention.paged_decode", _paged_decode_kernel, _decode_specs, compat=True)
register_kernel("attention.paged_decode_reduce", _decode_reduce_kernel, _reduce_specs, compat=True)


# --- host side ---------------------------------------------------------------------------------

# FMA route (sm_70/75, --compat sm70) variant: per-lane online softmax (True) or per-row (False). The per-lane route
# computes in its loads' layout, so its dot products reduce within a warp and nothing crosses warps in the loop; the
# per-row route needs cross-warp reductions every tile. H200, --compat-style launches (benchmarks/results/
# attn-decode-fma-ef2875c.txt): per-lane 1.2-2.2 TB/s where per-row reads 0.4-0.6 (3-7x), and 8B 64 concurrent under
# --compat sm70 7,880 vs 6,232 output tok/s.
FMA_LANES_DEFAULT = True
# Per-lane route: half the default BLOCK_N once sequences x kv heads x splits reach this many programs per SM. Same
# file: 8B heads, 64 x 128-256 tokens (512 programs) 36.3 us with BLOCK_N 8 vs 43.1 with 16, 64 x ~1K 121.5 vs 154.2,
# Qwen2.5-0.5B 64 x ~1K (384) 42.9 vs 48.4; but 8 x 8K (320 programs, 5 splits) 162.3 vs 130.2 and 1 x 32K (264)
# 96.4 vs 75.7.
LANES_HALF_TILE_PER_SM = 2.75
# Per-lane route: the next-tile register prefetch (next_tile=None) with the half tile (the LANES_HALF_TILE_PER_SM
# rule) and with any fp8 cache; not for a float cache at fewer programs. H200, --compat-style launches
# (benchmarks/results/session41/attn-decode-fma-7f4c3f6.txt, default tile vs + next tile): 8B heads fp16 64 x
# 128-256 31.9 vs 36.6 us, 64 x ~1K 100.1 vs 122.5, Qwen2.5-0.5B 64 x ~1K 36.1 vs 43.6 (all half tile), but 8 x 8K
# 147.0 vs 131.1 and 1 x 32K 86.7 vs 76.9 (full tile); fp8 e4m3 every case faster (47.1 / 174.8 / 187.8 / 79.0 vs
# 49.4 / 183.0 / 265.0 / 98.5). False: never.
LANES_NEXT_TILE = True
MIN_TOKENS_PER_SPLIT = 256
# tl.dot route: once sequences x kv heads x splits give at least this many programs per SM, BLOCK_N 32 and 2 warps
# (the pipelined K / V buffers of BLOCK_N 64 would leave too few programs resident), else BLOCK_N 64 (32 at d256)
# and 4 warps. H200, 32 q / 8 kv heads, d128, this kernel against the one before its block ids were carried
# (benchmarks/results/session40/attn-decode-ab-*.txt): 64 x 128-256 tokens 18.0 us (32, 2 warps) vs 18.2 before;
# 64 x ~1K 66.5 vs 67.0; 16 x 128-256 8.0 (64, 4 warps) vs 10.1; 4 x 2-4K (9 splits) 20.1 vs 23.0; 1 x 8K (33 splits)
# 16.5 vs 18.6. BLOCK_N 64 with 2 warps at 64 x 128-256 now takes 23.0 (two waves).
DOT_SMALL_TILE_PER_SM = 3
# With PDL, each program may prefetch the K/V lines of its first this-many positions into L2 before waiting for
# RoPE (which writes q and the newest K/V). Off: measured on the H200 (benchmarks/results/attn-prefetch-chain-90fd74c.txt,
# 36 RMSNorm -> decode pairs in a graph), 64 sequences at 128-256 tokens take 19.0 us per layer without, 19.1 / 19.9 /
# 21.6 with 64 / 128 / 256 tokens; 16 sequences gain 0.5 us with 64-128; and 64 concurrent end to end fell from
# 9,109 to 8,892 output tok/s with 256 (same call). Most programs start after the predecessor anyway (512 programs,
# one resident wave), so their prefetch only duplicates their own loads.
KV_PREFETCH_TOKENS = 0
# With PDL and the RoPE launch storing K / V (no fused rope), the dot / per-row routes issue their first tile's loads
# before the PDL wait when that tile lies wholly below the rows the step writes (session 49). Off: the 8B at 64 x
# 128/128 on an H100 ran TPOT 6.700 ms with it against 6.708 / 6.704 without (session 73, A B A in one call).
EARLY_FIRST_TILE = False
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      waves: int = 2) -> int:
    """Split count so that num_seqs * num_kv_heads * splits fills ~`waves` programs per SM, while
    each split keeps at least MIN_TOKENS_PER_SPLIT tokens of the longest context."""
    base = max(1, num_seqs * num_kv_heads)
    want = triton.cdiv(waves * num_sms, base)
    cap = max(1, triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT))
    return int(max(1, min(want, cap, MAX_SPLITS)))


def _scales(k_scale, v_scale, device):
    """Scale tensors for a launch (fp32, one element; 1.0 when None). No copy for fp32 device tensors,
    so this is safe inside CUDA-graph capture."""
    from voltllm.attention.kv_spec import unit_scale

    def one(s):
        if s is None:
            return unit_scale(device)
        return s if s.dtype == torch.float32 else s.float()
    return one(k_scale), one(v_scale)


def decode_scratch_numel(num_seqs: int, num_heads: int, num_splits: int, head_dim: int) -> tuple[int, int]:
    """(fp32 elements of partial outputs, fp32 elements of partial lse) for one split-KV launch."""
    rows = num_seqs * num_heads * num_splits
    return rows * head_dim, rows


def _rope_launch_args(rope, slot_mapping, q: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[list, list]:
    """The kernel's ROPE pointer and scalar arguments (placeholders without rope), after checking them."""
    if rope is None:
        return [q] * 8, [0, 0, 0, 0, 0, 0.0, 0.0]
    t = q.shape[0]
    if head_dim & (head_dim - 1) or rope.cos.shape[-1] * 2 != head_dim or rope.sin.shape != rope.cos.shape:
        raise ValueError(f"fused decode RoPE needs a power-of-two head_dim rotated whole; got head_dim {head_dim}, "
                         f"cos {tuple(rope.cos.shape)}")
    for name, x in (("k", rope.k), ("v", rope.v)):
        if x.shape != (t, num_kv_heads, head_dim) or x.stride(-1) != 1 or x.dtype != q.dtype:
            raise ValueError(f"rope.{name} must be [{t}, {num_kv_heads}, {head_dim}] {q.dtype} with a contiguous "
                             f"last dim, got {tuple(x.shape)} {x.dtype}")
    if slot_mapping is None or slot_mapping.dtype != torch.int64:
        raise ValueError("fused decode RoPE needs the int64 slot_mapping (read at each sequence's query row)")
    if rope.positions.dtype != torch.int64 or rope.positions.shape[0] < t or rope.positions.stride(0) != 1:
        raise ValueError("rope.positions must be a contiguous int64 tensor with a position per row")
    if rope.cos.stride(-1) != 1 or rope.sin.stride(0) != rope.cos.stride(0):
        raise ValueError("rope.cos / rope.sin must share a row stride with a contiguous last dim")
    norm = rope.q_norm is not None
    if norm and (rope.k_norm is None or rope.q_norm.numel() != head_dim or rope.k_norm.numel() != head_dim):
        raise ValueError(f"q / k norm weights must both be given with head_dim={head_dim} elements")
    qw, kw = (rope.q_norm.contiguous(), rope.k_norm.contiguous()) if norm else (rope.cos, rope.cos)
    args = [rope.k, rope.v, slot_mapping, rope.positions, rope.cos, rope.sin, qw, kw]
    strides = [rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1), rope.cos.stride(0),
               float(rope.eps), float(rope.norm_offset)]
    return args, strides


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, scale: float, out: torch.Tensor, num_splits: int = 1,
                 part_o: torch.Tensor | None = None, part_lse: torch.Tensor | None = None,
                 use_dot: bool = True, fma_lanes: bool = False, block_n: int | None = None,
                 num_warps: int | None = None, kv_fmt: int = -1, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, num_stages: int | None = None,
                 prefetch_tokens: int | None = None, rope=None, slot_mapping: torch.Tensor | None = None,
                 num_sms: int = 0, next_tile: bool | None = None, early_tile: bool | None = None,
                 window: int = 0, query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention for each sequence's last query row (query_start_loc[i+1]-1) into `out`.

    kv_fmt: -1 for a float cache (same dtype family as q); fp8_codec.FP8_E4M3 / FP8_E5M2 for a uint8 fp8
    cache decoded in software, FP8_E4M3_HW for E4M3 through the GPU's conversion (sm_89+), read as
    decode(code) * k_scale / v_scale (fp32 tensors of one element on q's device; None = 1).

    q/out: [T, num_heads, head_dim] (last dim contiguous). Sequences with an empty query range write
    nothing. With num_splits > 1, part_o / part_lse are fp32 scratch buffers with at least
    decode_scratch_numel(...) elements. use_dot: tl.dot inner products (tensor cores); otherwise CUDA-core
    FMA, with fma_lanes choosing the per-lane online softmax variant. prefetch_tokens: with PDL on, each program
    asks for the K/V lines of this many of its first context positions before it waits for its predecessor
    (None: KV_PREFETCH_TOKENS; 0: none; without PDL never, as there is nothing to overlap).
    rope (voltllm.attention.backend.DecodeRope) with slot_mapping: q and rope.k are this step's rows before
    QK-norm and RoPE; the kernel rotates them and stores the newest K / V at slot_mapping (-1: not stored), so no
    RoPE or KV-write launch precedes it. Rotary over the whole head (head_dim a power of two).
    num_sms: the device's SM count, for the default tile and warps (0: those for few programs).
    next_tile (FMA per-lane route only): request each tile's K / V before computing the previous one (a register
    prefetch; the route runs where Triton has no cp.async pipelining). None: by LANES_NEXT_TILE's rule.
    early_tile (without rope, not the per-lane route): issue the first tile's loads before the PDL wait when it lies
    below the step's new rows. None: EARLY_FIRST_TILE with PDL on (without PDL it only moves the loads up).
    window > 0: a sliding-window layer's; each row sees keys from its position - window + 1 to its sequence's end,
    its position read from query_positions (int64 [T], contiguous: rows that see past their own position) or, without
    it, the sequence's last position (rope's positions are then those same positions).
    """
    assert not (use_dot and fma_lanes), "fma_lanes is a variant of the FMA route (use_dot=False)"
    assert fma_lanes or not next_tile, "next_tile is an option of the FMA per-lane route (fma_lanes=True)"
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0
    assert q.stride(2) == 1 and out.stride(2) == 1 and kv_cache.stride(4) == 1
    assert (kv_fmt >= 0) == (kv_cache.dtype == torch.uint8), "fp8 caches are uint8 and need kv_fmt >= 0"
    if num_seqs == 0:
        return out
    k_scale, v_scale = _scales(k_scale, v_scale, q.device)
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group)
    programs = num_seqs * num_kv_heads * num_splits
    many = num_sms > 0 and programs >= (DOT_SMALL_TILE_PER_SM if use_dot else LANES_HALF_TILE_PER_SM) * num_sms
    if block_n is None:
        block_n = _default_block_n(block_d, block_g, use_dot, fma_lanes, many)
    if num_warps is None:
        num_warps = 2 if use_dot and many else 4
    if next_tile is None:
        next_tile = LANES_NEXT_TILE and fma_lanes and (many or kv_fmt >= 0)
    split = num_splits > 1
    if split:
        need_o, need_l = decode_scratch_numel(num_seqs, num_heads, num_splits, head_dim)
        assert part_o is not None and part_lse is not None
        assert part_o.numel() >= need_o and part_lse.numel() >= need_l
        assert part_o.dtype == torch.float32 and part_lse.dtype == torch.float32
    else:
        part_o = part_lse = out  # unused
    ieee = q.dtype == torch.float32
    rope_args, rope_strides = _rope_launch_args(rope, slot_mapping, q, num_kv_heads, head_dim)
    win_pos = window > 0 and query_positions is not None
    if win_pos and rope is None:
        if query_positions.dtype != torch.int64 or query_positions.stride(0) != 1:
            raise ValueError("query_positions must be a contiguous int64 tensor with a position per row")
        rope_args[3] = query_positions  # (the kernel's Pos; with rope, rope.positions are the rows' positions)
    launch = pdl.launch_options()
    prefetch = (KV_PREFETCH_TOKENS if prefetch_tokens is None else prefetch_tokens) if launch["PDL"] else 0
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_cache, out, part_o, part_lse, block_tables, seq_lens, query_start_loc, k_scale, v_scale,
        *rope_args,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        *rope_strides,
        num_splits, int(window),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        PAGE=kv_cache.shape[2], USE_DOT=use_dot, LANES=fma_lanes, SPLIT=split, IEEE=ieee, KV_FMT=kv_fmt,
        PREFETCH_N=triton.cdiv(prefetch, block_n) * block_n, ROPE=rope is not None,
        NORM=rope is not None and rope.q_norm is not None, NEXT_TILE=next_tile,
        EARLY_TILE=(EARLY_FIRST_TILE and launch["PDL"] if early_tile is None else early_tile) and rope is None
        and not fma_lanes, WINDOW=window > 0, WIN_POS=win_pos,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}), **launch,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_o, part_lse, query_start_loc,
            out.stride(0), out.stride(1),
            num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=1 if block_d <= 64 else 2, **pdl.launch_options(),
        )
    return out
