"""Sparse mixture of experts (Qwen3-Next / Qwen3.5-MoE style): softmax top-k router, optional renormalized
top-k weights, SwiGLU experts, and a shared expert scaled by a sigmoid gate.

    p        = softmax(x W_router)                          fp32
    ids, w   = topk(p, k);  w /= sum(w) if norm_topk_prob
    y        = sum_j w_j * expert_{ids_j}(x) + sigmoid(x w_sg) * shared(x)
    expert_e(x) = (silu(x Wg_e^T) * (x Wu_e^T)) Wd_e^T

Expert weights are stacked: w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], the layout a
grouped-GEMM kernel wants. The torch reference (`fused_experts_ref`) does NOT loop over every expert per
token: it sorts the (token, expert) pairs by expert so each expert's tokens are one contiguous block,
then runs one GEMM pair per expert that received tokens (empty experts are skipped), and scatters the
weighted results back with index_add. On CUDA tensors `SparseMoE` runs Triton instead: the router in one
launch (voltllm/kernels/moe_decode.py), then for batches of up to SMALL_MAX_PAIRS (token, expert) pairs two
unsorted GEMV launches (same file), for larger ones the grouped GEMM (voltllm/kernels/moe.py: device-side
sort/align, one launch for every expert's gate_up + SiLU-mul, one for every expert's down projection with the
routing weights, a sum over k): no loop over experts, no host sync.

Tensor parallelism (`tp`): every rank holds every expert (and the shared expert) with its share of their
intermediate rows (1/N, or whole quantized groups where 1/N would cut one: sharding.intermediate_split), as the
dense MLP is split: gate / up by rows, down by input columns; the router and the shared expert's gate are replicated.
Each rank's sum is then a partial product of the whole layer's (the routing weights and the shared gate's sigmoid
scale whole expert outputs, so they scale the partials alike), and one all-reduce adds them: no token exchange, the
same kernels on smaller experts.

Expert parallelism (`tp.expert_parallel`, --enable-expert-parallel): each rank holds a contiguous run of whole routed
experts instead (distributed/experts.py), the shared expert still split by rows. The router still scores every expert
on every rank; the rank's expert map (a device tensor) turns the chosen global ids into local ones, -1 for the other
ranks' experts, whose pairs every expert path skips (they add zero here and their whole output on their own rank), so
the same all-reduce sums the layer.
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.distributed.experts import expert_shard
from voltllm.distributed.sharding import intermediate_split, take_cols, take_rows
from voltllm.model.layers.activation import silu_and_mul
from voltllm.model.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, k] fp32, expert ids [T, k] long)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_* [T, k] -> [T, H]. Sorted by expert, active experts only; ids
    -1 (another rank's experts) add nothing."""
    return sorted_experts(x, topk_weights, topk_ids, w13.shape[0], lambda e: (w13[e], w2[e]))


def sorted_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                   blocks: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The experts' sum with the (token, expert) pairs sorted by expert: one GEMM pair per expert that received
    tokens, with its (gate_up [2I, H], down [H, I]) from `blocks(e)`; one host sync (the per-expert counts). Pairs of
    id -1 (expert parallelism: experts other ranks hold) sort last and are dropped."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    flat = torch.where(flat < 0, num_experts, flat)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1).tolist()[:num_experts]  # the one host sync
    order = order[:sum(counts)]
    token_of = order // k
    xs = x.index_select(0, token_of)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        w13, w2 = blocks(e)
        ys[start:start + n] = F.linear(silu_and_mul(F.linear(xs[start:start + n], w13)), w2)
        start += n
    ys = ys * topk_weights.reshape(-1)[order].to(ys.dtype).unsqueeze(-1)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, ys)
    return out


class SharedExpertMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, linear_method: Optional[LinearMethod] = None):
        super().__init__()
        self.gate_up_proj = Linear(hidden, [inter, inter], dtype=dtype, method=linear_method)
        self.down_proj = Linear(inter, hidden, dtype=dtype, method=linear_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


logger = logging.getLogger("voltllm")
_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class SparseMoE(nn.Module):
    # None: the Triton grouped GEMM on CUDA tensors only (tests set True to run it interpreted on the CPU)
    triton_experts: Optional[bool] = None
    # --enable-lora: the routed experts' adapter slots (voltllm.lora.experts.ExpertLoRAWeights); a step whose tokens
    # use an adapter with expert weights runs the experts there (eagerly), others take the paths below unchanged
    lora = None

    def __init__(self, hidden: int, num_experts: int, top_k: int, moe_inter: int, shared_inter: int,
                 norm_topk_prob: bool, dtype: torch.dtype, quantized_experts: bool = False,
                 linear_method: Optional[LinearMethod] = None, tp=None):
        """quantized_experts: quantized checkpoints' experts stay quantized (quant_moe.QuantExperts) when they
        can; no dense expert weights are allocated unless some expert cannot. linear_method: how the shared
        expert's projections hold their weights (None: dense); the router and the shared expert's gate stay dense.
        tp: this rank's tensor-parallel group (module docstring); moe_inter / shared_inter are the whole model's;
        num_experts the model's routed experts (this rank holds num_local_experts of them)."""
        super().__init__()
        self.tp = tp
        # expert parallelism: this rank's whole experts (ExpertShard) and the device map from global to local ids
        self.experts_shard = expert_shard(num_experts, tp)
        self.register_buffer("expert_map", None if self.experts_shard is None else self.experts_shard.expert_map(),
                             persistent=False)
        # this rank's intermediate rows [start, start + n) of every routed expert and of the shared expert
        self.full_inter = moe_inter
        self.inter_start, self.shared_start = 0, 0
        if tp is not None:
            if self.experts_shard is None:  # (whole experts under expert parallelism)
                self.inter_start, moe_inter = intermediate_split(moe_inter, tp)
            self.shared_start, shared_inter = intermediate_split(shared_inter, tp)
        self.num_experts, self.top_k, self.inter, self.hidden = num_experts, top_k, moe_inter, hidden
        self.num_local_experts = num_experts if self.experts_shard is None else self.experts_shard.count
        self.norm_topk_prob = norm_topk_prob
        self.dtype = dtype
        self.gate = Linear(hidden, num_experts, dtype=dtype)
        self.qexperts = None
        if quantized_experts:
            from voltllm.model.layers.quant_moe import QuantExperts

            self.w13 = self.w2 = None
            self.qexperts = QuantExperts(self.num_local_experts, moe_inter, hidden, torch.empty(0).device, dtype,
                                         getattr(linear_method, "moe_tiles", None),
                                         getattr(linear_method, "moe_max_rows", None))
        else:
            self._allocate_dense(torch.empty(0).device)
        self.shared_expert: Optional[SharedExpertMLP] = None
        self.shared_expert_gate: Optional[Linear] = None
        if shared_inter:
            self.shared_expert = SharedExpertMLP(hidden, shared_inter, dtype, linear_method)
            self.shared_expert_gate = Linear(hidden, 1, dtype=dtype)

    def _allocate_dense(self, device: torch.device) -> None:
        e, i, h = self.num_local_experts, self.inter, self.hidden
        self.w13 = nn.Parameter(torch.zeros(e, 2 * i, h, dtype=self.dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(e, h, i, dtype=self.dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._local_forward(x)
        return out if self.tp is None else self.tp.all_reduce_(out)  # the ranks' intermediate rows' partials

    def _local_forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        ep = self.expert_map is not None
        if self.lora is not None and self.lora.batch.experts_active:
            weights, ids = route(logits, self.top_k, self.norm_topk_prob)
            blocks = ((lambda e: self.qexperts.expert_blocks(e, x.dtype)) if self.qexperts is not None else
                      (lambda e: (self.w13[e], self.w2[e])))
            return self._add_shared(x, self.lora.forward(x, weights, self._local_ids(ids), blocks))
        if self.qexperts is not None:
            if x.is_cuda:
                from voltllm.kernels import moe_decode

                weights, ids = moe_decode.moe_route(logits, self.top_k, self.norm_topk_prob)
            else:
                weights, ids = route(logits, self.top_k, self.norm_topk_prob)
            return self._add_shared(x, self.qexperts.forward(x, weights, self._local_ids(ids), skip_foreign=ep))
        if not (x.is_cuda if self.triton_experts is None else self.triton_experts):
            weights, ids = route(logits, self.top_k, self.norm_topk_prob)
            return self._add_shared(x, fused_experts_ref(x, self.w13, self.w2, weights, self._local_ids(ids)))
        from voltllm.kernels import moe_decode
        from voltllm.kernels.moe import fused_experts

        # the router in one launch (moe_decode docstring); decode-sized batches skip the grouped GEMM's sort
        if x.shape[0] * self.top_k > moe_decode.SMALL_MAX_PAIRS:
            weights, ids = moe_decode.moe_route(logits, self.top_k, self.norm_topk_prob)
            return self._add_shared(x, fused_experts(x, self.w13, self.w2, weights, self._local_ids(ids),
                                                     skip_foreign=ep))
        shared = self._plain_shared_weights()
        if shared is not None:  # the shared expert as one more entry per token, inside the two expert launches
            weights, ids = moe_decode.moe_route(logits, self.top_k, self.norm_topk_prob, shared_gate=(x, shared[0]))
            return moe_decode.fused_experts_small(x, self.w13, self.w2, weights, self._local_ids(ids),
                                                  shared=shared[1:])
        weights, ids = moe_decode.moe_route(logits, self.top_k, self.norm_topk_prob)
        return self._add_shared(x, moe_decode.fused_experts_small(x, self.w13, self.w2, weights, self._local_ids(ids)))

    def _local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The router's global expert ids as this rank's (expert parallelism: -1 for other ranks' experts; a shared
        expert's entry, id num_experts, becomes num_local_experts); on the device, no host sync."""
        if self.expert_map is None:
            return ids
        return self.expert_map.index_select(0, ids.reshape(-1)).view(ids.shape)

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _plain_shared_weights(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(gate [1, H], gate_up [2 IS, H], down [H, IS]) of the shared expert when all three are plain
        unquantized weights without bias or LoRA slots (what the fused decode path reads; it would skip a LoRA
        term); else None."""
        if self.shared_expert is None:
            return None
        lins = (self.shared_expert_gate, self.shared_expert.gate_up_proj, self.shared_expert.down_proj)
        if any(not isinstance(lin.method, UnquantizedLinearMethod) or lin.bias is not None or lin.lora is not None
               for lin in lins):
            return None
        return tuple(lin.weight for lin in lins)

    # -- weights ---------------------------------------------------------------------------------
    def _held_experts(self) -> range:
        """The global ids of the routed experts this rank holds."""
        s = self.experts_shard
        return range(self.num_experts) if s is None else range(s.start, s.start + s.count)

    def expected_weight_keys(self, prefix: str) -> set[str]:
        keys = {f"{prefix}gate#0"}
        keys |= {f"{prefix}experts.{e}.{p}" for e in self._held_experts() for p in ("gate", "up", "down")}
        if self.shared_expert is not None:
            keys |= {f"{prefix}shared_expert.gate_up_proj#0", f"{prefix}shared_expert.gate_up_proj#1",
                     f"{prefix}shared_expert.down_proj#0", f"{prefix}shared_expert_gate#0"}
        return keys

    def load_hf_weight(self, name: str, tensor: torch.Tensor, prefix: str = "") -> list[str]:
        """`name` relative to the HF MoE block ('experts.3.up_proj.weight', 'gate.weight', ...). Packed quantized
        expert weights go to QuantExperts (quantized_experts), else are dequantized here; the shared expert's go to its
        Linears, whose method decides; the router and the shared expert's gate are always dense."""
        from voltllm.model.layers.quantized_linear import MisalignedCut, PackedWeight, dense_tensor

        m = _EXPERT.fullmatch(name)
        if m:
            e, kind = int(m.group(1)), m.group(2)[:-5]
            local = e if self.experts_shard is None else self.experts_shard.local(e)
            if local is None:  # another rank's expert (expert parallelism; the loaders skip them where they can)
                return []
            # this rank's intermediate rows of the expert (all of them without TP, and under expert parallelism)
            tensor = self._expert_part(kind, tensor, prefix + name)
        if m and self.qexperts is not None:
            try:
                self.qexperts.add(local, kind, tensor)
            except MisalignedCut:  # a rank's share of a group: refused like a dense layer's (no dense fallback)
                raise
            except ValueError as err:
                self._keep_experts_dense(err)
            return [f"{prefix}experts.{e}.{kind}"]
        i = self.inter
        if m:  # an expert held dense (the shared expert's projections keep their packed form: their Linears decide)
            if isinstance(tensor, PackedWeight):
                tensor = tensor.dequantize(torch.float32)
            dst = {"gate": self.w13[local, :i], "up": self.w13[local, i:], "down": self.w2[local]}[kind]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            return [f"{prefix}experts.{e}.{kind}"]
        if name in ("experts.gate_up_proj", "experts.down_proj"):  # stacked layout of transformers' modules
            if self.qexperts is not None:  # quantized experts expected, but a stacked dense tensor came
                self._keep_experts_dense(ValueError(f"{name} is not per-expert"))
            dst = self.w13 if name == "experts.gate_up_proj" else self.w2
            tensor = self._stacked_part(name, dense_tensor(tensor))
            dst.data.copy_(tensor)
            kinds = ("gate", "up") if dst is self.w13 else ("down",)
            return [f"{prefix}experts.{e}.{kd}" for e in self._held_experts() for kd in kinds]
        if name == "gate.weight":
            self.gate.load_weight(dense_tensor(tensor))
            return [f"{prefix}gate#0"]
        if self.shared_expert is not None:
            if name == "shared_expert_gate.weight":
                self.shared_expert_gate.load_weight(dense_tensor(tensor))
                return [f"{prefix}shared_expert_gate#0"]
            shard = {"shared_expert.gate_proj.weight": ("gate_up_proj", 0), "shared_expert.up_proj.weight":
                     ("gate_up_proj", 1), "shared_expert.down_proj.weight": ("down_proj", 0)}.get(name)
            if shard is not None:
                if self.tp is not None:  # this rank's intermediate rows: gate / up rows, down input columns
                    start, n = self.shared_start, self.shared_expert.down_proj.in_features
                    tensor = (take_cols(tensor, start, n, prefix + name) if shard[0] == "down_proj"
                              else take_rows(tensor, start, n))
                getattr(self.shared_expert, shard[0]).load_weight(tensor, shard[1])
                return [f"{prefix}shared_expert.{shard[0]}#{shard[1]}"]
        raise ValueError(f"unexpected MoE weight {name!r}")

    def shared_tp_part(self, leaf: str, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's part of a shared expert projection's whole [out, in] weight (gate_up_proj: its intermediate
        rows; down_proj: its input columns), as load_hf_weight cuts the checkpoint's (LoRA cuts its adapters so)."""
        start, n = self.shared_start, self.shared_expert.down_proj.in_features
        return take_cols(tensor, start, n, what) if leaf == "down_proj" else take_rows(tensor, start, n)

    def _expert_part(self, kind: str, tensor, what: str):
        """This rank's part of one expert's gate / up ([I, H]: rows) or down ([H, I]: input columns) projection: the
        whole of it without TP or under expert parallelism."""
        if self.tp is None or self.experts_shard is not None:
            return tensor
        if kind == "down":
            return take_cols(tensor, self.inter_start, self.inter, what)
        return take_rows(tensor, self.inter_start, self.inter)

    def _stacked_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of transformers' stacked experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) or
        experts.down_proj [E, H, I], in either orientation ([E, in, out] checkpoints: Qwen3-VL-MoE style); under
        expert parallelism its experts, whole."""
        e, h, i, s = self.num_experts, self.hidden, self.inter, self.inter_start
        full = self.full_inter
        gate_up = name == "experts.gate_up_proj"
        want = (e, 2 * full, h) if gate_up else (e, h, full)
        if tuple(tensor.shape) != want:
            if tuple(tensor.transpose(1, 2).shape) != want:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {want}")
            tensor = tensor.transpose(1, 2)
        if (shard := self.experts_shard) is not None:
            return tensor[shard.start:shard.start + shard.count]
        if self.tp is None:
            return tensor
        if gate_up:
            return torch.cat([tensor[:, s:s + i], tensor[:, full + s:full + s + i]], dim=1)
        return tensor[:, :, s:s + i]

    def _keep_experts_dense(self, why: Exception) -> None:
        """A part of the experts cannot stay quantized: allocate the dense expert weights and move what has
        arrived into them (the rest then loads dense)."""
        q, self.qexperts = self.qexperts, None
        logger.warning("MoE experts kept dense (%s)", why)
        self._allocate_dense(q.device)
        i = self.inter
        for (e, kind), w in q.dense_parts().items():
            {"gate": self.w13[e, :i], "up": self.w13[e, i:], "down": self.w2[e]}[kind].copy_(w)
