"""Row-wise argmax of a decode step's logits (greedy sampling) in one Triton launch.

torch's argmax of the 8B's 64 x 151,936 fp16 logits takes 22.7 us per decode step on the H200 (session 41's 64-
concurrent profile) for 19.4 MB that the copy rate moves in ~5 us. A program per row was slower still (39 us at 64
rows, 31 at one row: its chunk loop waits on every load, session 49), so the row is cut: program (r, c) takes
CHUNK entries of row r and writes its maximum and that maximum's first index; the last of the row's programs to
finish (a per-row arrival count, acq_rel) reads the row's partials in chunk order, keeps the first chunk holding the
row's maximum, stores its index and resets the count to 0 (CUDA-graph replays and eager calls share the counts).
Ties go to the lowest index and a NaN wins over every number (its first index), which is what torch.argmax returns.
`argmax_of_partials` is the same combine for partials another kernel wrote: the decode-batch GEMM's argmax epilogue
(kernels/batch_gemm.py, a greedy LM head that writes no logits) leaves each row's maximum and first index per output
tile, and one program per row combines them in tile order.
Reference: torch.argmax(dim=-1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.pdl import pdl_enter
from voltllm.kernels.registry import CompileSpec, register_kernel

_NONE = tl.constexpr(2147483647)  # "no index" (larger than any vocabulary position)


@triton.jit
def _row_argmax_kernel(X, OUT, PART_V, PART_I, COUNTS, V, stride_x, n_chunks, CHUNK: tl.constexpr,
                       MAX_CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(X + row.to(tl.int64) * stride_x + idx, mask=idx < V, other=float("-inf"),
                eviction_policy="evict_first").to(tl.float32)
    m, code = part_argmax(v, idx, 0)
    slot = row * n_chunks + c
    tl.store(PART_V + slot, m)
    tl.store(PART_I + slot, code)
    tl.debug_barrier()  # the partial is written before the count is released
    arrived = tl.atomic_add(COUNTS + row, 1, sem="acq_rel")
    if arrived == n_chunks - 1:  # the row's last chunk: combine in chunk order
        tl.store(OUT + row, _combine(PART_V + row * n_chunks, PART_I + row * n_chunks, n_chunks, MAX_CHUNKS))
        tl.atomic_xchg(COUNTS + row, 0)


@triton.jit
def part_argmax(v, idx, AXIS: tl.constexpr):
    """One part's partial along AXIS (v fp32, entries outside the row already -inf; idx their indices, ascending
    along AXIS): (its maximum, the first index holding it). A NaN outranks every number: a part holding one reports
    its first NaN's index as -1 - index (a negative index flags it), and the row's answer is then the first such
    index whatever the values say (_combine)."""
    nan = v != v
    first_nan = tl.min(tl.where(nan, idx, _NONE), axis=AXIS)
    v = tl.where(nan, float("-inf"), v)
    m = tl.max(v, axis=AXIS)
    m_idx = tl.min(tl.where(v == tl.expand_dims(m, AXIS), idx, _NONE), axis=AXIS)
    return m, tl.where(first_nan < _NONE, -1 - first_nan, m_idx)


@triton.jit
def _combine(PV, PI, n_parts, MAX_PARTS: tl.constexpr):
    """A row's argmax (int64) from its parts' maxima PV and their first indices PI (-1 - index: the part's first
    NaN), in part order: the first NaN if any part holds one, else the first part holding the row's maximum."""
    offs = tl.arange(0, MAX_PARTS)
    mc = offs < n_parts
    pv = tl.load(PV + offs, mask=mc, other=float("-inf"), cache_modifier=".cg")
    pi = tl.load(PI + offs, mask=mc, other=_NONE, cache_modifier=".cg")
    nan_first = tl.min(tl.where(pi < 0, -1 - pi, _NONE), axis=0)
    best = tl.max(pv, axis=0)
    best_part = tl.min(tl.where((pv == best) & mc, offs, MAX_PARTS), axis=0)
    best_idx = tl.sum(tl.where(offs == best_part, pi, 0), axis=0)
    return tl.where(nan_first < _NONE, nan_first, best_idx).to(tl.int64)


@triton.jit
def _argmax_of_partials_kernel(PV, PI, OUT, n_parts, MAX_PARTS: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    pdl_enter(PDL)
    tl.store(OUT + row, _combine(PV + row * n_parts, PI + row * n_parts, n_parts, MAX_PARTS))


CHUNK = 8192
MAX_ROWS = 1 << 12  # rows a call may have (the per-row arrival counts)
# Whether greedy sampling on CUDA uses row_argmax (sampling/sampler.greedy_tokens). On since session 51's H200 timing
# (benchmarks/micro/argmax_rows.py, results/session51/s140-08e38ad/argmax-rows.txt): 1 / 16 / 64 rows of 151,936
# fp16 logits 3.60 / 6.15 / 13.03 us against torch's 8.32 / 12.21 / 23.09 (the program-per-row form it replaced lost
# to torch at every size).
ROW_ARGMAX_ON_CUDA = True


def _specs() -> list[CompileSpec]:
    sig = {"X": "", "OUT": "*i64", "PART_V": "*fp32", "PART_I": "*i32", "COUNTS": "*i32", "V": "i32",
           "stride_x": "i32", "n_chunks": "i32", "CHUNK": "constexpr", "MAX_CHUNKS": "constexpr"}
    return [CompileSpec({**sig, "X": dt}, {"CHUNK": CHUNK, "MAX_CHUNKS": 32}, f"{dt[1:]} rows")
            for dt in ("*fp16", "*fp32")]  # (no bf16 on sm_70 / 75)


register_kernel("sampling.row_argmax", _row_argmax_kernel, _specs())
register_kernel("sampling.argmax_of_partials", _argmax_of_partials_kernel,
                [CompileSpec({"PV": "*fp32", "PI": "*i32", "OUT": "*i64", "n_parts": "i32", "MAX_PARTS": "constexpr",
                              "PDL": "constexpr"}, {"MAX_PARTS": 4096, "PDL": False}, "4096 parts")],
                compat=False)  # (the decode-batch GEMM's argmax epilogue: native route only)

_counts: dict[torch.device, torch.Tensor] = {}


def _row_counts(device: torch.device) -> torch.Tensor:
    """The device's per-row arrival counts: zeroed once; every call leaves them at zero (the row's last program
    resets its own)."""
    c = _counts.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("row_argmax: its counts must exist before CUDA-graph capture (call it once first)")
        c = _counts[device] = torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)
    return c


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, V] (last dim contiguous; fp16 / bf16 / fp32) -> int64 [rows]: torch.argmax(x, dim=-1)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"row_argmax: x {tuple(x.shape)} {x.dtype} not supported")
    rows, v = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"row_argmax: {rows} rows exceed {MAX_ROWS}")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if v == 0:
        raise ValueError("row_argmax: empty rows have no argmax")
    chunk = min(CHUNK, triton.next_power_of_2(v))
    n_chunks = triton.cdiv(v, chunk)
    part_v = torch.empty(rows * n_chunks, dtype=torch.float32, device=x.device)
    part_i = torch.empty(rows * n_chunks, dtype=torch.int32, device=x.device)
    _row_argmax_kernel[(rows, n_chunks)](x, out, part_v, part_i, _row_counts(x.device), v, x.stride(0), n_chunks,
                                         CHUNK=chunk, MAX_CHUNKS=max(2, triton.next_power_of_2(n_chunks)),
                                         num_warps=8 if chunk >= 4096 else 4)
    return out


def argmax_of_partials(pv: torch.Tensor, pi: torch.Tensor, rows: int, n_parts: int, out: torch.Tensor) -> torch.Tensor:
    """Each row's argmax from per-part partials laid out [rows, n_parts] (PV: the part's maximum, PI: its first index,
    or -1 - its first NaN's index), as the decode-batch GEMM's argmax epilogue writes them; into `out` (int64
    [rows])."""
    if rows:
        _argmax_of_partials_kernel[(rows,)](pv, pi, out, n_parts, MAX_PARTS=max(2, triton.next_power_of_2(n_parts)),
                                            num_warps=8 if n_parts >= 2048 else 4, **pdl.launch_options())
    return out
