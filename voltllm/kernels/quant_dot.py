"""Quantized weights times 5-64 activation rows (decode batches) and grouped quantized MoE experts: a tiled
dequant-GEMM with `tl.dot`.

Each program takes BLOCK_N weight rows and BLOCK_M activation rows; K runs in 64-element groups, whose 32 bytes of
`lo` hold elements j (low nibbles) and 32 + j (high nibbles), so a group is two contiguous halves of 32: their codes,
scales (quant_gemv._unit_scales: one load per row per 32 elements, two where scales cover 16) and activations load
as plain [*, 32] tiles, dequantize to the same exact fp32 values as every other path, round to the activations'
dtype and go into two `tl.dot`s of K 32 (fp32 accumulators). The weight is read once per BLOCK_M rows at its
quantized size. A grid with too few tiles for the GPU splits K (fp32 partial sums added afterwards in a fixed order:
deterministic). W_FIRST computes the product transposed, (W x^T)^T, so the dequantized tile is the MMA's first
operand; with 64-128-wide weight tiles that is sm_90's tables (DOT_CONFIGS_SM90, measured session 45; the grouped
MoE kernel's MOE_CONFIGS_SM90, session 46).

SORTED mode serves MoE experts stacked by expert in one Planes (layers/quant_moe.py): the (token, expert) pairs
sorted by expert and padded per expert to BLOCK_M (kernels/moe.moe_align), so each row block belongs to one expert,
whose weight rows it reads once for all its tokens (no host sync, fixed grid: CUDA-graph capturable). Row `pair` of
the output is the pair's; its activation row is `pair // TOP_K` (the tokens' hidden states) or `pair` (the pairs'
own intermediate rows, TOP_K 1), optionally times a per-pair routing weight.

Measured on the H200 (benchmarks/results/session25/, quant_dot_sweep.py): this form at qwen3-8b projection shapes
runs 1.5-1.8x faster than dequantize + cuBLAS at 5-16 rows (AWQ 6144 x 4096 at 16 rows: 24.5 us against 37.8; the
FMA dequant-GEMM's 4-row programs: 96.7), 1.03-1.18x at 64 and 0.3-0.4x at 256 (s89). A first form that dequantized
a [BLOCK_N, U, 16] tile and reshaped it (and the activations' indices) for `tl.dot` lost to dequantize + cuBLAS at
every row count (s86 / s87: the 8B AWQ shape at 64 concurrent 817 output tok/s against 5,627), yet as the grouped MoE
kernel it already beat the alternatives: one 30B-A3B layer at 64 tokens 0.69 ms against 1.44 per pair and 45
dequantizing every active expert.

`tl.dot` runs on tensor cores from sm_80 on; below sm_80 Triton lowers it to fp32 FMAs (docs/sm70.md), so the row
limits are lower there (`dot_max_rows`, `grouped_max_rows`; unmeasured on such a GPU).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels.quant_gemv import (_GATED_KINDS, _PLANE_ARGS, _codes_to_float, _constexprs, _plane_args,
                                        _plane_strides, _scaled, _unit_scales, _with_scale_type,
                                        checked_expert_operands, checked_operands)
from voltllm.kernels.registry import CompileSpec, register_kernel
from voltllm.model.layers.gguf_planes import KINDS, int4_kind


@triton.jit
def _half_weights(q, e, n2, mask2, j, D, Mp, SC, MN, stride_d, stride_s, ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
                  SUB: tl.constexpr, SUPER: tl.constexpr, ZP: tl.constexpr, FP8: tl.constexpr, FP4: tl.constexpr,
                  NL: tl.constexpr = 0):
    """fp32 weights [BLOCK_N, 32] of elements e .. e + 31 of rows n2 from their integer codes q: one scale load per
    row for the 32 (two where scales cover 16 elements: Q6_K, NVFP4, int4 groups of 16)."""
    s, b = _unit_scales(e, n2, mask2, D, Mp, SC, MN, stride_d, stride_s, ZERO, HAS_MIN, SUB, SUPER, ZP, FP8, FP4)
    if SUB == 16 or SUPER == 16:
        s2, b2 = _unit_scales(e + 16, n2, mask2, D, Mp, SC, MN, stride_d, stride_s, ZERO, HAS_MIN, SUB, SUPER, ZP,
                              FP8, FP4)
        first = j < 16
        s = tl.where(first, s, s2)
        b = tl.where(first, b, b2)
    return _scaled(s, _codes_to_float(q, FP8, FP4, NL), b, FP4)


@triton.jit
def _quant_dot_kernel(X, Y, B, LO, HI, D, Mp, SC, MN, SortedIds, BlockExpert, NumPadded, RowW, WS, M, N, NU, UPS,
                      stride_xm, stride_ym, stride_lo, stride_hi, stride_d, stride_s, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, U: tl.constexpr, HI_BITS: tl.constexpr, ZERO: tl.constexpr,
                      HAS_MIN: tl.constexpr, SUB: tl.constexpr, SUPER: tl.constexpr, ZP: tl.constexpr,
                      FP8: tl.constexpr, FP4: tl.constexpr, HAS_BIAS: tl.constexpr, SORTED: tl.constexpr,
                      TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, SPLIT: tl.constexpr,
                      W_FIRST: tl.constexpr = False, NL: tl.constexpr = 0):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)  # split-K: this program's UPS units of K (all of them when not SPLIT; UPS even)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if SORTED:  # M counts the pairs; rows past them in the sorted list are padding (the sentinel M)
        if pid_m * BLOCK_M >= tl.load(NumPadded):
            return
        pair = tl.load(SortedIds + offs_m)
        mask_m = pair < M
        x_row = tl.where(mask_m, pair // TOP_K, 0).to(tl.int64)
        y_row = tl.where(mask_m, pair, 0).to(tl.int64)
        plane_n = tl.load(BlockExpert + pid_m).to(tl.int64) * N + offs_n
    else:
        mask_m = offs_m < M
        x_row = offs_m.to(tl.int64)
        y_row = x_row
        plane_n = offs_n
    # K in 64-element groups: a group's 32 bytes of `lo` carry its elements j (low nibbles) and 32 + j (high ones),
    # so each group is two contiguous halves of 32, each one `tl.dot` of K 32, with no reshape of the tile
    j = tl.arange(0, 32)[None, :]
    n2 = plane_n[:, None]
    # W_FIRST: the product computed transposed (W x^T), so the dequantized weight tile, made in registers, is the
    # first operand (which the tensor cores may take from registers; the second must come from shared memory)
    if W_FIRST:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g_end = tl.minimum(NU, pid_s * UPS + UPS) // 2
    for g0 in range(pid_s * UPS // 2, g_end, U // 2):
        for gg in tl.static_range(U // 2):
            g = g0 + gg
            mask2 = mask_n[:, None] & (g < g_end)
            byte = tl.load(LO + n2 * stride_lo + g * 32 + j, mask=mask2, other=0).to(tl.int32)
            q_a = byte & 15
            q_b = byte >> 4
            if HI_BITS == 4:  # Q8_0 / FP8: the high nibbles in `lo`'s layout
                hb = tl.load(HI + n2 * stride_hi + g * 32 + j, mask=mask2, other=0).to(tl.int32)
                q_a |= (hb & 15) << 4
                q_b |= (hb >> 4) << 4
            elif HI_BITS == 2:  # Q6_K: byte j % 16 of the group's 16 holds elements j, 16 + j, 32 + j, 48 + j
                hb = tl.load(HI + n2 * stride_hi + g * 16 + j % 16, mask=mask2, other=0).to(tl.int32)
                shift = (j // 16) * 2
                q_a |= ((hb >> shift) & 3) << 4
                q_b |= ((hb >> (shift + 4)) & 3) << 4
            elif HI_BITS == 1:  # the Q5 kinds: byte j % 8 of the group's 8 holds elements j % 8 + 8 s at bit s
                hb = tl.load(HI + n2 * stride_hi + g * 8 + j % 8, mask=mask2, other=0).to(tl.int32)
                q_a |= ((hb >> (j // 8)) & 1) << 4
                q_b |= ((hb >> (j // 8 + 4)) & 1) << 4
            w_a = _half_weights(q_a, g * 64, n2, mask2, j, D, Mp, SC, MN, stride_d, stride_s, ZERO, HAS_MIN, SUB,
                                SUPER, ZP, FP8, FP4, NL)
            w_b = _half_weights(q_b, g * 64 + 32, n2, mask2, j, D, Mp, SC, MN, stride_d, stride_s, ZERO, HAS_MIN,
                                SUB, SUPER, ZP, FP8, FP4, NL)
            xp = X + x_row[:, None] * stride_xm + g * 64 + j
            xm = mask_m[:, None] & (g < g_end)
            x_a = tl.load(xp, mask=xm, other=0.0)
            x_b = tl.load(xp + 32, mask=xm, other=0.0)
            if W_FIRST:
                acc = tl.dot(w_a.to(X.dtype.element_ty), tl.trans(x_a), acc, input_precision="ieee")
                acc = tl.dot(w_b.to(X.dtype.element_ty), tl.trans(x_b), acc, input_precision="ieee")
            else:
                acc = tl.dot(x_a, tl.trans(w_a.to(X.dtype.element_ty)), acc, input_precision="ieee")
                acc = tl.dot(x_b, tl.trans(w_b.to(X.dtype.element_ty)), acc, input_precision="ieee")
    if W_FIRST:
        acc = tl.trans(acc)
    ymask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:  # fp32 partial sums WS[s, row, n]; the host adds them up (a fixed order: deterministic)
        tl.store(WS + (pid_s * M + y_row[:, None]) * N + offs_n[None, :], acc, mask=ymask)
    else:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if WEIGHTED:
            acc = acc * tl.load(RowW + y_row, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        tl.store(Y + y_row[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=ymask)


def _specs() -> list[CompileSpec]:
    sig = {"X": "*fp16", "Y": "*fp16", "B": "*fp16", **_PLANE_ARGS, "SortedIds": "*i32", "BlockExpert": "*i32",
           "NumPadded": "*i32", "RowW": "*fp32", "WS": "*fp32", "M": "i32", "N": "i32", "NU": "i32", "UPS": "i32",
           "stride_xm": "i32",
           "stride_ym": "i32", "stride_lo": "i32", "stride_hi": "i32", "stride_d": "i32", "stride_s": "i32"}
    sig.update({k: "constexpr" for k in ("BLOCK_M", "BLOCK_N", "U", "HI_BITS", "ZERO", "HAS_MIN", "SUB", "SUPER",
                                          "ZP", "FP8", "FP4", "HAS_BIAS", "SORTED", "TOP_K", "WEIGHTED",
                                          "SPLIT", "NL")})
    dense = {"BLOCK_M": 32, "BLOCK_N": 32, "U": 4, "HAS_BIAS": False, "SORTED": False, "TOP_K": 1, "WEIGHTED": False,
             "SPLIT": True}
    specs = [CompileSpec(_with_scale_type(sig, kind), {**dense, **_constexprs(kind)}, f"{kind.name} rows")
             for kind in _GATED_KINDS]
    awq = _constexprs(int4_kind(128, True))
    return specs + [
        CompileSpec(sig, {**dense, **_constexprs(KINDS["Q8_0"]), "HAS_BIAS": True, "SPLIT": False},
                    "Q8_0 rows + bias, one split"),
        CompileSpec(sig, {**dense, **awq, "BLOCK_M": 16, "SORTED": True, "TOP_K": 8, "SPLIT": False},
                    "INT4_G128_ZP MoE gate_up"),
        CompileSpec(sig, {**dense, **awq, "BLOCK_M": 16, "SORTED": True, "WEIGHTED": True, "SPLIT": False},
                    "INT4_G128_ZP MoE down")]


register_kernel("quant.dot", _quant_dot_kernel, _specs())

# (BLOCK_M, BLOCK_N, U, num_warps, num_stages) by row count: the largest row class at or above the batch's rows
# (rows past the largest run in further row blocks, each dequantizing the weight again)
DOT_CONFIGS = {16: (16, 32, 4, 4, 2), 32: (32, 32, 4, 4, 2), 64: (64, 32, 4, 4, 2), 128: (64, 64, 4, 4, 2)}
# sm_90 dense layers: the transposed form (W_FIRST, a sixth field) with 64-128-wide weight tiles, whose dequantized
# tile the warpgroup MMA takes from registers. H200, cold L2, split K by split_k, AWQ g128 / Q4_K at the 8B's 6144x4096,
# 4096x12288, 24576x4096 (benchmarks/micro/quant_dot_wfirst.py, results/session45/quant-dot-wfirst-68ab0f9.txt), us
# against DOT_CONFIGS' tile: 16 rows AWQ 21.6 / 36.8 / 62.7 vs 23.3 / 39.5 / 64.2; 32 rows AWQ 23.9 / 38.5 / 66.4 vs
# 60.5 / 100.3 / 186.9 (Q4_K 30.2 / 52.7 / 86.5 vs 72.8 / 124.3 / 240.4); 64 rows AWQ 30.5 / 49.0 / 96.4 vs
# 36.3 / 61.2 / 104.8 (Q4_K 36.9 / 61.6 / 121.4 vs 44.1 / 78.8 / 129.9). The transposed form with a 32-wide weight tile
# is slower (64 rows 59.6 vs 36.3). Not measured on sm_80-89: those keep DOT_CONFIGS, and so does the compat route (it
# stands in for GPUs without the warpgroup MMA).
DOT_CONFIGS_SM90 = {16: (16, 64, 4, 4, 2, True), 32: (32, 64, 4, 4, 2, True), 64: (64, 128, 4, 8, 2, True),
                    128: (64, 64, 4, 4, 2)}
# sm_90 grouped MoE kernel (quant_moe_dot), by average rows per expert: the transposed form with a 64-wide weight tile.
# H200, one 30B-A3B layer (E 128, I 768, H 2048, top 8) at AWQ g128, both projections, cold L2
# (quant_dot_wfirst.py --moe), us against DOT_CONFIGS' tile:
# 64 tokens (4 rows per expert) 285.4 vs 322.2, 256 (16) 447.5 vs 501.0, 512 (32) 566.0 vs 1604.6, 1024 (64) 769.1 vs
# 979.2, 2048 (128) 1161.6 vs 1211.5 (results/session46/quant-dot-wfirst-moe-12f81f4.txt; (64, 4, 4, 2) is 1-8% and
# (128, 4, 8, 2 / 3) 5-20% slower)
MOE_CONFIGS_SM90 = {16: (16, 64, 4, 4, 3, True), 32: (32, 64, 4, 4, 3, True), 64: (64, 64, 4, 4, 3, True),
                    128: (64, 64, 4, 4, 3, True)}
# average rows per expert up to which the grouped kernel beats dequantizing every active expert for cuBLAS: with
# tensor-core `tl.dot` (sm_80+) the H200 sweep's 30B-A3B layer (grouped ~1 ms per 1,000 pairs against a ~26 ms
# dequantize + cuBLAS pass) breaks even near 200 rows per expert; with FMA `tl.dot` (sm_70 / sm_75) estimated from
# the V100's rates: M fp32 FMAs per weight at 15.7 TFLOP/s against ~4 bytes per weight written and read at ~850 GB/s
# (M < ~34)
GROUPED_MAX_ROWS_TENSOR_CORES = 256
GROUPED_MAX_ROWS_FMA = 32


# rows up to which quantized linear layers take the tiled kernel instead of dequantize + cuBLAS (from 5 rows; up to 4,
# quant_gemv's FMA dequant-GEMM). Tensor-core `tl.dot`: the H200 quick sweep (s89, qwen3-8b shapes, Q4_K and AWQ):
# 1.5-1.8x dequantize + cuBLAS at 5-16 rows, 1.03-1.18x at 64, 0.3-0.4x at 256. FMA `tl.dot` (sm_70 / sm_75):
# unmeasured; 16 rows keep a 2x margin on the V100 estimate above (16 FMAs per weight against ~4 bytes moved)
DOT_MAX_ROWS_TENSOR_CORES = 64
DOT_MAX_ROWS_FMA = 16


def dot_max_rows(capability: Optional[tuple[int, int]]) -> int:
    """Rows up to which QuantizedLinearMethod takes quant_dot on a GPU of `capability` (0: never, e.g. the CPU)."""
    if capability is None:
        return 0
    return DOT_MAX_ROWS_TENSOR_CORES if capability >= (8, 0) else DOT_MAX_ROWS_FMA


def grouped_max_rows(capability: Optional[tuple[int, int]]) -> int:
    """Average rows per expert up to which quant_moe.QuantExperts takes the grouped kernel on a GPU of `capability`
    (0: never, e.g. the CPU)."""
    if capability is None:
        return 0
    return GROUPED_MAX_ROWS_TENSOR_CORES if capability >= (8, 0) else GROUPED_MAX_ROWS_FMA


def dot_table(capability: Optional[tuple[int, int]]) -> dict:
    """The dense layers' row-class tiles for a GPU of `capability` (None: the CPU, or the compat route standing in for
    a GPU without the warpgroup MMA). The sm_90 table only on sm_90 (Hopper), where it was measured: sm_100 / sm_120
    have no warpgroup MMA."""
    return DOT_CONFIGS_SM90 if capability is not None and tuple(capability)[0] == 9 else DOT_CONFIGS


def moe_table(capability: Optional[tuple[int, int]]) -> dict:
    """The grouped MoE kernel's tiles by average rows per expert, as dot_table: sm_90's own table only on sm_90."""
    return MOE_CONFIGS_SM90 if capability is not None and tuple(capability)[0] == 9 else DOT_CONFIGS


def pick_config(rows: int, table: Optional[dict] = None) -> tuple:
    """The tile for `rows` activation rows: the smallest row class of `table` (default DOT_CONFIGS) that holds them."""
    table = table or DOT_CONFIGS
    for limit, cfg in sorted(table.items()):
        if rows <= limit:
            return cfg
    return table[max(table)]


PROGRAMS_PER_SM = 4  # split K until the grid has about this many programs per multiprocessor
MAX_SPLIT = 16


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> Optional[tuple[int, int]]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def split_k(programs: int, units: int, step: int, device: torch.device) -> int:
    """Splits of K for a grid of `programs` tiles: a decode batch's [rows, N] has few tiles of BLOCK_N >= 16 (a
    4096-wide output: 128 of 32), too few to keep the GPU's memory busy, so each tile's K is cut into parts whose
    fp32 partial sums are added afterwards. `units` / `step`: K's 16-byte units and those of one loop step."""
    target = PROGRAMS_PER_SM * _sm_count(device)
    if programs >= target:
        return 1
    return max(1, min(MAX_SPLIT, -(-target // programs), -(-units // step)))


def _launch(x, planes, out, bias, m, n, grid_m, sorted_args, top_k, row_weights, config, split, zero_rows=False):
    """zero_rows: the split-K workspace starts at zero (rows no sorted pair writes, as under expert parallelism, then
    sum to zero, not to what the memory held)."""
    block_m, block_n, units, warps, stages = config[:5]
    w_first = len(config) > 5 and bool(config[5])
    units = min(units, triton.next_power_of_2(planes.k // 32))
    nu = planes.k // 32
    grid_n = triton.cdiv(n, block_n)
    if split is None:
        split = split_k(grid_n * grid_m, nu, units, x.device)
    ups = triton.cdiv(triton.cdiv(nu, split), units) * units  # units per split, whole loop steps
    split = triton.cdiv(nu, ups)
    ws = (torch.zeros if zero_rows else torch.empty)(split, m, n, dtype=torch.float32, device=x.device) \
        if split > 1 else out
    sorted_ids, block_expert, num_padded = sorted_args if sorted_args is not None else (out, out, out)
    _quant_dot_kernel[(grid_n, grid_m, split)](
        x, out, bias if bias is not None else out, *_plane_args(planes), sorted_ids, block_expert, num_padded,
        row_weights if row_weights is not None else out, ws, m, n, nu, ups, x.stride(0), out.stride(0),
        *_plane_strides(planes), BLOCK_M=block_m, BLOCK_N=block_n, U=units, **_constexprs(planes.kind),
        HAS_BIAS=bias is not None, SORTED=sorted_args is not None, TOP_K=top_k, WEIGHTED=row_weights is not None,
        SPLIT=split > 1, W_FIRST=w_first, num_warps=warps, num_stages=stages)
    if split > 1:
        y = ws.sum(0)
        if bias is not None:
            y += bias.float()
        if row_weights is not None:
            y *= row_weights[:, None]
        out.copy_(y)
    return out


def quant_dot(x: torch.Tensor, planes, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
              config: Optional[tuple] = None, split: Optional[int] = None) -> torch.Tensor:
    """x [M, K] (last dim contiguous) times the quantized W [N, K]^T (+ bias) -> [M, N] in x's dtype (into `out`,
    which may be a column slice of a wider output). config: (BLOCK_M, BLOCK_N, U, num_warps, num_stages[, W_FIRST:
    the product computed as (W x^T)^T]) (default: the row class of x's GPU, dot_table); split:
    parts of K (default: split_k's choice for this GPU)."""
    x, out = checked_operands(x, planes, out)
    m = x.shape[0]
    config = config or pick_config(m, dot_table(_capability(x.device)))
    return _launch(x, planes, out, bias, m, planes.n, triton.cdiv(m, config[0]), None, 1, None, config, split)


def quant_moe_dot(x: torch.Tensor, planes, rows_per_expert: int, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, num_padded: torch.Tensor, num_pairs: int, top_k: int, block_m: int,
                  row_weights: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                  split: Optional[int] = None, tile: Optional[tuple] = None,
                  skip_foreign: bool = False) -> torch.Tensor:
    """Grouped MoE product over a weight stacked by expert (expert e: rows [e * rows_per_expert, (e + 1) *
    rows_per_expert) of `planes`), for pairs sorted by kernels/moe.moe_align(ids, E, block_m): out[p] =
    x[p // top_k] @ W_{expert(p)}^T (times row_weights[p] when given, fp32), [num_pairs, rows_per_expert].
    skip_foreign (expert parallelism): pairs left out of the sort (experts other ranks hold) get zero rows."""
    if skip_foreign and out is None:
        out = torch.zeros(num_pairs, rows_per_expert, dtype=x.dtype, device=x.device)
    x, out = checked_expert_operands(x, planes, rows_per_expert, num_pairs, out)
    # tile: (BLOCK_N, U, num_warps, num_stages[, W_FIRST]) (default DOT_CONFIGS' for block_m)
    config = (block_m,) + tuple(tile or pick_config(block_m)[1:])
    return _launch(x, planes, out, None, num_pairs, rows_per_expert, block_expert.numel(),
                   (sorted_ids, block_expert, num_padded), top_k, row_weights, config, split, zero_rows=skip_foreign)
