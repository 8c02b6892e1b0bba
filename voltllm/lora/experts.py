"""LoRA on a sparse MoE layer's routed experts: each (token, expert) pair whose token has an adapter gets that adapter's
term for that expert inside the expert, before the routing weights combine the experts:

    gate_up = x Wgu_e^T  + [x A_gate^T B_gate^T | x A_up^T B_up^T]     (the adapter's, expert e's; scaling in B)
    h       = silu(gate) * up
    y       = h Wd_e^T   + h A_down^T B_down^T

The terms cannot be added after the layer (SiLU is not linear), so with such an adapter in the step the layer runs
its experts here (`ExpertLoRAWeights.forward`), in torch: the pairs sorted by (expert, slot), one base GEMM pair per
expert that received pairs (its weights from the layer: dense, or a quantized expert dequantized) and, inside the
expert's block, the rank-r products of each slot's run of rows. Sorting needs the per-(expert, slot) counts on the host
(one sync per layer, as the torch MoE reference has), so a step whose tokens use an adapter with expert weights runs
eagerly, never as a CUDA graph replay (`LoRABatch.experts_active`; the runner chooses eager for it: ModelRunner.
launch_forward). Steps whose adapters leave the experts alone keep the graphs and the fused expert kernels.

Slots: all --max-loras slots of every held expert, at --max-lora-rank (smaller ranks zero-padded):
A_gate | A_up [S, E, 2R, H], B_gate^T | B_up^T [S, E, 2R, I], A_down [S, E, R, I], B_down^T [S, E, R, H]: per slot
and MoE layer E x R x 3 (H + I) values (`expert_slot_values`). A slot whose adapter has no expert weights in a layer
adds nothing there (its rows are skipped, `filled`).

Tensor parallelism cuts the adapters as the layer cuts its experts (`SparseMoE._expert_part`, the checkpoint loader's
cut): without expert parallelism every rank holds every expert's band of intermediate rows, so gate / up take B's rows
of that band (A whole) and down takes A's columns (B whole); the rank's down term is then its partial sum, added by
the layer's all-reduce with the rest. Under expert parallelism (--enable-expert-parallel) a rank holds its experts
whole and keeps their pairs alone; pairs routed to other ranks' experts (id -1) are skipped, as the base path skips
them.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from voltllm.lora.adapter import ExpertPairs, ExpertShape
from voltllm.model.layers.activation import silu_and_mul


def expert_slot_values(shape: ExpertShape, max_loras: int, max_rank: int) -> int:
    """Values the slots of one MoE layer's whole experts take (before any rank's cut)."""
    return max_loras * shape.num_experts * max_rank * 3 * (shape.hidden + shape.inter)


class ExpertLoRAWeights:
    def __init__(self, moe: Any, batch: Any, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        """moe: the layer (voltllm.model.layers.moe.SparseMoE) whose held experts take the slots."""
        self.moe = moe
        self.batch = batch
        self.slots, self.rank = max_loras, max_rank
        e, h, i = moe.num_local_experts, moe.hidden, moe.inter
        self.num_experts, self.hidden, self.inter = e, h, i
        self.a13 = torch.zeros(max_loras, e, 2 * max_rank, h, dtype=dtype, device=device)
        self.b13 = torch.zeros(max_loras, e, 2 * max_rank, i, dtype=dtype, device=device)
        self.a2 = torch.zeros(max_loras, e, max_rank, i, dtype=dtype, device=device)
        self.b2 = torch.zeros(max_loras, e, max_rank, h, dtype=dtype, device=device)
        self.filled = [False] * max_loras  # (host) slots holding expert weights of this layer

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a13, self.b13, self.a2, self.b2))

    # -- adapters --------------------------------------------------------------------------------
    def cut(self, pairs: ExpertPairs, what: str) -> ExpertPairs:
        """The whole adapter's pairs of this layer (global expert ids, whole intermediate size) as this rank holds
        them: its experts under their local ids, gate / up B^T's columns and down A's columns of its band of
        intermediate rows (the layer's own cut of the checkpoint's experts)."""
        moe, out = self.moe, {}
        shard = moe.experts_shard
        for (e, kind), (a, bt) in pairs.items():
            local = e if shard is None else shard.local(e)
            if local is None:  # (another rank's expert)
                continue
            if kind == "down":
                a = moe._expert_part("down", a, what).contiguous()
            else:
                bt = moe._expert_part(kind, bt.t(), what).t().contiguous()
            out[(local, kind)] = (a, bt)
        return out

    def load_slot(self, slot: int, pairs: Optional[ExpertPairs]) -> None:
        """Slot `slot` takes an adapter's pairs of this layer (this rank's: `cut`), zeros elsewhere. Stream-ordered
        copies: a step still in flight reads the old values."""
        for t in (self.a13, self.b13, self.a2, self.b2):
            t[slot].zero_()
        nb, r = self.a13.is_cuda, self.rank
        for (e, kind), (a, bt) in (pairs or {}).items():
            n = a.shape[0]
            if kind == "down":
                self.a2[slot, e, :n].copy_(a, non_blocking=nb)
                self.b2[slot, e, :n].copy_(bt, non_blocking=nb)
            else:
                off = 0 if kind == "gate" else r
                self.a13[slot, e, off:off + n].copy_(a, non_blocking=nb)
                self.b13[slot, e, off:off + n].copy_(bt, non_blocking=nb)
        self.filled[slot] = bool(pairs)

    # -- the step ----------------------------------------------------------------------------------
    def token_slots(self, t: int) -> torch.Tensor:
        """Each of the step's t tokens' slot (long, -1: no adapter, or one without expert weights in this layer)."""
        mask = self.batch.mask[:t]
        slot = torch.where(mask.amax(-1) > 0, mask.argmax(-1), -1)
        if not all(self.filled):
            filled = torch.tensor(self.filled + [False], device=slot.device)
            slot = torch.where(filled[slot], slot, -1)  # (-1 reads the appended False)
        return slot

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                blocks: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The experts' weighted sum with each pair's LoRA terms; x [T, H], topk_* [T, k] (local ids, -1: another
        rank's expert), blocks(e) -> expert e's (gate_up [2I, H], down [H, I]). One host sync."""
        t, k = topk_ids.shape
        e_count, s_count, r, i = self.num_experts, self.slots, self.rank, self.inter
        flat = topk_ids.reshape(-1)
        flat = torch.where(flat < 0, e_count, flat)  # (other ranks' experts sort last and are dropped)
        slot = self.token_slots(t).repeat_interleave(k)  # (pairs are token-major)
        key = flat * (s_count + 1) + (slot + 1)  # by expert, then slot (0: no adapter)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=(e_count + 1) * (s_count + 1)).view(e_count + 1, s_count + 1)
        counts = counts[:e_count].tolist()  # the one host sync
        order = order[:sum(map(sum, counts))]
        token_of = order // k
        xs = x.index_select(0, token_of)
        ys = torch.empty_like(xs)
        ldt = self.a13.dtype
        start = 0
        for e, row in enumerate(counts):
            n = sum(row)
            if n == 0:
                continue
            w13, w2 = blocks(e)
            seg = xs[start:start + n]
            runs = []  # (slot, first row inside the expert's block, rows)
            off = row[0]
            for s in range(s_count):
                if row[s + 1]:
                    runs.append((s, off, row[s + 1]))
                    off += row[s + 1]
            gate_up = F.linear(seg, w13)
            for s, a, m in runs:
                xa = F.linear(seg[a:a + m].to(ldt), self.a13[s, e])  # [m, 2R]: gate's then up's
                gate_up[a:a + m, :i] += (xa[:, :r] @ self.b13[s, e, :r]).to(gate_up.dtype)
                gate_up[a:a + m, i:] += (xa[:, r:] @ self.b13[s, e, r:]).to(gate_up.dtype)
            h = silu_and_mul(gate_up)
            y = F.linear(h, w2)
            for s, a, m in runs:
                y[a:a + m] += (F.linear(h[a:a + m].to(ldt), self.a2[s, e]) @ self.b2[s, e]).to(y.dtype)
            ys[start:start + n] = y
            start += n
        ys = ys * topk_weights.reshape(-1)[order].to(ys.dtype).unsqueeze(-1)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, ys)
        return out
