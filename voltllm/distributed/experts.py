"""Expert parallelism under tensor parallelism (--enable-expert-parallel, vLLM's -ep): which routed experts a rank
holds, whole.

vLLM's "linear" placement: the E routed experts are dealt out as contiguous runs of E // N, the first E % N ranks one
more (E = 6 over N = 4: experts 0-1, 2-3, 4, 5). A rank's expert map turns the router's global ids into its local
ones: [0, count) for its own experts, -1 for the others' (vLLM's sentinel too); the layers keep the map on the device,
so the step never asks the host which pairs are local. Attention, dense MLPs and a shared expert stay
tensor-parallel; the routed experts' outputs are partial sums of the layer's, added by the layer's one all-reduce as
before (no token exchange).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

# a routed expert's checkpoint tensors (per-expert layouts: HF safetensors, every quantized format, GGUF's per-expert
# names as gguf_loader yields them)
_EXPERT_TENSOR = re.compile(r"\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ExpertShard:
    """Rank's routed experts: global ids [start, start + count) of num_experts."""

    num_experts: int
    start: int
    count: int

    @classmethod
    def of(cls, num_experts: int, rank: int, size: int) -> "ExpertShard":
        base, extra = divmod(num_experts, size)
        return cls(num_experts, rank * base + min(rank, extra), base + (rank < extra))

    def local(self, expert: int) -> Optional[int]:
        """The local id of global expert `expert`, None when another rank holds it."""
        i = expert - self.start
        return i if 0 <= i < self.count else None

    def expert_map(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """int32 [num_experts + 1]: global id -> local id, -1 for other ranks' experts. The last entry is the shared
        expert's id in moe_decode.moe_route(shared_gate=...) (num_experts), mapped to count: the id
        fused_experts_small reads as the shared expert over this rank's stacked experts."""
        m = torch.full((self.num_experts + 1,), -1, dtype=torch.int32, device=device)
        m[self.start:self.start + self.count] = torch.arange(self.count, dtype=torch.int32, device=device)
        m[self.num_experts] = self.count
        return m

    def reads(self, name: str) -> bool:
        """Whether this rank reads checkpoint tensor `name`: all but the other ranks' routed experts' tensors."""
        m = _EXPERT_TENSOR.search(name)
        return m is None or self.local(int(m.group(1))) is not None


def expert_shard(num_experts: int, tp: Any) -> Optional[ExpertShard]:
    """This rank's experts when its tensor-parallel group places whole experts (tp.expert_parallel, set by the runner
    from ParallelConfig.enable_expert_parallel); None without expert parallelism (every rank holds every expert's
    share of rows)."""
    if tp is None or not getattr(tp, "expert_parallel", False):
        return None
    return ExpertShard.of(num_experts, tp.rank, tp.size)


def model_num_experts(hf_config: Any) -> int:
    """The routed experts per MoE layer of a (multimodal or text) config; 0 for a dense model."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    return int(getattr(cfg, "num_experts", 0) or 0)
