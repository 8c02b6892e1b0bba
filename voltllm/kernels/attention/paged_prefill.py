"""Varlen causal prefill attention over the paged KV cache (chunked prefill, prefix hits, mixed batches).

Each sequence i owns query rows query_start_loc[i]:query_start_loc[i+1] (length Lq) and has seq_lens[i]
tokens (L) of context in the cache, this step's rows included (kv_write ran first). Query row j sits at
position L - Lq + j and attends to cache positions 0..L-Lq+j.

Grid: (query tiles, num_seqs, num_kv_heads). A program's BLOCK_M rows pack ROWS query rows x GROUP q
heads of one kv-head group (row r = query offset r // GROUP, head r % GROUP), so every K/V tile is read
once per group and decode rows (Lq = 1) still fill GROUP rows of the tile. Flash-attention style tiles:
S = Q K^T with tl.dot, online softmax in fp32 (base 2), acc += P V with tl.dot. The KV loop runs in two
parts: tiles entirely below the tile's first query position (no mask) and the diagonal tiles (causal +
bounds mask). Reference: voltllm.attention.torch_ref (gather_kv + attend_one).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from voltllm.kernels.attention.paged_decode import _scales
from voltllm.kernels.fp8_codec import fp8_to_fp16
from voltllm.kernels.registry import CompileSpec, register_kernel

LOG2E = 1.4426950408889634


@triton.jit
def _attn_tile(q, KV, bt_row, pos, kv_mask_n, d, d_mask, stride_c_kv, stride_c_blk, stride_c_slot, head_off,
               PAGE: tl.constexpr, IEEE: tl.constexpr, KV_FMT: tl.constexpr):
    blk = tl.load(bt_row + pos // PAGE, mask=kv_mask_n, other=0).to(tl.int64)
    tok_off = blk * stride_c_blk + (pos % PAGE) * stride_c_slot + head_off
    m2 = kv_mask_n[:, None] & d_mask[None, :]
    k = tl.load(KV + tok_off[:, None] + d[None, :], mask=m2, other=0)
    v = tl.load(KV + stride_c_kv + tok_off[:, None] + d[None, :], mask=m2, other=0)
    if KV_FMT >= 0:  # uint8 fp8 codes -> q's dtype, exact (scales are applied by the caller)
        k = fp8_to_fp16(k, KV_FMT).to(q.dtype)
        v = fp8_to_fp16(v, KV_FMT).to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s, v


# Step-varying arguments out of the specialisation (each new class compiled a variant inside the step that met it,
# micro/bench_compiles.py): the decode-rows bound (1 or 2), the block-table row stride and the per-step tables, which
# may be slices at any offset; all are read as scalars or gathered, so the specialisation gained nothing
@triton.jit(do_not_specialize=["min_q_len", "stride_bt"],
            do_not_specialize_on_alignment=["BlockTables", "SeqLens", "QueryStartLoc"])
def _paged_prefill_kernel(
    Q, KV, Out, BlockTables, SeqLens, QueryStartLoc, KScale, VScale,
    qk_scale,  # softmax scale * log2(e)
    min_q_len,  # sequences with fewer query rows are left alone (their rows come from the decode kernel)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    stride_bt,
    window,  # WINDOW only: the layer's sliding window (row at position p sees keys p - window + 1 .. p)
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    IEEE: tl.constexpr, KV_FMT: tl.constexpr, WINDOW: tl.constexpr = False,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    if KV_FMT >= 0:  # fp8 cache: k_scale folds into the softmax scale, v_scale into the output
        qk_scale = qk_scale * tl.load(KScale)

    seq_len = tl.load(SeqLens + seq)
    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    prefix = seq_len - q_len
    tile_q0 = tile * ROWS
    mine = q_len >= min_q_len
    active = (tile_q0 < q_len) & mine

    r = tl.arange(0, BLOCK_M)
    q_off = tile_q0 + r // GROUP
    heads = kvh * GROUP + r % GROUP
    row_mask = (r < ROWS * GROUP) & (q_off < q_len) & mine
    q_pos = prefix + q_off
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + q_off).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    # keys [0, lo) are visible to every row of the tile; keys [lo, hi) need the causal mask
    first_pos = prefix + tile_q0
    last_pos = tl.minimum(first_pos + ROWS - 1, seq_len - 1)
    lo = tl.where(active, ((first_pos + 1) // BLOCK_N) * BLOCK_N, 0)
    hi = tl.where(active, last_pos + 1, 0)
    full_end = lo
    if WINDOW:  # every tile from the first row's window on is masked (window edge, diagonal)
        lo = tl.where(active, (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N, 0)
        full_end = 0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    head_off = kvh * stride_c_head

    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + n
        s, v = _attn_tile(q, KV, bt_row, pos, pos < hi, d, d_mask, stride_c_kv, stride_c_blk, stride_c_slot,
                          head_off, PAGE, IEEE, KV_FMT)
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + n
        n_mask = pos < hi
        s, v = _attn_tile(q, KV, bt_row, pos, n_mask, d, d_mask, stride_c_kv, stride_c_blk, stride_c_slot,
                          head_off, PAGE, IEEE, KV_FMT)
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # without a window a row can only be fully masked in a tile after it has seen key 0, so m_new is finite;
        # with one a row may have seen nothing yet (tiles before its window): its state stays empty
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if WINDOW else m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FMT >= 0:
        o = o * tl.load(VScale)
    tl.store(Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(Out.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


SHORT_PROMPT = 512  # query rows up to which sm_90+ d128 prefill takes the small tile


def prefill_config(head_dim: int, group: int, max_query_len: int, capability: tuple[int, int] | None = None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for one launch. BLOCK_M shrinks for short query tiles
    (decode-heavy mixed batches) so padded rows do not dominate."""
    block_d = triton.next_power_of_2(head_dim)
    if capability is not None and capability < (8, 0):
        # sm_70/75: tl.dot is FMA, registers are the limit; these tiles compile without spills
        # (ptxas -v, sm_70). Compute-bound prefill there should prefer a vendor kernel (SDPA).
        max_m, block_n = 32, (32 if block_d <= 128 else 16)
        num_warps = 4 if block_d <= 64 else 8
        num_stages = 2
    else:
        max_m = 64 if block_d > 128 else 128
        block_n = 32 if block_d > 128 else 64
        num_stages = 2 if block_d > 128 else 3
    block_m = max(16, min(max_m, triton.next_power_of_2(max(1, max_query_len) * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    if capability is None or capability >= (8, 0):
        num_warps = 8 if block_m * block_d >= 128 * 128 else 4
    if capability is not None and capability >= (9, 0):
        # H200 timings, 4K causal fp16, GQA 32/8 (docs/kernels.md, Attention)
        if block_d > 128:
            block_m = max(16, min(128, triton.next_power_of_2(max(1, max_query_len) * group)))
            block_m = max(block_m, triton.next_power_of_2(group))
            num_warps = 8 if block_m * block_d >= 128 * 128 else 4
            # d256: (128, 32, 8, 2) 284 TFLOP/s vs (64, 32, 8, 2) 152
        elif block_d == 128 and max_query_len <= SHORT_PROMPT and block_m >= 64 and group <= 16:
            # short prompts (benchmarks/results/attn-prefill-sweep-0971a87.txt, GQA 32/8): 64 x 128 tokens 80.5 us
            # with (64, 32, 4, 2) vs 145.0 with (128, 128, 8, 3); 8 x 512 89.7 vs 106.9
            block_m, block_n, num_warps, num_stages = 64, 32, 4, 2
        elif block_d == 128 and block_m == 128:
            block_n = 128  # d128: (128, 128, 8, 3) 330 TFLOP/s vs (128, 64, 8, 3) 290 (4K), 390 vs 381 (8K)
        elif block_m == 128:
            num_warps = 8  # d64: (128, 64, 8, 3) 281 TFLOP/s vs (128, 64, 4, 3) 260
    return block_m, block_n, num_warps, num_stages


def _specs():
    specs = []
    for d in (64, 128, 256):
        for kv_name, kv_fmt in (("fp16", -1), ("e4m3", 0), ("e5m2", 1)):
            if kv_fmt == 1 and d != 128:
                continue  # e5m2 differs from e4m3 only in the decode helper
            sig = {"Q": "*fp16", "KV": "*u8" if kv_fmt >= 0 else "*fp16", "Out": "*fp16", "BlockTables": "*i32",
                   "SeqLens": "*i32", "QueryStartLoc": "*i32", "KScale": "*fp32", "VScale": "*fp32",
                   "qk_scale": "fp32", "min_q_len": "i32",
                   "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
                   "stride_c_kv": "i64", "stride_c_blk": "i32", "stride_c_slot": "i32", "stride_c_head": "i32",
                   "stride_bt": "i32", "window": "i32",
                   "GROUP": "constexpr", "ROWS": "constexpr", "BLOCK_M": "constexpr", "HEAD_DIM": "constexpr",
                   "BLOCK_D": "constexpr", "BLOCK_N": "constexpr", "PAGE": "constexpr", "IEEE": "constexpr",
                   "KV_FMT": "constexpr", "WINDOW": "constexpr"}
            block_m, block_n, _, _ = prefill_config(d, 4, 4096, capability=(7, 0))
            for window in (False, True) if d == 128 and kv_fmt < 0 else (False,):  # sliding-window layers: d128
                specs.append(CompileSpec(signature=sig, constexprs={
                    "GROUP": 4, "ROWS": block_m // 4, "BLOCK_M": block_m, "HEAD_DIM": d, "BLOCK_D": d,
                    "BLOCK_N": block_n, "PAGE": 16, "IEEE": False, "KV_FMT": kv_fmt, "WINDOW": window},
                    label=f"fp16 d{d} gqa4" + ("" if kv_fmt < 0 else f" kv-{kv_name}")
                    + (" sliding-window" if window else "")))
    return specs


# not in the sm_70 / sm_75 gate: the compat route (and any GPU below sm_80) prefills through the fp16 bridge + SDPA
# (attention/compat_backend.py), never this kernel (TritonAttentionBackend._use_sdpa_prefill)
register_kernel("attention.paged_prefill", _paged_prefill_kernel, _specs(), compat=False)


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, scale: float, out: torch.Tensor, max_query_len: int,
                  config: tuple[int, int, int, int] | None = None,
                  capability: tuple[int, int] | None = None, kv_fmt: int = -1,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  min_query_len: int = 1, window: int = 0) -> torch.Tensor:
    """Causal attention of every query row of every sequence over its paged context, into `out`.
    min_query_len: sequences with fewer query rows are skipped (their rows of `out` untouched: the backend's
    decode kernel writes a mixed step's long-context decode rows, with split-KV).
    window > 0: a sliding-window layer's; row j (position L - Lq + j) sees positions L - Lq + j - window + 1 on.

    q/out: [T, num_heads, head_dim] (last dim contiguous); max_query_len: host int bound on query lengths
    (sizes the grid; rows past a sequence's own length are masked). kv_fmt / k_scale / v_scale: as in
    paged_decode (uint8 fp8 cache decoded in registers)."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0
    assert q.stride(2) == 1 and out.stride(2) == 1 and kv_cache.stride(4) == 1
    assert (kv_fmt >= 0) == (kv_cache.dtype == torch.uint8), "fp8 caches are uint8 and need kv_fmt >= 0"
    if num_seqs == 0 or max_query_len <= 0:
        return out
    k_scale, v_scale = _scales(k_scale, v_scale, q.device)
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = config or prefill_config(head_dim, group, max_query_len, capability)
    assert block_m >= group and block_m >= 16 and block_n >= 16
    rows = block_m // group
    grid = (triton.cdiv(max_query_len, rows), num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        q, kv_cache, out, block_tables, seq_lens, query_start_loc, k_scale, v_scale,
        scale * LOG2E, int(min_query_len),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), int(window),
        GROUP=group, ROWS=rows, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n, PAGE=kv_cache.shape[2], IEEE=q.dtype == torch.float32, KV_FMT=kv_fmt,
        WINDOW=window > 0, num_warps=num_warps, num_stages=num_stages,
    )
    return out
