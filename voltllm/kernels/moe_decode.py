"""Sparse-MoE kernels for decode-sized batches (Triton): the router in one launch, the routed experts in two.

At one to a few tokens an MoE layer's time is launches, not bytes: the grouped GEMM of voltllm.kernels.moe
needs its (token, expert) pairs sorted by expert first (`moe_align`, ~20 small torch ops) plus the softmax /
top-k / renormalize router (~5) and a sum over k, about 27 launches per layer before any weight is read, and
the shared expert 7 more. qwen3.5-35b-a3b-shape ran at 138.7 tok/s at batch 1 on the H200 (23% of its read
limit); the router and the unsorted experts below took it to 175.0 (session 20), to 337.1 once their loops
were unrolled so that a program's weight loads are all in flight together, and to 361.3 (59.5%) with PDL
(session 21). Here:
  `_moe_route_kernel`      grid (token): softmax over the E router logits in fp32, top-k by k rounds of
                           max + lowest index of the max (torch.topk's order for distinct values), optional
                           renormalization; writes weights fp32 [T, k] and ids int32 [T, k]; optionally one
                           more entry per token for the shared expert: sigmoid(x . w_gate), id E.
  `_moe_small_gate_up_kernel`  grid (pair, block of I): one (token, expert) pair per program, no sort: the
                           token's x row times its expert's gate and up rows (fp32 FMAs, a GEMV: M = 1 is
                           below tl.dot's 16), silu(gate) * up stored at the pair's row of `inter` [T*k, I].
  `_moe_small_down_kernel` grid (token, block of H): the token's k expert rows of `inter` times their
                           experts' down rows, weighted by the routing weights and summed in fp32, written
                           straight to out[t] (no per-pair output, no sum launch).
  Entries with id E read the shared expert's own weights in both kernels, so one layer's experts, routed and
  shared, are these two launches. Entries with id -1 (expert parallelism: experts other ranks hold) read nothing
  and add zero.
Without the sort, two pairs of one expert read its weights twice (the second read mostly from L2):
`SMALL_MAX_PAIRS` keeps this path to batches where it still beats the grouped GEMM (35B shape, session 21: 21 vs 34
us at 8 pairs, 89 vs 99 at 64, 158 vs 162 at 128; benchmarks/micro/moe_decode_sweep.py).
All three wait for their predecessor under programmatic dependent launch (voltllm/kernels/pdl.py, sm_90+
native route), so their launch and ramp-up overlap the previous kernel's tail.
Numerics: fp32 accumulation throughout, `inter` rounded once to the activation dtype (as the grouped GEMM
does), the k-sum rounded once (the grouped GEMM rounds each pair's output first). FMAs only: registered
for the sm_70 / sm_75 compile gate.

Reference: voltllm.model.layers.moe.route / fused_experts_ref. Tests: tests/unit/test_moe_kernels.py
(interpreter), tests/gpu/test_hybrid_gpu.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.moe import expert_dims
from voltllm.kernels.pdl import pdl_enter
from voltllm.kernels.registry import CompileSpec, register_kernel

SMALL_MAX_PAIRS = 128  # (token, expert) pairs up to which SparseMoE takes the unsorted path on CUDA


@triton.jit
def _moe_route_kernel(Logits, W, Ids, X, Wsg, stride_l, stride_xt, E, H, TOP_K: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, RENORM: tl.constexpr,
                      HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # (every input comes from the previous kernels)
    t = tl.program_id(0).to(tl.int64)
    k_out = TOP_K + HAS_SHARED  # entries per token: the routed experts, then the shared one
    offs = tl.arange(0, BLOCK_E)
    me = offs < E
    logit = tl.load(Logits + t * stride_l + offs, mask=me, other=float("-inf")).to(tl.float32)
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = tl.where(me, p, 0.0)
    p = p / tl.sum(p, axis=0)
    left = tl.where(me, p, -1.0)  # chosen experts drop to -1 (every probability is >= 0)
    slot = tl.arange(0, BLOCK_TOPK)
    w = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    ids = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        # (clamped: a row of NaN logits, as a padded or overflowed row can hold, matches nothing; it must still
        # name a real expert, or the expert kernels would read past the weights)
        idx = tl.minimum(tl.min(tl.where(left == best, offs, BLOCK_E), axis=0), E - 1)
        w = tl.where(slot == j, best, w)
        ids = tl.where(slot == j, idx, ids)
        left = tl.where(offs == idx, -1.0, left)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    mk = slot < TOP_K
    tl.store(W + t * k_out + slot, w, mask=mk)
    tl.store(Ids + t * k_out + slot, ids, mask=mk)
    if HAS_SHARED:  # the shared expert's weight sigmoid(x . w_gate), with id E
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mh = offs_h < H
            acc += tl.load(X + t * stride_xt + offs_h, mask=mh, other=0.0).to(tl.float32) * \
                tl.load(Wsg + offs_h, mask=mh, other=0.0).to(tl.float32)
        tl.store(W + t * k_out + TOP_K, 1.0 / (1.0 + tl.exp(-tl.sum(acc, axis=0))))
        tl.store(Ids + t * k_out + TOP_K, E)


@triton.jit
def _moe_small_gate_up_kernel(X, W13, WS13, Ids, Inter, E, H, I, IS, stride_xt, stride_we, stride_wn, stride_sn,
                              stride_it, K_OUT: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # (which weights to read is the router's output)
    pair = tl.program_id(0).to(tl.int64)
    t = pair // K_OUT
    e = tl.load(Ids + pair)
    if e < 0:  # another rank's expert: its `inter` row is never read (the down kernel skips the pair too)
        return
    base = W13 + e.to(tl.int64) * stride_we
    stride_n = stride_wn
    n_lim = I
    if HAS_SHARED:
        if e == E:  # the shared expert: its own [2 IS, H] weight
            base = WS13
            stride_n = stride_sn
            n_lim = IS
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < n_lim
    wg_rows = base + offs_n[:, None].to(tl.int64) * stride_n
    wu_rows = wg_rows + n_lim * stride_n
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    # unrolled (NUM_K * BLOCK_K covers H): one basic block, so every block's weight loads can be in flight at
    # once; a runtime loop waited for each block's loads before issuing the next (~1.3 TB/s at one token)
    for kb in tl.static_range(NUM_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mk = offs_k < H
        x = tl.load(X + t * stride_xt + offs_k, mask=mk, other=0.0).to(tl.float32)
        m2 = mn[:, None] & mk[None, :]
        wg = tl.load(wg_rows + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
        wu = tl.load(wu_rows + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * x[None, :], axis=1)
        acc_u += tl.sum(wu * x[None, :], axis=1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(Inter + pair * stride_it + offs_n, h.to(Inter.dtype.element_ty), mask=mn)


@triton.jit
def _moe_small_down_kernel(Inter, W2, WS2, Ids, TopkW, Out, E, H, I, IS, stride_it, stride_we, stride_wn,
                           stride_sn, stride_ot, K_OUT: tl.constexpr, HAS_SHARED: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < H
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # unrolled over the token's experts and the blocks of I (as in the gate_up kernel): all k experts' down rows
    # are loaded before the first sum needs them
    for j in tl.static_range(K_OUT):
        pair = t * K_OUT + j
        e = tl.load(Ids + pair)
        held = e >= 0  # (-1: another rank's expert, nothing loaded, zero added)
        base = W2 + tl.maximum(e, 0).to(tl.int64) * stride_we
        stride_n = stride_wn
        k_lim = tl.where(held, I, 0)
        if HAS_SHARED:
            if e == E:  # the shared expert's [H, IS] down weight
                base = WS2
                stride_n = stride_sn
                k_lim = IS
        w_rows = base + offs_n[:, None].to(tl.int64) * stride_n
        part = tl.zeros([BLOCK_N], dtype=tl.float32)
        for kb in tl.static_range(NUM_K):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            mk = offs_k < k_lim
            a = tl.load(Inter + pair * stride_it + offs_k, mask=mk, other=0.0).to(tl.float32)
            wt = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
            part += tl.sum(wt * a[None, :], axis=1)
        acc += tl.load(TopkW + pair).to(tl.float32) * part
    tl.store(Out + t * stride_ot + offs_n, acc.to(Out.dtype.element_ty), mask=mn)


def _route_specs() -> list[CompileSpec]:
    return [CompileSpec(signature={
        "Logits": f"*{act}", "W": "*fp32", "Ids": "*i32", "X": f"*{act}", "Wsg": f"*{act}", "stride_l": "i32",
        "stride_xt": "i32", "E": "i32", "H": "i32",
        **{n: "constexpr" for n in ("TOP_K", "BLOCK_E", "BLOCK_TOPK", "RENORM", "HAS_SHARED", "BLOCK_H", "PDL")}},
        constexprs={"TOP_K": 8, "BLOCK_E": 256, "BLOCK_TOPK": 8, "RENORM": True, "HAS_SHARED": shared,
                    "BLOCK_H": 1024, "PDL": False},
        label=f"{act} E256 k8" + (" shared" if shared else "")) for act in ("fp16", "fp32") for shared in (0, 1)]


def _expert_specs(pointers: tuple[str, ...], strides: tuple[str, ...]) -> list[CompileSpec]:
    def sig(act: str) -> dict:
        return {**{n: ("*i32" if n == "Ids" else "*fp32" if n == "TopkW" else f"*{act}") for n in pointers},
                **{n: "i32" for n in ("E", "H", "I", "IS") + strides},
                **{n: "constexpr" for n in ("K_OUT", "HAS_SHARED", "BLOCK_N", "BLOCK_K", "NUM_K", "PDL")}}
    return [CompileSpec(signature=sig(act), constexprs={"K_OUT": 8 + shared, "HAS_SHARED": shared, "BLOCK_N": 4,
                                                        "BLOCK_K": 512, "NUM_K": 4, "PDL": False},
                        label=f"{act} n4 k512x4 top8" + (" shared" if shared else ""))
            for act in ("fp16", "fp32") for shared in (0, 1)]


register_kernel("moe.route_topk", _moe_route_kernel, _route_specs(), compat=True)
register_kernel("moe.small_gate_up", _moe_small_gate_up_kernel, _expert_specs(
    ("X", "W13", "WS13", "Ids", "Inter"), ("stride_xt", "stride_we", "stride_wn", "stride_sn", "stride_it")),
    compat=True)
register_kernel("moe.small_down", _moe_small_down_kernel, _expert_specs(
    ("Inter", "W2", "WS2", "Ids", "TopkW", "Out"), ("stride_it", "stride_we", "stride_wn", "stride_sn", "stride_ot")),
    compat=True)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
              shared_gate: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
              num_warps: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """route() in one launch: router_logits [T, E] (any float) -> (weights fp32 [T, k], ids int32 [T, k]).
    shared_gate (x [T, H], the shared expert's gate weight [H]): one more entry per token, weight
    sigmoid(x . w) in fp32 and id E, which fused_experts_small(shared=...) reads as the shared expert.
    num_warps: per token; one warp for up to 256 experts keeps every reduction in shuffles (3.6 us vs 4.4 with
    two at 1 token, 35B shape; benchmarks/micro/moe_grouped_sweep.py)."""
    t, e = router_logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"moe_route: top_k {top_k} must be in 1..{e}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    k_out = top_k + (shared_gate is not None)
    w = torch.empty(t, k_out, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k_out, dtype=torch.int32, device=logits.device)
    x, wsg = shared_gate if shared_gate is not None else (logits, logits)  # (not read without a shared gate)
    x = x if x.stride(-1) == 1 else x.contiguous()
    hdim = x.shape[1]
    if shared_gate is not None and wsg.numel() != hdim:
        raise ValueError(f"moe_route: shared gate weight of {wsg.numel()} elements for hidden size {hdim}")
    if t:
        _moe_route_kernel[(t,)](logits, w, ids, x, wsg.reshape(-1), logits.stride(0), x.stride(0), e, hdim,
                                TOP_K=top_k, BLOCK_E=triton.next_power_of_2(e),
                                BLOCK_TOPK=triton.next_power_of_2(top_k), RENORM=renormalize,
                                HAS_SHARED=int(shared_gate is not None),
                                BLOCK_H=min(1024, triton.next_power_of_2(hdim)),
                                num_warps=num_warps or (4 if e > 256 else 1), **pdl.launch_options())
    return w, ids


def fused_experts_small(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, out: Optional[torch.Tensor] = None,
                        shared: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                        tiles: tuple[int, int, int, int] = (2, 4, 2, 1024)) -> torch.Tensor:
    """voltllm.kernels.moe.fused_experts for a few tokens (T * k up to about SMALL_MAX_PAIRS; any T works):
    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k]; topk_ids [T, k] -> out [T, H] in x's dtype.
    shared (the shared expert's gate_up [2 IS, H] and down [H, IS] weights): entries with id E are that
    expert (moe_route(shared_gate=...) appends one per token), so out also holds its gated output.
    tiles: (gate_up columns per program, down columns per program, warps, gate_up K block); the default was the
    fastest or within 1% of it at 1-16 tokens in benchmarks/micro/moe_decode_sweep.py (35B shape, H200)."""
    t = x.shape[0]
    e_num, inter_dim, hdim = expert_dims(x, w13, w2)
    k_out = topk_ids.shape[1]
    ws13, ws2 = shared if shared is not None else (w13, w2)  # (not read without a shared expert)
    shared_dim = ws13.shape[0] // 2 if shared is not None else inter_dim
    if shared is not None and (tuple(ws13.shape) != (2 * shared_dim, hdim) or tuple(ws2.shape) != (hdim, shared_dim)):
        raise ValueError(f"shared expert weights {tuple(ws13.shape)} / {tuple(ws2.shape)} do not fit x "
                         f"{tuple(x.shape)}")
    if out is None:
        out = torch.empty_like(x)
    if t == 0:
        return out
    x, w13, w2, ws13, ws2 = (a if a.stride(-1) == 1 else a.contiguous() for a in (x, w13, w2, ws13, ws2))
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    width = max(inter_dim, shared_dim)
    inter = torch.empty(t * k_out, width, dtype=x.dtype, device=x.device)
    has_shared = int(shared is not None)
    bn_up, bn_down, warps, bk_up = tiles
    bk_up = min(bk_up, triton.next_power_of_2(hdim))
    bk_down = min(1024, triton.next_power_of_2(width))
    _moe_small_gate_up_kernel[(t * k_out, triton.cdiv(width, bn_up))](
        x, w13, ws13, ids, inter, e_num, hdim, inter_dim, shared_dim, x.stride(0), w13.stride(0), w13.stride(1),
        ws13.stride(0), inter.stride(0),
        K_OUT=k_out, HAS_SHARED=has_shared, BLOCK_N=bn_up, BLOCK_K=bk_up, NUM_K=triton.cdiv(hdim, bk_up),
        num_warps=warps, **pdl.launch_options())
    _moe_small_down_kernel[(t, triton.cdiv(hdim, bn_down))](
        inter, w2, ws2, ids, tw, out, e_num, hdim, inter_dim, shared_dim, inter.stride(0), w2.stride(0),
        w2.stride(1), ws2.stride(0), out.stride(0),
        K_OUT=k_out, HAS_SHARED=has_shared, BLOCK_N=bn_down, BLOCK_K=bk_down, NUM_K=triton.cdiv(width, bk_down),
        num_warps=warps, **pdl.launch_options())
    return out
