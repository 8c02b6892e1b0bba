"""The routed experts of a sparse MoE layer kept quantized (AWQ / GPTQ / FP8 / NVFP4 checkpoints and qwen3moe GGUF
files of qwen3_moe models kept quantized on the GPU): a Qwen3-30B-A3B holds 29 B of its 30.5 B parameters in experts,
61 GB in fp16 and about 16 GB at 4 bits, so only this way does it fit one 32 GB V100.

Each expert's gate, up and down projections arrive as quantized_linear.PackedWeight and become planes; once a
layer has all of them they are stacked by expert into two Planes: w13 [E * 2I, H] (expert e's gate rows then up
rows) and w2 [E * H, I]. A forward:
- on CUDA, up to PAIR_LAUNCH_MAX_TOKENS tokens: one dequant-GEMM launch per projection over the (token, expert)
  pairs (kernels/quant_gemv.quant_moe_matmul: each pair's program reads its expert's block with FMAs);
- on CUDA, more tokens (while a CUDA graph captures, or while the experts' average rows stay within the grouped
  kernel's limit, kernels/quant_dot.grouped_max_rows): the pairs sorted by expert on the device (kernels/moe.moe_align)
  and one grouped tiled dequant-GEMM launch per projection (kernels/quant_dot.quant_moe_dot): each active expert's
  blocks are read once for all its tokens, at their quantized size;
- otherwise (long prompts on GPUs whose `tl.dot` has no tensor cores, the CPU): the pairs sorted by expert and, per
  expert that received tokens, its blocks dequantized (the Triton kernel on CUDA, the torch reference elsewhere)
  and multiplied by cuBLAS / torch.
The first two need no host sync, so CUDA graphs capture them.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from voltllm.model.layer_placement import execution_device
from voltllm.model.layers.activation import silu_and_mul
from voltllm.model.layers.gguf_planes import Planes, concat_rows, row_band
from voltllm.model.layers.quantized_linear import PackedWeight, dequantized

# tokens up to which a CUDA forward takes the per-pair launches (each pair reads its expert's blocks, one FMA row per
# weight: with a few tokens the pairs' experts hardly repeat; beyond, the grouped kernel reads each expert once). H200,
# one 30B-A3B layer at 4 bits: 16 tokens 0.37 ms per pair vs 0.42 grouped, 32 tokens 0.73 vs 0.57 (session 25)
PAIR_LAUNCH_MAX_TOKENS = 16


class QuantExperts:
    """Quantized routed experts of one SparseMoE layer (see the module docstring)."""

    def __init__(self, num_experts: int, inter: int, hidden: int, device: torch.device, dtype: torch.dtype,
                 tiles: Optional[dict] = None, grouped_rows: Optional[int] = None):
        """tiles: the grouped kernel's configs by average rows per expert (kernels/quant_dot.moe_table; None:
        DOT_CONFIGS); grouped_rows: its limit (quant_dot.grouped_max_rows; None: the device's own)."""
        self.num_experts, self.inter, self.hidden = num_experts, inter, hidden
        self.tiles = tiles
        self.device, self.dtype = device, dtype
        self.parts: dict[tuple[int, str], Union[Planes, torch.Tensor]] = {}
        self.w13: Optional[Planes] = None
        self.w2: Optional[Planes] = None
        # rows per expert up to which the grouped tiled kernel beats dequantize + cuBLAS (0 off the GPU)
        self.grouped_max_rows = 0
        # (the GPU it runs on: a layer built in CPU memory for weight offloading runs there too, layer_placement.py)
        run_on = device if device.type == "cuda" else execution_device()
        if run_on.type == "cuda":
            from voltllm.kernels.quant_dot import grouped_max_rows

            self.grouped_max_rows = (grouped_rows if grouped_rows is not None
                                     else grouped_max_rows(torch.cuda.get_device_capability(run_on)))

    @property
    def ready(self) -> bool:
        return self.w13 is not None

    def add(self, expert: int, kind: str, weight: Union[PackedWeight, torch.Tensor]) -> bool:
        """Take one projection ("gate" / "up" / "down"); True once the layer's experts are all stacked as planes,
        False while parts are missing. Raises ValueError when a part cannot be kept quantized (a dense tensor, a
        layout the planes do not hold, kinds that differ): the caller then keeps the experts dense."""
        want = (self.hidden, self.inter) if kind == "down" else (self.inter, self.hidden)
        shape = ((weight.out_features, weight.in_features) if isinstance(weight, PackedWeight)
                 else tuple(weight.shape))
        if shape != want:
            raise ValueError(f"expert {expert} {kind}_proj of shape {shape}, expected {want}")
        w = weight.to_weight(self.device, self.dtype) if isinstance(weight, PackedWeight) else weight
        self.parts[(expert, kind)] = w
        if not isinstance(w, Planes):
            raise ValueError(f"expert {expert} {kind}_proj is not held as planes")
        if len(self.parts) < 3 * self.num_experts:
            return False
        for group in (("gate", "up"), ("down",)):  # each stacked weight holds one kind (GGUF: down may differ)
            kinds = {p.kind for (_, k), p in self.parts.items() if k in group}
            if len(kinds) != 1:
                raise ValueError(f"experts' {'/'.join(group)} projections of mixed kinds "
                                 f"{sorted(k.name for k in kinds)}")
        e = range(self.num_experts)
        self.w13 = concat_rows([self.parts[(i, k)] for i in e for k in ("gate", "up")])
        self.w2 = concat_rows([self.parts[(i, "down")] for i in e])
        self.parts.clear()
        return True

    def dense_parts(self) -> dict[tuple[int, str], torch.Tensor]:
        """The parts received so far as dense fp32 matrices (to keep the experts dense after all)."""
        from voltllm.model.layers.gguf_planes import dequantize_planes

        return {key: dequantize_planes(w) if isinstance(w, Planes) else w.float() for key, w in self.parts.items()}

    @property
    def nbytes(self) -> int:
        return (self.w13.nbytes + self.w2.nbytes) if self.ready else 0

    def expert_blocks(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) dequantized to dtype."""
        i2, h = 2 * self.inter, self.hidden
        return dequantized(row_band(self.w13, e * i2, (e + 1) * i2), dtype), \
            dequantized(row_band(self.w2, e * h, (e + 1) * h), dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                skip_foreign: bool = False) -> torch.Tensor:
        """x [T, H]; weights / ids [T, k] (the router's) -> sum_j weights_j * expert_{ids_j}(x), [T, H].
        skip_foreign (expert parallelism): ids are this rank's local ones, -1 for experts other ranks hold, whose
        pairs add zero."""
        t, k = ids.shape
        pairs = t * k
        if not self.ready:
            raise RuntimeError("quantized MoE experts used before all of them were loaded")
        if x.is_cuda and t <= PAIR_LAUNCH_MAX_TOKENS:
            return self._pair_launches(x, weights, ids)  # (an expert -1 gives a zero row there)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if x.is_cuda and (capturing or pairs <= self.grouped_max_rows * self.num_experts):
            return self._grouped(x, weights, ids, skip_foreign=skip_foreign)
        from voltllm.model.layers.moe import sorted_experts

        return sorted_experts(x, weights, ids, self.num_experts, lambda e: self.expert_blocks(e, x.dtype))

    def _pair_launches(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from voltllm.kernels.quant_gemv import quant_moe_matmul

        t, k = ids.shape
        experts = ids.reshape(-1).to(torch.int32)
        rows = torch.arange(t, device=x.device, dtype=torch.int32).repeat_interleave(k)
        act = silu_and_mul(quant_moe_matmul(x, self.w13, 2 * self.inter, rows, experts))
        pair_rows = torch.arange(t * k, device=x.device, dtype=torch.int32)
        y = quant_moe_matmul(act, self.w2, self.hidden, pair_rows, experts)
        return (y.view(t, k, -1) * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 tile: Optional[tuple] = None, skip_foreign: bool = False) -> torch.Tensor:
        """tile: quant_moe_dot's (BLOCK_N, U, num_warps, num_stages[, W_FIRST]) for both projections (default: the
        row class's in self.tiles). skip_foreign: as forward's (other ranks' pairs are left out of the sort, as id E,
        and their output rows stay zero)."""
        from voltllm.kernels.moe import moe_align
        from voltllm.kernels.quant_dot import pick_config, quant_moe_dot

        t, k = ids.shape
        pairs = t * k
        config = pick_config(-(-pairs // self.num_experts), self.tiles)  # a row block ~ the pairs of an active expert
        block_m, tile = config[0], tile or config[1:]
        if skip_foreign:  # (the gate_up rows of those pairs are never read)
            ids = torch.where(ids < 0, self.num_experts, ids)
        order = moe_align(ids, self.num_experts, block_m)
        act = silu_and_mul(quant_moe_dot(x, self.w13, 2 * self.inter, *order, pairs, k, block_m, tile=tile))
        y = quant_moe_dot(act, self.w2, self.hidden, *order, pairs, 1, block_m,
                          row_weights=weights.reshape(-1).to(torch.float32).contiguous(), tile=tile,
                          skip_foreign=skip_foreign)
        return y.view(t, k, -1).sum(dim=1)
