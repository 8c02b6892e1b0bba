"""An adapter's part on one pipeline stage (voltllm.distributed.pipeline): the matrices of the decoder layers this
rank holds, renamed from the checkpoint's global layer indices to the model's local ones ("layers.12.x" ->
"layers.2.x" on a rank that starts at layer 10), those of other ranks' layers left out.

Adapters are read and checked whole (against the whole model's projections, so a bad adapter is refused the same on
every rank); only then is a rank's part taken.
"""
from __future__ import annotations

from typing import Any, Optional, TypeVar

from voltllm.lora.adapter import LoRAAdapter

V = TypeVar("V")


def stage_projections(shapes: dict[str, V], stage: Optional[Any]) -> dict[str, V]:
    """The LoRA-taking Linears ({"layers.{i}.self_attn.qkv_proj": ...}, global indices) this stage holds, under
    their local names (all of them, unchanged, without pipeline parallelism)."""
    if stage is None:
        return dict(shapes)
    out = {}
    for name, value in shapes.items():
        local = stage.local(name)
        if local is not None:
            out[local] = value
    return out


def stage_adapter(adapter: LoRAAdapter, stage: Any) -> LoRAAdapter:
    """`adapter` (read whole, keyed by global Linear names) reduced to this stage's Linears and MoE layers' experts,
    under local names (has_experts stays the whole adapter's: every stage runs its steps eagerly alike)."""
    return LoRAAdapter(adapter.name, adapter.path, adapter.rank, adapter.scaling,
                       stage_projections(adapter.weights, stage), stage_projections(adapter.experts, stage),
                       adapter.has_experts)
