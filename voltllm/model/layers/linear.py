"""Linear layers with a pluggable weight format (the seam for NVFP4 / AWQ / FP8 / GGUF blocks).

A LinearMethod owns how weights are stored and multiplied; layers only know their shapes. Merged
layers (qkv, gate_up) hold several logical shards in one weight so one GEMM serves them all.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from voltllm.model.layers.activation import silu_and_mul


class LinearMethod:
    """Contract: create the layer's parameters, load a shard into them, and compute y = x W^T + b."""

    def create_weights(self, layer: "Linear", in_features: int, out_features: int, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def load_shard(self, layer: "Linear", tensor: torch.Tensor, offset: int, size: int) -> None:
        raise NotImplementedError

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, skinny=None,
           batch: Optional[dict] = None):
    """F.linear, or a Triton GEMM where start-up timing chose one (voltllm.worker.skinny_tuning): the skinny
    GEMM (config `skinny`) for one-row inputs, the decode-batch GEMM for the row counts in `batch`
    ({rows: config})."""
    if x.dim() == 2:
        rows = x.shape[0]
        if skinny and rows == 1:  # tuned at one row (batch-1 decode)
            from voltllm.kernels.gemv import gemv

            return gemv(x, w, bias, config=skinny)
        if batch and rows in batch:
            from voltllm.kernels.batch_gemm import batch_gemm

            return batch_gemm(x, w, bias, config=batch[rows])
    return F.linear(x, w, bias)


def down_proj_silu_mul(layer: "Linear", gate_up: torch.Tensor) -> torch.Tensor:
    """layer(silu(gate) * up) for gate_up = [gate | up]; where a Triton GEMM was chosen for this row count
    (one row: skinny GEMM; decode batches: the batch GEMM), the activation is computed inside the GEMM
    (one kernel less per MLP)."""
    if gate_up.dim() == 2:
        rows = gate_up.shape[0]
        if layer.skinny and rows == 1:
            from voltllm.kernels.gemv import gemv

            if not layer.skinny_silu_fused:  # start-up timing found the SiLU kernel + plain GEMV faster
                return gemv(silu_and_mul(gate_up), layer.weight, layer.bias, config=layer.skinny)
            return gemv(gate_up, layer.weight, layer.bias, config=layer.skinny, silu_mul=True)
        if layer.batch_gemm and rows in layer.batch_gemm:
            from voltllm.kernels.batch_gemm import batch_gemm

            if not layer.batch_silu_fused.get(rows, True):  # timed faster as SiLU kernel + plain GEMM
                return batch_gemm(silu_and_mul(gate_up), layer.weight, layer.bias, config=layer.batch_gemm[rows])
            return batch_gemm(gate_up, layer.weight, layer.bias, config=layer.batch_gemm[rows], silu_mul=True)
    return layer(silu_and_mul(gate_up))


def one_row_gated(gate_up: "Linear", x: torch.Tensor) -> bool:
    """Whether gate_up's one-row GEMM computes silu(gate) * up in its epilogue (start-up timing chose it)."""
    return bool(gate_up.skinny and gate_up.skinny_gated and x.dim() == 2 and x.shape[0] == 1)


def gated_mlp(gate_up: "Linear", down: "Linear", x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up) for the merged projection gate_up = [gate; up]: at one row with `skinny_gated`, and at
    a decode-batch row count with `batch_gated`, the gate_up GEMM writes the activation itself and the down
    projection runs plain; otherwise down_proj_silu_mul. With LoRA (`lora`) the GEMMs that would leave out a
    projection's adapter term are not taken."""
    if one_row_gated(gate_up, x) and gate_up.lora is None:
        from voltllm.kernels.gemv import gemv

        return down(gemv(x, gate_up.weight, gate_up.bias, config=gate_up.skinny, gated=True))
    if x.dim() == 2 and gate_up.batch_gated.get(x.shape[0]) and gate_up.lora is None:
        from voltllm.kernels.batch_gemm import batch_gemm

        return down(batch_gemm(x, gate_up.weight, gate_up.bias, config=gate_up.batch_gemm[x.shape[0]], gated=True))
    if down.lora is not None:  # (an activation inside down's GEMM would skip its LoRA term; gate_up(x) adds its own)
        return down(silu_and_mul(gate_up(x)))
    return down_proj_silu_mul(down, gate_up(x))


def norm_linear(layer: "Linear", residual: torch.Tensor, norm, gated: bool = False) -> torch.Tensor:
    """layer(norm(residual)) as one skinny GEMM (one row, `layer.skinny` chosen; `norm` an RMSNorm): the norm is
    folded into the GEMM (fp32, not rounded in between). The result has the layer's dtype. With gated (a
    [gate; up] weight) the result is silu(gate) * up."""
    from voltllm.kernels.gemv import gemv

    return gemv(residual, layer.weight, layer.bias, config=layer.skinny, norm=(norm.weight, norm.eps, norm.offset),
                gated=gated)


def linear_add_(layer: "Linear", x: torch.Tensor, residual: torch.Tensor, silu_mul: bool = False) -> None:
    """residual += layer(x) (layer(silu(gate) * up) with silu_mul) in place, as one skinny GEMM (one row,
    `layer.skinny` chosen): the product is added in fp32 before it is rounded to the residual's dtype."""
    from voltllm.kernels.gemv import gemv

    if silu_mul and not layer.skinny_silu_fused:
        x, silu_mul = silu_and_mul(x), False
    gemv(x, layer.weight, layer.bias, out=residual, config=layer.skinny, silu_mul=silu_mul, accumulate=True)


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer, in_features, out_features, dtype):
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def load_shard(self, layer, tensor, offset, size):
        from voltllm.model.layers.quantized_linear import dense_tensor

        tensor = dense_tensor(tensor)  # a packed quantized weight for a layer held dense: dequantized here
        if tensor.shape != (size, layer.in_features):
            raise ValueError(f"weight shard of shape {tuple(tensor.shape)}, expected {(size, layer.in_features)}")
        layer.weight.data[offset:offset + size].copy_(tensor)

    def apply(self, layer, x):
        return linear(x, layer.weight, layer.bias, layer.skinny, layer.batch_gemm)


class Linear(nn.Module):
    """y = x W^T (+ b); W is the concatenation of `shard_sizes` along the output dim. With `lora` (--enable-lora:
    voltllm.lora.layers.LoRAWeights) each token's adapter term is added after the base product, whatever the
    LinearMethod (quantized weights keep their kernels)."""

    lora = None

    def __init__(self, in_features: int, shard_sizes: Sequence[int] | int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, method: Optional[LinearMethod] = None):
        super().__init__()
        self.shard_sizes = [shard_sizes] if isinstance(shard_sizes, int) else list(shard_sizes)
        self.in_features = in_features
        self.out_features = sum(self.shard_sizes)
        self.method = method or UnquantizedLinearMethod()
        self.skinny = None  # a skinny-GEMM config, set by voltllm.worker.skinny_tuning when it measured faster
        self.batch_gemm: dict[int, tuple] = {}  # decode-batch GEMM configs by row count (same tuner)
        # its input is [gate | up] and it multiplies silu(gate) * up (down_proj_silu_mul): the tuner times that
        self.silu_mul_input = False
        # with `skinny` and silu_mul_input: the activation in the GEMV's prologue (else a SiLU kernel first)
        self.skinny_silu_fused = True
        self.batch_silu_fused: dict[int, bool] = {}  # the same choice for `batch_gemm`, by row count
        # its output [gate | up] feeds silu(gate) * up (gated_mlp): the tuner also times the gated GEMV, and with
        # `skinny_gated` the one-row GEMV writes the activation itself
        self.silu_mul_output = False
        self.skinny_gated = False
        self.batch_gated: dict[int, bool] = {}  # the same for `batch_gemm`, by row count
        self.method.create_weights(self, in_features, self.out_features, dtype)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])

    def load_weight(self, tensor: torch.Tensor, shard: int = 0) -> None:
        self.method.load_shard(self, tensor, self.shard_offset(shard), self.shard_sizes[shard])

    def load_bias(self, tensor: torch.Tensor, shard: int = 0) -> None:
        off, size = self.shard_offset(shard), self.shard_sizes[shard]
        self.bias.data[off:off + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.lora is None else self.lora.add_to(x, y)
