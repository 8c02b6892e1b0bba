"""Grouped expert GEMMs for sparse MoE layers (Triton): no Python loop over experts, no host sync.

    out[t] = sum_j w[t, j] * ( silu(x[t] Wg_e^T) * (x[t] Wu_e^T) ) Wd_e^T        e = ids[t, j]

Steps (all on the device, CUDA-graph friendly: fixed launch grids, no `.item()`):
  1. align (`moe_align`: on CUDA up to TRITON_ALIGN_MAX_PAIRS pairs one launch, `_moe_align_kernel`, else
     ~28 small torch ops): the T*k (token, expert) pairs are sorted by expert
     (stable) and each expert's run is padded to a multiple of BLOCK_M, so every BLOCK_M rows of the
     sorted list belong to one expert. Outputs: `sorted_ids` (pair index t*k + j, or the sentinel T*k on
     padding rows), `block_expert` (expert of each row block) and `num_padded` (a 1-element tensor: rows in
     use). The grid is sized by the upper bound cdiv(T*k, BLOCK_M) + min(E, T*k) blocks; blocks past
     `num_padded` exit at once. Empty experts take no block at all.
  2. `_moe_gate_up_kernel`: one launch over (row block, column block of I): gathers the x rows of the
     block's tokens, multiplies by the block's expert's gate and up rows (two fp32 accumulators), and stores
     silu(gate) * up (fp32 math, rounded once) at the pair's row of `inter` [T*k, I].
  3. `_moe_down_kernel`: one launch over (row block, column block of H): inter rows x Wd_e^T in fp32,
     times the pair's routing weight (fp32), stored at the pair's row of `pair_out` [T*k, H].
  4. combine: out[t] = sum_j pair_out[t*k + j] (a torch sum over k; fp32 accumulation; deterministic,
     unlike an atomic scatter-add).

Numerics: fp16 / bf16 (native GPUs) or fp32 inputs; every product accumulates in fp32 (`tl.dot` with fp32
accumulators; input_precision "ieee" so fp32 inputs never drop to tf32). On sm_70 `tl.dot` lowers to FMA
instructions (no tensor cores): slower than cuBLAS there, but no per-expert launches and it compiles for
the compat route (registered below, checked by `python -m voltllm.check.sm70_gate`).
Large batches run in chunks of at most MAX_CHUNK_PAIRS pairs (bounded workspaces; a host loop over
token chunks, never over experts).

Reference: voltllm.model.layers.moe.fused_experts_ref (sorts pairs by expert too, one GEMM pair per
active expert). Tests: tests/unit/test_moe_kernels.py (interpreter), tests/gpu/test_hybrid_gpu.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel

MAX_CHUNK_PAIRS = 32768  # (token, expert) pairs per launch pair: inter [P, I] + pair_out [P, H] workspaces
TRITON_ALIGN_MAX_PAIRS = 4096  # up to here moe_align is one Triton launch (one program ranks the pairs); above, torch
ALIGN_CHUNK = 128  # pairs the align kernel ranks at a time (a CHUNK x CHUNK comparison); fewer: next power of 2
ALIGN_WARPS = 4
# Shared memory per block on the compat targets is 96 KB (sm_70) and 64 KB (sm_75). With fp32 activations the
# tiles below need up to 96 KB at BLOCK_K 64 (72-96 KB for gate_up: its x tile and two weight tiles), so fp32 runs
# take K blocks of 32 (<= 48 KB); fp16 / bf16 need 32 KB at every tile (compiled for sm_70 / sm_75, session 21).
FP32_MAX_BLOCK_K = 32


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
# The pair count follows the step's token count (a mask bound only): specialised, each new class (== 1, % 16) compiled
# another variant inside the step that met it (a hybrid MoE's warm bench runs stalled seconds; micro/bench_compiles.py)
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    X, W13, SortedIds, BlockExpert, NumPadded, Inter,
    num_pairs, H, I,
    stride_xt, stride_we, stride_wn, stride_it,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(I, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m)
    mrow = pair < num_pairs
    tok = tl.where(mrow, pair // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + tok[:, None] * stride_xt + offs_k[None, :]
    # W13[e] is [2I, H] row-major: tile [BLOCK_K, BLOCK_N] of W^T (K contiguous along dim 0)
    wg_ptrs = W13 + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    wu_ptrs = wg_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mk = (k0 + offs_k) < H
        x = tl.load(x_ptrs, mask=mrow[:, None] & mk[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=mk[:, None] & mn[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=mk[:, None] & mn[None, :], other=0.0)
        acc_g = tl.dot(x, wg, acc_g, input_precision="ieee")
        acc_u = tl.dot(x, wu, acc_u, input_precision="ieee")
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    dst = Inter + pair[:, None].to(tl.int64) * stride_it + offs_n[None, :]
    tl.store(dst, h.to(Inter.dtype.element_ty), mask=mrow[:, None] & mn[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # (as the gate_up kernel's)
def _moe_down_kernel(
    Inter, W2, SortedIds, BlockExpert, NumPadded, TopkW, PairOut,
    num_pairs, H, I,
    stride_it, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m)
    mrow = pair < num_pairs
    row = tl.where(mrow, pair, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = Inter + row[:, None] * stride_it + offs_k[None, :]
    w_ptrs = W2 + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        mk = (k0 + offs_k) < I
        a = tl.load(a_ptrs, mask=mrow[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mk[:, None] & mn[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    wt = tl.load(TopkW + row, mask=mrow, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    dst = PairOut + row[:, None] * stride_ot + offs_n[None, :]
    tl.store(dst, acc.to(PairOut.dtype.element_ty), mask=mrow[:, None] & mn[None, :])


@triton.jit
def _fill_sentinels(SortedIds, BlockExpert, n, num_slots, num_blocks, FILL: tl.constexpr):
    """Every sorted row the sentinel n and every block expert 0, visible to the program before its scatter."""
    for s0 in range(0, num_slots, FILL):
        so = s0 + tl.arange(0, FILL)
        tl.store(SortedIds + so, n, mask=so < num_slots)
        tl.store(BlockExpert + so, 0, mask=so < num_blocks)
    tl.debug_barrier()


@triton.jit(do_not_specialize=["n", "num_slots", "num_blocks"])  # (the step's pair counts and bounds)
def _moe_align_sort_kernel(Ids, SortedIds, BlockExpert, NumPadded, Scratch, n, E, num_slots, num_blocks,
                           BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BINS: tl.constexpr, FILL: tl.constexpr):
    """moe_align in one program, for CUDA-graph captures (pairs n <= BLOCK_P): per-expert counts by a histogram,
    padded starts by a scan, each pair's rank inside its expert from one sort of the keys expert * n + pair (so
    pairs keep token order, as the torch version's stable argsort), then the scatter. Scratch (int32 [2 * BINS])
    carries the per-expert starts from the scan to the per-pair gathers."""
    offs = tl.arange(0, BLOCK_P)
    mp = offs < n
    e = tl.load(Ids + offs, mask=mp, other=E).to(tl.int32)  # padding lanes count in bin E, never read
    counts = tl.histogram(e, BINS)
    bins = tl.arange(0, BINS)
    counts = tl.where(bins < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_start = tl.cumsum(padded, axis=0) - padded
    count_start = tl.cumsum(counts, axis=0) - counts
    tl.store(Scratch + bins, padded_start)
    tl.store(Scratch + BINS + bins, count_start)
    tl.store(NumPadded, tl.sum(padded, axis=0))
    _fill_sentinels(SortedIds, BlockExpert, n, num_slots, num_blocks, FILL)
    key = tl.sort(tl.where(mp, e * n + offs, E * n + offs))  # padding lanes sort last
    se = key // n
    pair = key % n
    ms = offs < n  # sorted position i holds a real pair iff i < n
    rank = offs - tl.load(Scratch + BINS + se, mask=ms, other=0)
    dest = tl.load(Scratch + se, mask=ms, other=0) + rank
    tl.store(SortedIds + dest, pair, mask=ms)
    tl.store(BlockExpert + dest // BLOCK_M, se, mask=ms & (rank % BLOCK_M == 0))


# The eager steps' align. Every count is a run-time value (n, the bounds, block_m: the step's pair count and its
# tile), so it compiles one variant per model (BINS) and CHUNK class (16 / 32 / 64 / 128, ~0.4 s each), where the
# sort kernel above compiles one per power of two of n, 0.5-9 s each on the H200 machine, which an eager step paid
# inside its requests' time to first token (micro/bench_compiles.py, session 44). Ranking by chunks is slower at
# run time (H200, E = 256: 18 / 36 / 134 us at 512 / 1024 / 4096 pairs against the sort's 5.5 / 15 / 75;
# benchmarks/results/session44/), so CUDA-graph captures, which compile at start-up, keep the sort.
@triton.jit(do_not_specialize=["n", "num_slots", "num_blocks", "block_m"])
def _moe_align_kernel(Ids, SortedIds, BlockExpert, NumPadded, n, E, num_slots, num_blocks, block_m,
                      CHUNK: tl.constexpr, BINS: tl.constexpr, FILL: tl.constexpr):
    """moe_align in one program, by chunks of CHUNK pairs: per-expert counts by histograms, padded starts by a scan,
    then per chunk each pair's rank among the chunk's earlier pairs of its expert (a CHUNK x CHUNK comparison) on
    top of its expert's running write position (held in registers, gathered per pair), so pairs keep token order
    (as the torch version's stable argsort)."""
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        e = tl.load(Ids + c0 + lanes, mask=c0 + lanes < n, other=E).to(tl.int32)  # padding lanes count in bin E
        counts += tl.histogram(e, BINS)
    counts = tl.where(bins < E, counts, 0)
    padded = (counts + block_m - 1) // block_m * block_m
    start = tl.cumsum(padded, axis=0) - padded
    tl.store(NumPadded, tl.sum(padded, axis=0))
    _fill_sentinels(SortedIds, BlockExpert, n, num_slots, num_blocks, FILL)
    earlier = lanes[None, :] < lanes[:, None]  # [i, j]: pair j comes before pair i
    run = start  # each expert's next write position
    for c0 in range(0, n, CHUNK):
        pair = c0 + lanes
        mp = pair < n
        e = tl.load(Ids + pair, mask=mp, other=E).to(tl.int32)
        same = (e[:, None] == e[None, :]) & earlier
        dest = tl.gather(run, e, 0) + tl.sum(same.to(tl.int32), axis=1)
        rank = dest - tl.gather(start, e, 0)  # within the expert's whole run
        tl.store(SortedIds + dest, pair, mask=mp)
        tl.store(BlockExpert + dest // block_m, e, mask=mp & (rank % block_m == 0))
        run += tl.histogram(e, BINS)


def _gate_up_specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        for bm, bn, bk, k in ((16, 64, 128, 8), (64, 128, 64, 2), (128, 128, 64, 8)):
            bk = bk if act == "fp16" else min(bk, FP32_MAX_BLOCK_K)  # (pick_config's cap)
            sig = {"X": f"*{act}", "W13": f"*{act}", "SortedIds": "*i32", "BlockExpert": "*i32",
                   "NumPadded": "*i32", "Inter": f"*{act}", "num_pairs": "i32", "H": "i32", "I": "i32",
                   "stride_xt": "i64", "stride_we": "i64", "stride_wn": "i64", "stride_it": "i64",
                   "TOP_K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
            specs.append(CompileSpec(signature=sig, constexprs={"TOP_K": k, "BLOCK_M": bm, "BLOCK_N": bn,
                                                                "BLOCK_K": bk},
                                     label=f"{act} m{bm} n{bn} k{bk} top{k}"))
    return specs


def _down_specs() -> list[CompileSpec]:
    specs = []
    for act in ("fp16", "fp32"):
        for bm, bn, bk in ((16, 64, 128), (64, 128, 64), (128, 128, 64)):
            bk = bk if act == "fp16" else min(bk, FP32_MAX_BLOCK_K)
            sig = {"Inter": f"*{act}", "W2": f"*{act}", "SortedIds": "*i32", "BlockExpert": "*i32",
                   "NumPadded": "*i32", "TopkW": "*fp32", "PairOut": f"*{act}", "num_pairs": "i32", "H": "i32",
                   "I": "i32", "stride_it": "i64", "stride_we": "i64", "stride_wn": "i64", "stride_ot": "i64",
                   "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
            specs.append(CompileSpec(signature=sig, constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                                     label=f"{act} m{bm} n{bn} k{bk}"))
    return specs


def _align_specs() -> list[CompileSpec]:
    sig = {"Ids": "*i32", "SortedIds": "*i32", "BlockExpert": "*i32", "NumPadded": "*i32",
           "n": "i32", "E": "i32", "num_slots": "i32", "num_blocks": "i32", "block_m": "i32",
           **{k: "constexpr" for k in ("CHUNK", "BINS", "FILL")}}
    return [CompileSpec(signature=sig, constexprs={"CHUNK": c, "BINS": 512, "FILL": 1024}, label=f"chunk{c} E<512")
            for c in (16, ALIGN_CHUNK)]


def _align_sort_specs() -> list[CompileSpec]:
    sig = {"Ids": "*i32", "SortedIds": "*i32", "BlockExpert": "*i32", "NumPadded": "*i32", "Scratch": "*i32",
           "n": "i32", "E": "i32", "num_slots": "i32", "num_blocks": "i32",
           **{k: "constexpr" for k in ("BLOCK_M", "BLOCK_P", "BINS", "FILL")}}
    return [CompileSpec(signature=sig, constexprs={"BLOCK_M": bm, "BLOCK_P": bp, "BINS": 512, "FILL": 1024},
                        label=f"m{bm} pairs{bp} E<512") for bm, bp in ((16, 512), (64, 4096))]


register_kernel("moe.align", _moe_align_kernel, _align_specs(), compat=True)
register_kernel("moe.align_sort", _moe_align_sort_kernel, _align_sort_specs(), compat=True)
register_kernel("moe.gate_up_silu", _moe_gate_up_kernel, _gate_up_specs(), compat=True)
register_kernel("moe.down_weighted", _moe_down_kernel, _down_specs(), compat=True)


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------
def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, use_triton: Optional[bool] = None,
              sort: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, expert) pairs by expert, each expert's run padded to a multiple of block_m. Pairs of id E
    (num_experts: under expert parallelism, experts other ranks hold) are left out of the rows in use (they sort past
    num_padded, which the static bound below still holds).

    topk_ids [T, k] -> (sorted_ids int32 [max_blocks * block_m]: pair index t*k + j, or T*k on padding rows;
    block_expert int32 [max_blocks]; num_padded int32 [1]: rows in use). Device ops only (no host sync);
    max_blocks = cdiv(T*k, block_m) + min(E, T*k) bounds the padded length whatever the routing. On CUDA, up
    to TRITON_ALIGN_MAX_PAIRS pairs, one Triton launch computes the same outputs (use_triton: force either way;
    block_expert past the rows in use is 0 there, E - 1 here: no kernel reads it): the sort kernel while a CUDA
    graph is captured, the chunk kernel otherwise (sort: force either).
    """
    dev = topk_ids.device
    n = topk_ids.numel()
    if (topk_ids.is_cuda and n <= TRITON_ALIGN_MAX_PAIRS if use_triton is None else use_triton) and n > 0:
        return _moe_align_triton(topk_ids, num_experts, block_m, sort)
    flat = topk_ids.reshape(-1).to(torch.int64)
    # (bin E: pairs left out, padded to nothing and sorted last)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded[num_experts] = 0
    ends_p = torch.cumsum(padded, 0)
    starts_p = ends_p - padded
    starts_c = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    se = flat.index_select(0, order)
    dest = starts_p.index_select(0, se) + torch.arange(n, device=dev) - starts_c.index_select(0, se)
    max_blocks = triton.cdiv(n, block_m) + min(num_experts, n)
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    starts = torch.arange(max_blocks, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(ends_p[:num_experts], starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), ends_p[-1:].to(torch.int32)


def _moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, sort: Optional[bool] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align's outputs from one launch instead of ~28 small torch ops: _moe_align_sort_kernel in a CUDA-graph
    capture (its compile per power of two of the pair count happens there, at start-up; faster replays),
    _moe_align_kernel in eager steps (one compile for every pair count, which a step would otherwise wait for)."""
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int32)
    n = ids.numel()
    max_blocks = triton.cdiv(n, block_m) + min(num_experts, n)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    bins = triton.next_power_of_2(num_experts + 1)  # + the bin of the padding lanes
    if (ids.is_cuda and torch.cuda.is_current_stream_capturing()) if sort is None else sort:
        scratch = torch.empty(2 * bins, dtype=torch.int32, device=dev)
        _moe_align_sort_kernel[(1,)](ids, sorted_ids, block_expert, num_padded, scratch, n, num_experts,
                                     max_blocks * block_m, max_blocks, BLOCK_M=block_m,
                                     BLOCK_P=triton.next_power_of_2(n), BINS=bins, FILL=1024, num_warps=4)
        return sorted_ids, block_expert, num_padded
    _moe_align_kernel[(1,)](ids, sorted_ids, block_expert, num_padded, n, num_experts,
                            max_blocks * block_m, max_blocks, block_m,
                            CHUNK=min(ALIGN_CHUNK, max(16, triton.next_power_of_2(n))), BINS=bins, FILL=1024,
                            num_warps=ALIGN_WARPS)
    return sorted_ids, block_expert, num_padded


def pick_config(num_pairs: int, num_experts: int, itemsize: int = 2) -> dict:
    """Tile sizes. Few pairs per expert (decode): BLOCK_M 16 so an expert with a handful of tokens pays
    little padding and its weights are read once; more: 64-row tiles, 128-row ones from ~64 pairs per expert.
    From benchmarks/micro/moe_grouped_sweep.py (35B shape, H200, session 21): 4096 pairs 528 us (4 warps, 4
    stages) vs 543 (the former 8 warps, 3 stages); 65536 pairs 1,701 us (128 rows) vs 1,878. itemsize: of the
    activations and weights (4: fp32, whose K blocks are capped at FP32_MAX_BLOCK_K)."""
    if num_pairs <= 2 * num_experts or num_pairs <= 256:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2)
    elif num_pairs >= 64 * num_experts:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    if itemsize >= 4:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], FP32_MAX_BLOCK_K)
    return cfg


def expert_dims(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """(experts E, expert width I, hidden H) of stacked expert weights w13 [E, 2I, H], w2 [E, H, I] for x [T, H];
    a clear error when they do not fit together."""
    hdim = x.shape[1]
    e_num, two_i, h_w = w13.shape
    inter_dim = two_i // 2
    if h_w != hdim or tuple(w2.shape) != (e_num, hdim, inter_dim):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    return e_num, inter_dim, hdim


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, out: Optional[torch.Tensor] = None, config: Optional[dict] = None,
                  _workspaces: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                  skip_foreign: bool = False) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k] (any float, used in fp32); topk_ids [T, k]
    -> out [T, H] in x's dtype. Same function as fused_experts_ref. `_workspaces` (tests): (inter [>=P, I],
    pair_out [>=P, H]) buffers to use instead of fresh ones. skip_foreign (expert parallelism): ids -1 name experts
    other ranks hold; their pairs are left out of the sort and add zero."""
    t = x.shape[0]
    _, inter_dim, hdim = expert_dims(x, w13, w2)
    k = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    if t == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    chunk_t = max(1, MAX_CHUNK_PAIRS // k)
    pairs_max = min(t, chunk_t) * k
    if _workspaces is not None:
        inter_ws, pair_ws = _workspaces
    else:
        inter_ws = torch.empty(pairs_max, inter_dim, dtype=x.dtype, device=x.device)
        pair_ws = torch.empty(pairs_max, hdim, dtype=x.dtype, device=x.device)
    for s in range(0, t, chunk_t):
        e = min(t, s + chunk_t)
        _run_chunk(x[s:e], w13, w2, topk_weights[s:e], topk_ids[s:e], out[s:e], inter_ws, pair_ws, config,
                   skip_foreign)
    return out


def _run_chunk(x, w13, w2, topk_weights, topk_ids, out, inter_ws, pair_ws, config, skip_foreign=False) -> None:
    t, hdim = x.shape
    e_num, two_i, _ = w13.shape
    inter_dim = two_i // 2
    k = topk_ids.shape[1]
    p = t * k
    cfg = dict(config or pick_config(p, e_num, x.element_size()))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if skip_foreign:  # other ranks' pairs as id E: moe_align leaves them out, so no kernel writes their rows
        topk_ids = torch.where(topk_ids < 0, e_num, topk_ids)
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, e_num, bm)
    max_blocks = block_expert.numel()
    inter = inter_ws[:p]
    pair_out = pair_ws[:p]
    if skip_foreign:
        pair_out.zero_()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _moe_gate_up_kernel[(max_blocks * triton.cdiv(inter_dim, bn),)](
        x, w13, sorted_ids, block_expert, num_padded, inter,
        p, hdim, inter_dim,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOP_K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    _moe_down_kernel[(max_blocks * triton.cdiv(hdim, bn),)](
        inter, w2, sorted_ids, block_expert, num_padded, tw, pair_out,
        p, hdim, inter_dim,
        inter.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    if k == 1:
        out.copy_(pair_out)
    else:
        torch.sum(pair_out.view(t, k, hdim), dim=1, out=out)
