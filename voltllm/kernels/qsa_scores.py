"""Qwen4-Exp QSA block scores for decode rows, reading only the blocks each row's context has completed.

For row i at token index p (n_c = (p + 1) // r complete blocks of r tokens) and block j < n_c:

    score[i, j] = sum_h relu(q[i, h] . key_j) / sqrt(d)     (fp32; key_j: the block's pooled key, stored at the
                                                           cache row of the block's last token, j r + r - 1)

with a score of exactly 0 (every head's dot product <= 0) made -(j + 1), earlier blocks first (qwen4_exp_qsa.
break_ties), and -inf for j >= n_c. The torch form (qwen4_exp_qsa_decode.block_scores, the reference) gathers every
block the block tables can hold, whatever the row's context: at --max-model-len 256K and r = 4 that is 64K keys per
row and layer in every CUDA-graph replay. Here program (i, c) takes blocks [c BLOCK_J, (c + 1) BLOCK_J) of row i and
stores -inf without a load once they lie past n_c, so a step reads the keys its rows' contexts hold. Every shape stays
static (the grid covers the tables' width): CUDA-graph safe. fp32 products element by element (no TF32 tensor-core
dots), so the sums differ from torch's only in their order.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel


@triton.jit
def _qsa_block_scores_kernel(Q, KEYS, TABLES, TOKEN, OUT, NB, stride_qr, stride_qh, stride_key, stride_tab,
                             stride_out, ratio, block_size, sqrt_d, H: tl.constexpr, D: tl.constexpr,
                             BLOCK_J: tl.constexpr):
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    complete = (tl.load(TOKEN + row).to(tl.int64) + 1) // ratio
    in_table = j < NB
    out_ptr = OUT + row.to(tl.int64) * stride_out + j
    if tl.program_id(1) * BLOCK_J >= complete:  # none of these blocks is complete at the row's position
        tl.store(out_ptr, tl.full([BLOCK_J], float("-inf"), tl.float32), mask=in_table)
        return
    live = in_table & (j < complete)
    ends = (j + 1).to(tl.int64) * ratio - 1
    page = tl.load(TABLES + row.to(tl.int64) * stride_tab + ends // block_size, mask=live, other=0)
    slot = page.to(tl.int64) * block_size + ends % block_size
    d = tl.arange(0, D)
    keys = tl.load(KEYS + slot[:, None] * stride_key + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_J], dtype=tl.float32)
    q_row = Q + row.to(tl.int64) * stride_qr
    for h in range(H):
        q = tl.load(q_row + h * stride_qh + d).to(tl.float32)
        acc += tl.maximum(tl.sum(keys * q[None, :], axis=1), 0.0)
    score = acc / sqrt_d
    score = tl.where(score == 0.0, -(j + 1).to(tl.float32), score)
    tl.store(out_ptr, tl.where(live, score, float("-inf")), mask=in_table)


BLOCK_J = 64  # blocks per program: [64, d] fp32 keys in registers (d <= 128: 32 KB per program)


def _specs() -> list[CompileSpec]:
    sig = {"Q": "", "KEYS": "", "TABLES": "*i32", "TOKEN": "*i64", "OUT": "*fp32", "NB": "i32", "stride_qr": "i32",
           "stride_qh": "i32", "stride_key": "i32", "stride_tab": "i32", "stride_out": "i32", "ratio": "i32",
           "block_size": "i32", "sqrt_d": "fp32", "H": "constexpr", "D": "constexpr", "BLOCK_J": "constexpr"}
    return [CompileSpec({**sig, "Q": dt, "KEYS": dt}, {"H": h, "D": d, "BLOCK_J": BLOCK_J}, f"{dt[1:]} h{h} d{d}")
            for dt in ("*fp16", "*fp32") for h, d in ((16, 128), (4, 32))]  # (no bf16 on sm_70 / 75)


register_kernel("qsa.block_scores", _qsa_block_scores_kernel, _specs())


def _scores_out(out: Optional[torch.Tensor], rows: int, nb: int, device: torch.device, name: str) -> torch.Tensor:
    """The caller's output (checked) or a new fp32 [rows, nb]."""
    if out is None:
        return torch.empty(rows, nb, dtype=torch.float32, device=device)
    if out.shape != (rows, nb) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be fp32 {(rows, nb)} with contiguous rows")
    return out


def qsa_block_scores(q_rot: torch.Tensor, pooled_keys: torch.Tensor, token_index: torch.Tensor,
                     block_tables: torch.Tensor, ratio: int, block_size: int,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q_rot [R, n_idx, d] (normed, RoPE'd; row i: sequence i), pooled_keys [slots, d] (rows may be strided),
    token_index [R], block_tables [R, W] int32 -> fp32 scores [R, W * block_size // ratio] (module docstring),
    written into `out` when given (every entry)."""
    rows, heads, dim = q_rot.shape
    if q_rot.stride(-1) != 1 or pooled_keys.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("qsa_block_scores: the last dimension of q_rot, pooled_keys and block_tables must be "
                         "contiguous")
    if dim & (dim - 1):
        raise ValueError(f"qsa_block_scores: the index head dim must be a power of two, got {dim}")
    nb = block_tables.shape[1] * block_size // ratio
    out = _scores_out(out, rows, nb, q_rot.device, "qsa_block_scores")
    if rows == 0 or nb == 0:
        return out
    tok = token_index[:rows].to(torch.int64)
    tables = block_tables[:rows].to(torch.int32)
    grid = (rows, triton.cdiv(nb, BLOCK_J))
    _qsa_block_scores_kernel[grid](q_rot, pooled_keys, tables, tok, out, nb, q_rot.stride(0), q_rot.stride(1),
                                   pooled_keys.stride(0), tables.stride(0), out.stride(0), ratio, block_size,
                                   math.sqrt(dim), H=heads, D=dim, BLOCK_J=BLOCK_J, num_warps=4)
    return out


@triton.jit
def _qsa_chunk_scores_kernel(Q, KEYS, TOKEN, OUT, n_rows, NB, stride_qr, stride_qh, stride_key, stride_out, ratio,
                             sqrt_d, H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_J: tl.constexpr, IEEE: tl.constexpr):
    # rows of ONE request (consecutive tokens) x its blocks: the keys are shared, so a program multiplies a tile of
    # rows by a tile of blocks per index head (tensor cores), relu and head sum in registers
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    row_ok = rows < n_rows
    complete = (tl.load(TOKEN + rows, mask=row_ok, other=0).to(tl.int64) + 1) // ratio
    out_ptr = OUT + rows[:, None].to(tl.int64) * stride_out + j[None, :]
    out_mask = row_ok[:, None] & (j[None, :] < NB)
    if tl.program_id(1) * BLOCK_J >= tl.max(complete, axis=0):  # no row of the tile has completed these blocks
        tl.store(out_ptr, tl.full([BLOCK_M, BLOCK_J], float("-inf"), tl.float32), mask=out_mask)
        return
    d = tl.arange(0, D)
    keys = tl.load(KEYS + j[:, None].to(tl.int64) * stride_key + d[None, :], mask=(j < NB)[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
    q_rows = Q + rows[:, None].to(tl.int64) * stride_qr + d[None, :]
    for h in range(H):
        q = tl.load(q_rows + h * stride_qh, mask=row_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(keys))
        acc += tl.maximum(s, 0.0)
    score = acc / sqrt_d
    score = tl.where(score == 0.0, -(j[None, :] + 1).to(tl.float32), score)
    score = tl.where(j[None, :] < complete[:, None], score, float("-inf"))
    tl.store(out_ptr, score, mask=out_mask)


def _chunk_specs() -> list[CompileSpec]:
    sig = {"Q": "", "KEYS": "", "TOKEN": "*i64", "OUT": "*fp32", "n_rows": "i32", "NB": "i32", "stride_qr": "i32",
           "stride_qh": "i32", "stride_key": "i32", "stride_out": "i32", "ratio": "i32", "sqrt_d": "fp32",
           "H": "constexpr", "D": "constexpr", "BLOCK_M": "constexpr", "BLOCK_J": "constexpr", "IEEE": "constexpr"}
    return [CompileSpec({**sig, "Q": dt, "KEYS": dt}, {"H": 16, "D": 128, "BLOCK_M": CHUNK_BLOCK_M,
                                                       "BLOCK_J": CHUNK_BLOCK_J, "IEEE": dt == "*fp32"},
                        f"{dt[1:]} h16 d128") for dt in ("*fp16", "*fp32")]


CHUNK_BLOCK_M = 32
CHUNK_BLOCK_J = 64

register_kernel("qsa.chunk_scores", _qsa_chunk_scores_kernel, _chunk_specs())


def qsa_chunk_scores(q_rot: torch.Tensor, keys: torch.Tensor, token_index: torch.Tensor, ratio: int,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scores of n rows of ONE request against its nb blocks' pooled keys (gathered: keys [nb, d]): q_rot [n, n_idx,
    d] (normed, RoPE'd), token_index [n] -> fp32 [n, nb], as qsa_block_scores gives each row (ties at 0 broken toward
    earlier blocks, -inf for blocks past the row's complete ones). fp32 inputs multiply in IEEE fp32; fp16 / bf16 ones
    on the tensor cores with fp32 sums."""
    n, heads, dim = q_rot.shape
    nb = keys.shape[0]
    if q_rot.stride(-1) != 1 or keys.stride(-1) != 1 or keys.dtype != q_rot.dtype:
        raise ValueError("qsa_chunk_scores: q_rot and keys must share a dtype and have contiguous last dimensions")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"qsa_chunk_scores: the index head dim must be a power of two >= 16, got {dim}")
    out = _scores_out(out, n, nb, q_rot.device, "qsa_chunk_scores")
    if n == 0 or nb == 0:
        return out
    grid = (triton.cdiv(n, CHUNK_BLOCK_M), triton.cdiv(nb, CHUNK_BLOCK_J))
    _qsa_chunk_scores_kernel[grid](q_rot, keys, token_index.to(torch.int64), out, n, nb, q_rot.stride(0),
                                   q_rot.stride(1), keys.stride(0), out.stride(0), ratio, math.sqrt(dim), H=heads,
                                   D=dim, BLOCK_M=CHUNK_BLOCK_M, BLOCK_J=CHUNK_BLOCK_J,
                                   IEEE=q_rot.dtype == torch.float32, num_warps=4)
    return out
