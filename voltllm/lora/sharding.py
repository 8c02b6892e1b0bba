"""An adapter's part on one tensor-parallel rank: its matrices cut the way their projection's base weight is.

- Column-parallel (qkv_proj, gate_up_proj: a rank holds some output rows of each shard; q / k / v and gate / up each
  their own slice, a KV head replicated on the ranks that share it when there are fewer KV heads than ranks): A
  [r, in] stays whole, B [n, r] gives the same rows as the base weight. The rank's x A^T B_rows^T is exactly its rows
  of the whole term.
- Row-parallel (o_proj, down_proj: a rank holds a band of the inputs and its partial product is summed by the
  all-reduce after the projection): A gives the same input columns, B stays whole. Each rank's x_band A_band^T is a
  partial sum of x A^T, and B is linear, so the ranks' x_band A_band^T B^T, added into their partial outputs before
  that all-reduce, sum to x A^T B^T exactly once. (All-reducing the rank-r product x A^T instead would add a
  collective per projection, and its B product added on every rank before the existing all-reduce would count N
  times.)

The cut is the model's own (`tp_part`, the one that cuts the checkpoint), so adapter and base slices cannot drift
apart. Which matrix is cut follows from the shapes: where a rank's Linear has fewer inputs than the whole projection,
A's columns; where a shard has fewer outputs, B's rows (a replicated KV head is a whole shard: nothing to cut).
- MoE experts (lora/experts.py): cut by their layer's own cut of the experts, the same rule (gate / up column-parallel,
  down row-parallel over the intermediate band; whole experts of its own under expert parallelism). A shared expert's
  projections are Linears, cut as above by the layer's shared_tp_part.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from voltllm.lora.adapter import LoRAAdapter
from voltllm.lora.layers import LoRAWeights

# the model's cut of a checkpoint weight: (Linear's name, "weight", shard, [out, in] tensor) -> this rank's part
Split = Callable[[str, str, int, torch.Tensor], torch.Tensor]


def shard_adapter(adapter: LoRAAdapter, split: Split, weights: dict[str, LoRAWeights],
                  expert_weights: Optional[dict[str, Any]] = None) -> LoRAAdapter:
    """`adapter` (read whole: per Linear, per shard, A [r, in] and B^T scaled [r, n]) cut to this rank's Linears
    (`weights`: the LoRA slots of each, at the rank's shapes) and MoE layers (`expert_weights`: their experts' slots,
    lora/experts.py, which cut as their layer cuts its experts)."""
    out: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for linear, shards in adapter.weights.items():
        w = weights[linear]
        cut = {}
        for s, (a, bt) in shards.items():
            if a.shape[1] != w.in_features:  # row-parallel: this rank's band of the inputs
                a = split(linear, "weight", s, a).contiguous()
            if bt.shape[1] != w.shard_sizes[s]:  # column-parallel: this rank's output rows of the shard
                bt = split(linear, "weight", s, bt.t()).t().contiguous()
            if (a.shape[1], bt.shape[1]) != (w.in_features, w.shard_sizes[s]):
                raise RuntimeError(f"LoRA adapter {adapter.name!r}: {linear} shard {s} cut to A {tuple(a.shape)} and "
                                   f"B^T {tuple(bt.shape)}, but this rank's projection has {w.in_features} inputs "
                                   f"and {w.shard_sizes[s]} outputs")
            cut[s] = (a, bt)
        out[linear] = cut
    experts = {name: expert_weights[name].cut(pairs, f"{name} (LoRA {adapter.name!r})")
               for name, pairs in adapter.experts.items()}
    return LoRAAdapter(adapter.name, adapter.path, adapter.rank, adapter.scaling, out, experts, adapter.has_experts)
