"""A norm-folded decode batch's first inputs in one launch: the token rows of the embedding table, written as the
residual stream (fp32 for fp16 models, the model's dtype otherwise) and as the first folded GEMM's input (the rows
times the fold's scale, rounded to the model's dtype).

Unfused that is four launches at the head of every decode step (the gather, the widening copy, the scale and the
rounding: ~9.6 us of GPU time between the step's copies and its first GEMM on the H100, session 73's trace,
docs/kernels.md). The values are the same bit for bit: the row is widened exactly, multiplied in fp32 by the scale (a
power of two) and rounded once, as `(residual * scale).to(dtype)` does.
Reference: embed_rows_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.pdl import pdl_enter
from voltllm.kernels.registry import CompileSpec, register_kernel


@triton.jit
def _embed_rows_kernel(Ids, Table, Res, X, H, stride_t, stride_r, stride_x, scale, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pdl_enter(PDL)  # (the ids come from the step's own copies)
    tok = tl.load(Ids + row).to(tl.int64)
    mask = cols < H
    e = tl.load(Table + tok * stride_t + cols, mask=mask).to(tl.float32)
    tl.store(Res + row * stride_r + cols, e.to(Res.dtype.element_ty), mask=mask)
    tl.store(X + row * stride_x + cols, (e * scale).to(X.dtype.element_ty), mask=mask)


register_kernel("fused.embed_rows", _embed_rows_kernel, [CompileSpec(
    {"Ids": "*i64", "Table": "*fp16", "Res": "*fp32", "X": "*fp16", "H": "i32", "stride_t": "i32", "stride_r": "i32",
     "stride_x": "i32", "scale": "fp32", "BLOCK": "constexpr", "PDL": "constexpr"},
    {"BLOCK": 1024, "PDL": False}, "fp16 table, fp32 residual")],
    compat=False)  # (norm-folded decode batches: TMA GPUs only)

BLOCK = 1024


def embed_rows(table: torch.Tensor, ids: torch.Tensor, residual_dtype: torch.dtype,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) for token ids [rows]: residual = table[ids] in residual_dtype, x = (residual * scale) rounded to
    the table's dtype."""
    if ids.dim() != 1 or table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"embed_rows: ids {tuple(ids.shape)} / table {tuple(table.shape)} not supported")
    rows, hidden = ids.shape[0], table.shape[1]
    res = torch.empty(rows, hidden, dtype=residual_dtype, device=table.device)
    x = torch.empty(rows, hidden, dtype=table.dtype, device=table.device)
    if rows:
        block = min(BLOCK, triton.next_power_of_2(hidden))
        _embed_rows_kernel[(rows, triton.cdiv(hidden, block))](ids, table, res, x, hidden, table.stride(0),
                                                               res.stride(0), x.stride(0), float(scale), BLOCK=block,
                                                               num_warps=4, **pdl.launch_options())
    return x, res


def embed_rows_ref(table: torch.Tensor, ids: torch.Tensor, residual_dtype: torch.dtype,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    res = torch.nn.functional.embedding(ids, table).to(residual_dtype)
    return (res * scale).to(table.dtype), res
