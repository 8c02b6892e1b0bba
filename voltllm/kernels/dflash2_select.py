"""DFlash2's candidate-selector walk (model/models/dflash2_layers.py) in one launch.

Block i's drafts are a walk: from its known token a, draft row j takes among its top-K tokens b (candidates, with
their logits u) the one maximising

    u[b] + sum_r P[a, r] * h_j[r] * S[b, r]        (P / S: the predecessor / successor codebooks [vocab, rank],
                                                    h_j: row j's hidden state through the selector's projection)

and that token is row j + 1's predecessor. In torch (`walk_torch`, the reference and the CPU form) each step is a
handful of launches, so a block of K drafts costs ~6 K launches per proposal; here program i walks block i through
all its rows with the candidates' codebook rows in registers ([K, rank] fp32: 16 x 256 = 16 KB). The products are
fp32 and differ from torch's only in their summation order; among equal scores the first candidate wins (the
candidates come sorted by logit, so the higher logit), as torch.argmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from voltllm.kernels.registry import CompileSpec, register_kernel


@triton.jit
def _walk_kernel(CAND, UNARY, PROJ, PRED_CB, SUCC_CB, ANCHORS, OUT, n, kmax, rank, TOPK: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    i = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    k_in = kk < TOPK
    r_in = rr < rank
    pred = tl.load(ANCHORS + i).to(tl.int64)
    n64 = tl.full([], 1, tl.int64) * n  # (n may come as a plain int: Triton specializes a 1)
    for j in range(kmax):
        row = i.to(tl.int64) + j * n64
        cand = tl.load(CAND + row * TOPK + kk, mask=k_in, other=0).to(tl.int64)
        unary = tl.load(UNARY + row * TOPK + kk, mask=k_in, other=0.0)
        gate = tl.load(PROJ + row * rank + rr, mask=r_in, other=0.0) * \
            tl.load(PRED_CB + pred * rank + rr, mask=r_in, other=0.0).to(tl.float32)
        succ = tl.load(SUCC_CB + cand[:, None] * rank + rr[None, :], mask=k_in[:, None] & r_in[None, :],
                       other=0.0).to(tl.float32)
        score = tl.where(k_in, unary + tl.sum(succ * gate[None, :], axis=1), float("-inf"))
        best = tl.argmax(score, axis=0)
        pred = tl.sum(tl.where(kk == best, cand, 0), axis=0)
        tl.store(OUT + row, pred)


def _specs() -> list[CompileSpec]:
    sig = {"CAND": "*i64", "UNARY": "*fp32", "PROJ": "*fp32", "PRED_CB": "", "SUCC_CB": "", "ANCHORS": "*i64",
           "OUT": "*i64", "n": "i32", "kmax": "i32", "rank": "i32", "TOPK": "constexpr", "BLOCK_K": "constexpr",
           "BLOCK_R": "constexpr"}
    # the public drafter's sizes (top 16, rank 256) and a small odd one (the tests'); no bf16 on sm_70 / 75
    return [CompileSpec({**sig, "PRED_CB": dt, "SUCC_CB": dt}, {"TOPK": k, "BLOCK_K": bk, "BLOCK_R": br},
                        f"{dt[1:]} top{k} r{br}")
            for dt in ("*fp16", "*fp32") for k, bk, br in ((16, 16, 256), (4, 4, 8))]


register_kernel("dflash2.select_walk", _walk_kernel, _specs())


def walk_torch(cand: torch.Tensor, unary: torch.Tensor, proj: torch.Tensor, pred_cb: torch.Tensor,
               succ_cb: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The walk in torch: cand / unary [kmax * n, K] (draft-major rows: draft j of block i at j * n + i), proj
    [kmax * n, rank] fp32, the codebooks [vocab, rank], anchors [n]. Returns the drafts [kmax, n] (int64)."""
    n = anchors.shape[0]
    kmax, top = cand.shape[0] // n, cand.shape[1]
    succ = succ_cb[cand].float().view(kmax, n, top, -1)
    unary, cand, proj = unary.view(kmax, n, top), cand.view(kmax, n, top), proj.view(kmax, n, -1)
    pred, out = anchors.long(), []
    for j in range(kmax):
        scores = unary[j] + torch.einsum("nr,nkr->nk", pred_cb[pred].float() * proj[j], succ[j])
        pred = cand[j].gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
        out.append(pred)
    return torch.stack(out)


def walk(cand: torch.Tensor, unary: torch.Tensor, proj: torch.Tensor, pred_cb: torch.Tensor, succ_cb: torch.Tensor,
         anchors: torch.Tensor) -> torch.Tensor:
    """walk_torch's drafts from one kernel launch (arguments as there; CUDA tensors)."""
    n = anchors.shape[0]
    rows, top = cand.shape
    rank = pred_cb.shape[1]
    if rows % n or unary.shape != (rows, top) or proj.shape != (rows, rank) or succ_cb.shape != pred_cb.shape:
        raise ValueError(f"select walk: candidates {tuple(cand.shape)}, logits {tuple(unary.shape)}, projection "
                         f"{tuple(proj.shape)}, codebooks {tuple(pred_cb.shape)} / {tuple(succ_cb.shape)} for {n} "
                         "blocks do not fit together")
    if pred_cb.dtype != succ_cb.dtype or pred_cb.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"select walk: codebooks of {pred_cb.dtype} / {succ_cb.dtype}")
    out = torch.empty(rows, dtype=torch.int64, device=cand.device)
    _walk_kernel[(n,)](cand.long().contiguous(), unary.float().contiguous(), proj.float().contiguous(),
                       pred_cb.contiguous(), succ_cb.contiguous(), anchors.long().contiguous(), out, n, rows // n,
                       rank, TOPK=top, BLOCK_K=triton.next_power_of_2(top), BLOCK_R=triton.next_power_of_2(rank),
                       num_warps=4)
    return out.view(rows // n, n)
