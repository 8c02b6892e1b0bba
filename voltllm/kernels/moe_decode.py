"""Sparse-MoE kernels for decode-sized batches (Triton): the router in one launch, the routed experts in two.

At one to a few tokens an MoE layer's time is launches, not bytes: the grouped GEMM of voltllm.kernels.moe
needs its (token, expert) pairs sorted by expert first (`moe_align`, ~20 small torch ops) plus the softmax /
top-k / renormalize router (~5) and a sum over k, about 27 launches per layer before any weight is read; the
H200 profile of qwen3.5-35b-a3b-shape at batch 1 (session 20: 138.7 tok/s, 23% of the read limit) is made of
them. Here:
  `_moe_route_kernel`      grid (token): softmax over the E router logits in fp32, top-k by k rounds of
                           max + lowest index of the max (torch.topk's order for distinct values), optional
                           renormalization; writes weights fp32 [T, k] and ids int32 [T, k].
  `_moe_small_gate_up_kernel`  grid (pair, block of I): one (token, expert) pair per program, no sort: the
                           token's x row times its expert's gate and up rows (fp32 FMAs, a GEMV: M = 1 is
                           below tl.dot's 16), silu(gate) * up stored at the pair's row of `inter` [T*k, I].
  `_moe_small_down_kernel` grid (token, block of H): the token's k expert rows of `inter` times their
                           experts' down rows, weighted by the routing weights and summed in fp32, written
                           straight to out[t] (no per-pair output, no sum launch).
Without the sort, two pairs of one expert read its weights twice: `SMALL_MAX_PAIRS` keeps this path to
batches where that is rare (at 8 routed of 256 experts, 64 pairs hit ~57 distinct experts).
Numerics: fp32 accumulation throughout, `inter` rounded once to the activation dtype (as the grouped GEMM
does), the k-sum rounded once (the grouped GEMM rounds each pair's output first). FMAs only: registered
for the sm_70 / sm_75 compile gate.

Reference: voltllm.model.layers.moe.route / fused_experts_ref. Tests: tests/unit/test_moe_kernels.py
(interpreter), tests/gpu/test_hybrid_gpu.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel

SMALL_MAX_PAIRS = 64  # (token, expert) pairs up to which SparseMoE takes the unsorted path on CUDA


@triton.jit
def _moe_route_kernel(Logits, W, Ids, stride_l, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_TOPK: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
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
        idx = tl.min(tl.where(left == best, offs, BLOCK_E), axis=0)
        w = tl.where(slot == j, best, w)
        ids = tl.where(slot == j, idx, ids)
        left = tl.where(offs == idx, -1.0, left)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    mk = slot < TOP_K
    tl.store(W + t * TOP_K + slot, w, mask=mk)
    tl.store(Ids + t * TOP_K + slot, ids, mask=mk)


@triton.jit
def _moe_small_gate_up_kernel(X, W13, Ids, Inter, H, I, stride_xt, stride_we, stride_wn, stride_it,
                              TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    t = pair // TOP_K
    e = tl.load(Ids + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < I
    wg_rows = W13 + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    wu_rows = wg_rows + I * stride_wn
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
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
def _moe_small_down_kernel(Inter, W2, Ids, TopkW, Out, H, I, stride_it, stride_we, stride_wn, stride_ot,
                           TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < H
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(Ids + pair).to(tl.int64)
        w_rows = W2 + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        part = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < I
            a = tl.load(Inter + pair * stride_it + offs_k, mask=mk, other=0.0).to(tl.float32)
            wt = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
            part += tl.sum(wt * a[None, :], axis=1)
        acc += tl.load(TopkW + pair).to(tl.float32) * part
    tl.store(Out + t * stride_ot + offs_n, acc.to(Out.dtype.element_ty), mask=mn)


def _route_specs() -> list[CompileSpec]:
    return [CompileSpec(signature={"Logits": f"*{act}", "W": "*fp32", "Ids": "*i32", "stride_l": "i32", "E": "i32",
                                   **{n: "constexpr" for n in ("TOP_K", "BLOCK_E", "BLOCK_TOPK", "RENORM")}},
                        constexprs={"TOP_K": 8, "BLOCK_E": 256, "BLOCK_TOPK": 8, "RENORM": True},
                        label=f"{act} E256 k8") for act in ("fp16", "fp32")]


def _gate_up_specs() -> list[CompileSpec]:
    return [CompileSpec(signature={
        "X": f"*{act}", "W13": f"*{act}", "Ids": "*i32", "Inter": f"*{act}", "H": "i32", "I": "i32",
        "stride_xt": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_it": "i32",
        "TOP_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        constexprs={"TOP_K": 8, "BLOCK_N": 16, "BLOCK_K": 256}, label=f"{act} n16 k256 top8")
        for act in ("fp16", "fp32")]


def _down_specs() -> list[CompileSpec]:
    return [CompileSpec(signature={
        "Inter": f"*{act}", "W2": f"*{act}", "Ids": "*i32", "TopkW": "*fp32", "Out": f"*{act}", "H": "i32",
        "I": "i32", "stride_it": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_ot": "i32",
        "TOP_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        constexprs={"TOP_K": 8, "BLOCK_N": 16, "BLOCK_K": 256}, label=f"{act} n16 k256 top8")
        for act in ("fp16", "fp32")]


register_kernel("moe.route_topk", _moe_route_kernel, _route_specs(), compat=True)
register_kernel("moe.small_gate_up", _moe_small_gate_up_kernel, _gate_up_specs(), compat=True)
register_kernel("moe.small_down", _moe_small_down_kernel, _down_specs(), compat=True)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route() in one launch: router_logits [T, E] (any float) -> (weights fp32 [T, k], ids int32 [T, k])."""
    t, e = router_logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"moe_route: top_k {top_k} must be in 1..{e}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _moe_route_kernel[(t,)](logits, w, ids, logits.stride(0), e, TOP_K=top_k,
                                BLOCK_E=triton.next_power_of_2(e), BLOCK_TOPK=triton.next_power_of_2(top_k),
                                RENORM=renormalize, num_warps=4 if e > 256 else 2)
    return w, ids


def fused_experts_small(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """voltllm.kernels.moe.fused_experts for a few tokens (T * k up to about SMALL_MAX_PAIRS; any T works):
    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k]; topk_ids [T, k] -> out [T, H] in x's dtype."""
    t, hdim = x.shape
    e_num, two_i, h_w = w13.shape
    inter_dim = two_i // 2
    k = topk_ids.shape[1]
    if h_w != hdim or tuple(w2.shape) != (e_num, hdim, inter_dim):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if out is None:
        out = torch.empty_like(x)
    if t == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    inter = torch.empty(t * k, inter_dim, dtype=x.dtype, device=x.device)
    bn = 16
    _moe_small_gate_up_kernel[(t * k, triton.cdiv(inter_dim, bn))](
        x, w13, ids, inter, hdim, inter_dim, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOP_K=k, BLOCK_N=bn, BLOCK_K=min(256, triton.next_power_of_2(hdim)), num_warps=4)
    _moe_small_down_kernel[(t, triton.cdiv(hdim, bn))](
        inter, w2, ids, tw, out, hdim, inter_dim, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=k, BLOCK_N=bn, BLOCK_K=min(256, triton.next_power_of_2(inter_dim)), num_warps=4)
    return out
