"""FP8 (E4M3) weights: checkpoints with `quant_method: fp8`, and unquantized checkpoints quantized at load with
`--quantization fp8`.

- Block-wise checkpoints (Qwen's *-FP8 releases, `weight_block_size: [128, 128]`): each linear layer stores
  `weight` as float8_e4m3fn [N, K] and `weight_scale_inv` fp32 [ceil(N / 128), ceil(K / 128)]; despite its name
  the scale multiplies: w = e4m3 * scale of the weight's 128 x 128 block.
- Per-tensor / per-channel checkpoints (other tools): `weight_scale` of one value or one per output row;
  `input_scale` (a static activation scale) is dropped: activations stay in the compute dtype here (weight-only
  FP8, like the Marlin path vLLM takes on GPUs without FP8 instructions).
- `--quantization fp8` on an unquantized llama / qwen2 / qwen3 checkpoint quantizes each projection at load with
  one scale per row and 128 inputs (amax / 448), the finest the planes hold at no cost.

Kept quantized (on a GPU), a layer becomes planes of gguf_planes.FP8_KIND (8-bit codes, an fp32 scale per row and
128 inputs: 8.25 bits per weight) and runs the dequant-GEMM with a software E4M3 decode (no FP8 instructions, so
SM70 too). Dequantized (the CPU, models that fit, architectures without quantized layers), the layer gets
e4m3 * scale in fp32, then the compute dtype.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from voltllm.model.layers.gguf_planes import FP8_KIND, Planes, Unpacked, to_planes
from voltllm.model.layers.quantized_linear import PackedWeight, log_dense_at_load

FP8_MAX = 448.0
_SCALE_PARTS = ("weight_scale_inv", "weight_scale")
# the projections `--quantization fp8` quantizes at load, MoE experts included (embeddings, the LM head, norms and
# the router stay as they are)
_PROJECTION = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


class FP8CheckpointError(ValueError):
    """A quantization_config or FP8 tensor this loader cannot read."""


@dataclass(frozen=True)
class FP8Scheme:
    block: Optional[tuple[int, int]]  # weight_block_size (rows, inputs); None: per-tensor / per-channel scales
    at_load: bool = False  # an unquantized checkpoint quantized while it loads (--quantization fp8)


def fp8_scheme(hf_config: Any, quantization: Optional[str] = None) -> Optional[FP8Scheme]:
    """The checkpoint's FP8 scheme, or FP8Scheme(at_load=True) for `--quantization fp8` on an unquantized one; None
    otherwise. Variants not read here raise."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return FP8Scheme((1, 128), at_load=True) if quantization == "fp8" else None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if str(qc.get("quant_method", "")).lower() != "fp8":
        return None
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise FP8CheckpointError(f"FP8 checkpoint of format {fmt!r}: only E4M3 weights are read")
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise FP8CheckpointError(f"FP8 checkpoint with weight_block_size {block!r}: expected [rows, inputs]")
    return FP8Scheme(tuple(int(b) for b in block) if block else None)


@dataclass
class FP8Weight(PackedWeight):
    """One linear layer's E4M3 weight: codes uint8 [N, K] and fp32 scales [ceil(N / block[0]), ceil(K / block[1])]
    (a per-tensor scale: block (N, K); per-channel: (1, K))."""
    codes: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    out_features: int = 0
    in_features: int = 0

    def __post_init__(self):
        self.out_features, self.in_features = self.codes.shape
        n, k = self.codes.shape
        want = (-(-n // self.block[0]), -(-k // self.block[1]))
        if tuple(self.scale.shape) != want:
            raise FP8CheckpointError(f"FP8 weight [{n}, {k}] with scales {tuple(self.scale.shape)}, expected {want} "
                                     f"for blocks of {self.block}")

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]]):
        n, k = weight.shape
        scale = scale.to(torch.float32)
        if block is None:  # per-tensor (one value) or per-channel (one per row)
            block = (n, k) if scale.numel() == 1 else (1, k)
            scale = scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(n, 1)
        return cls(weight.view(torch.uint8), scale, tuple(block))

    @classmethod
    def quantize(cls, w: torch.Tensor, block_inputs: int = FP8_KIND.super) -> "FP8Weight":
        """E4M3 codes of w [N, K] with one scale per row and `block_inputs` inputs (amax / 448; all-zero blocks get
        scale 1), rounded to nearest even by torch's conversion."""
        n, k = w.shape
        pad = -k % block_inputs
        wf = torch.nn.functional.pad(w.to(torch.float32), (0, pad)).reshape(n, -1, block_inputs)
        scale = wf.abs().amax(-1) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (wf / scale[..., None]).to(torch.float8_e4m3fn).reshape(n, -1)[:, :k]
        return cls(codes.view(torch.uint8).contiguous(), scale, (1, block_inputs))

    def _expanded_scale(self, cols: int, per: int) -> torch.Tensor:
        """Scales repeated to [N, cols], each column covering `per` inputs."""
        bn, bk = self.block
        s = self.scale.repeat_interleave(bn, dim=0)[: self.out_features]
        return s.repeat_interleave(bk // per, dim=1)[:, :cols]

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        """Planes of FP8_KIND on `device`; the dequantized matrix where the planes cannot hold the layout (inputs
        not a multiple of 128, scale blocks of inputs not a multiple of 128)."""
        per, k = FP8_KIND.super, self.in_features
        if k % per or self.block[1] % per:  # (per-tensor / per-channel blocks span the row: k)
            log_dense_at_load(f"FP8 layers whose inputs or scale blocks are not a multiple of {per}")
            return self.dequantize(torch.float32, device).to(dtype)
        codes = self.codes.to(device)
        d = self._expanded_scale(k // per, per).to(device).contiguous()
        return to_planes(Unpacked(codes=codes, d=d, m=None, sc=None, mn=None), FP8_KIND)

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        """e4m3 * scale [N, K] in fp32 (one rounding), cast to dtype."""
        codes = self.codes.to(device).view(torch.float8_e4m3fn).to(torch.float32)
        return (codes * self._expanded_scale(self.in_features, 1).to(codes.device)).to(dtype)


@dataclass
class QuantizeAtLoad(PackedWeight):
    """An unquantized projection that `--quantization fp8` quantizes on the device it goes to (the GPU's
    arithmetic, not the host's: an 8B model is 16 GB of weights to scan)."""
    weight: torch.Tensor

    def __post_init__(self):
        self.out_features, self.in_features = self.weight.shape

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        return FP8Weight.quantize(self.weight.to(device)).to_weight(device, dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        return FP8Weight.quantize(self.weight.to(device)).dequantize(dtype, device)

    def cut(self, dim: int, start: int, n: int, what: str = "") -> "QuantizeAtLoad":
        """A tensor-parallel shard: the unquantized rows / columns, quantized when they load (the same scales as the
        whole weight's where the columns start on a 128-input block)."""
        from voltllm.distributed.sharding import take_cols, take_rows

        return QuantizeAtLoad(take_rows(self.weight, start, n) if dim == 0 else take_cols(self.weight, start, n))


def fp8_weights(stream: Iterable[tuple[str, torch.Tensor]], scheme: FP8Scheme,
                keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) stream with each FP8 layer's weight and scale gathered into one
    `<layer>.weight`: an FP8Weight (keep_quantized) or its dequantized fp32 matrix. With scheme.at_load, the
    projections of an unquantized checkpoint are quantized first. Other tensors pass through; `input_scale`s
    are dropped."""
    if scheme.at_load:
        for name, t in stream:
            if _PROJECTION.fullmatch(name) and t.dim() == 2 and t.is_floating_point():
                w = QuantizeAtLoad(t)
                yield name, w if keep_quantized else w.dequantize(torch.float32)
            else:
                yield name, t
        return
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in stream:
        prefix, _, part = name.rpartition(".")
        if part == "input_scale":
            continue
        if part == "weight" and t.dtype == torch.float8_e4m3fn:
            held.setdefault(prefix, {})["weight"] = t
        elif part in _SCALE_PARTS:
            held.setdefault(prefix, {})["scale"] = t
        else:
            yield name, t
            continue
        parts = held[prefix]
        if len(parts) == 2:
            del held[prefix]
            w = FP8Weight.from_checkpoint(parts["weight"], parts["scale"], scheme.block)
            yield f"{prefix}.weight", w if keep_quantized else w.dequantize(torch.float32)
    if held:
        prefix, parts = next(iter(held.items()))
        raise FP8CheckpointError(f"FP8 layer {prefix!r} is incomplete in the checkpoint (has {', '.join(parts)})")


def dense_bytes(path: str, itemsize: int) -> int:
    """Bytes of the checkpoint's weights once dequantized to elements of `itemsize` bytes (scales disappear)."""
    from voltllm.model.loader.safetensors_loader import stored_elements

    skip = (*_SCALE_PARTS, "input_scale")
    return itemsize * stored_elements(path, lambda name, n: 0 if name.rpartition(".")[2] in skip else n)
