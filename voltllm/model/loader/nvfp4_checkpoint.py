"""NVFP4 checkpoints: 4-bit float (E2M1) weights in groups of 16 inputs, each group with an FP8 (E4M3) scale, and one
fp32 global scale per tensor. Two on-disk forms, both read weight-only (activations stay fp16 / bf16: the static
activation scales of W4A4 checkpoints are dropped, as vLLM's FP4 Marlin path does on GPUs without FP4 instructions):

- NVIDIA ModelOpt (`quant_method: modelopt`, `quant_algo: NVFP4` or `W4A16_NVFP4`, group_size 16; in config.json's
  quantization_config, or in a separate hf_quant_config.json under `quantization`; vLLM calls it `modelopt_fp4`):
  `weight` uint8 [N, K/2], `weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` fp32 scalar, `input_scale` fp32
  scalar (dropped). The global scale multiplies: w = e2m1 * e4m3 * weight_scale_2 (ModelOpt sets weight_scale_2 to
  amax / (6 * 448) and each group's scale to its amax / 6 / weight_scale_2, rounded to E4M3).
- compressed-tensors (`quant_method: compressed-tensors`, format `nvfp4-pack-quantized`: 4-bit float weights,
  strategy tensor_group, group_size 16; llm-compressor writes it): `weight_packed` uint8 [N, K/2], `weight_scale`
  float8_e4m3fn [N, K/16], `weight_global_scale` fp32 [1], `input_global_scale` (dropped). The global scale divides:
  w = e2m1 * e4m3 / weight_global_scale (it is (6 * 448) / amax). As vLLM does, its reciprocal is taken once in fp32
  and multiplies; the result may differ from a division per group by one fp32 rounding, far below fp16's precision.

In both, byte j of a row holds input 2j in its low nibble and input 2j + 1 in its high nibble. A 4-bit code is sign
(bit 3), a 2-bit exponent of bias 1 and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
(gguf_planes.e2m1_values). Here an element is e2m1 * e4m3 (exact in fp32: at most 6 significant bits) times the
global multiplier g, one rounding to fp32, then the compute dtype.

Kept quantized (on a GPU), a layer becomes planes of gguf_planes.NVFP4_KIND: the codes (4 bits), the E4M3 scale codes
(8 bits per 16 weights) and g repeated per row and 256 inputs (fp32): 4.625 bits per weight. A merged projection
whose shards have different global scales (q / k / v, gate / up) keeps each row's own, so nothing is rescaled.
Inputs that are not a multiple of 64 are dequantized at load. Layers the quantizer left out (`exclude_modules` /
`ignore`: the LM head, MoE routers) are stored as plain dense `weight`s and stay dense.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from voltllm.model.layers.gguf_planes import GROUP, NVFP4_KIND, Planes, Unpacked, dequantize_unpacked, to_planes
from voltllm.model.layers.quantized_linear import PackedWeight

MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")
CT_FORMAT = "nvfp4-pack-quantized"
# activation quantization (W4A4): not done here, weight-only
_ACTIVATION_PARTS = ("input_scale", "input_global_scale")


class NVFP4CheckpointError(ValueError):
    """A quantization_config or NVFP4 tensor this loader cannot read."""


@dataclass(frozen=True)
class NVFP4Scheme:
    producer: str  # "modelopt" | "compressed-tensors"

    @property
    def method(self) -> str:
        """The --quantization name, as vLLM spells it."""
        return "modelopt_fp4" if self.producer == "modelopt" else "compressed-tensors"

    @property
    def weight_part(self) -> str:
        return "weight" if self.producer == "modelopt" else "weight_packed"

    @property
    def global_part(self) -> str:
        return "weight_scale_2" if self.producer == "modelopt" else "weight_global_scale"

    @property
    def global_divides(self) -> bool:
        return self.producer == "compressed-tensors"


def _quantization_config(hf_config: Any) -> Optional[dict]:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def nvfp4_scheme(hf_config: Any) -> Optional[NVFP4Scheme]:
    """The checkpoint's NVFP4 scheme; None when it is neither ModelOpt nor compressed-tensors NVFP4 (other
    compressed-tensors formats: compressed_tensors_checkpoint.py). Other ModelOpt variants, and compressed-tensors
    NVFP4 groups of another shape, raise (one line naming what was found)."""
    qc = _quantization_config(hf_config)
    method = str((qc or {}).get("quant_method", "")).lower()
    if method == "modelopt":
        return _modelopt(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    return None


def _modelopt(qc: dict) -> NVFP4Scheme:
    inner = qc["quantization"] if isinstance(qc.get("quantization"), dict) else qc  # hf_quant_config.json's nesting
    algo = str(inner.get("quant_algo") or "").upper()
    if algo not in MODELOPT_ALGOS:
        raise NVFP4CheckpointError(f"ModelOpt checkpoint with quant_algo {algo or None!r}: only NVFP4 (and W4A16_NVFP4) "
                                   "weights are read")
    group = int(inner.get("group_size") or 16)
    if group != 16:
        raise NVFP4CheckpointError(f"ModelOpt NVFP4 checkpoint with group_size {group}: only groups of 16 are read")
    return NVFP4Scheme("modelopt")


def is_nvfp4_group(group: dict, top_format: Optional[str]) -> bool:
    """Whether a compressed-tensors config group holds NVFP4 weights (4-bit floats in groups of 16, nvfp4 format)."""
    fmt = group.get("format") or top_format
    w = group.get("weights") or {}
    return fmt == CT_FORMAT or (w.get("num_bits") == 4 and str(w.get("type", "")).lower() == "float")


def _compressed_tensors(qc: dict) -> Optional[NVFP4Scheme]:
    """NVFP4Scheme when every config group is NVFP4; None when none is (compressed_tensors_checkpoint.py reads the
    other formats, and refuses a mix)."""
    groups = qc.get("config_groups") or {}
    if not groups:
        raise NVFP4CheckpointError("compressed-tensors checkpoint without config_groups: not read")
    if not all(is_nvfp4_group(g, qc.get("format")) for g in groups.values()):
        return None
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        w = group.get("weights") or {}
        nvfp4 = (w.get("num_bits") == 4 and str(w.get("type", "")).lower() == "float" and w.get("group_size") == 16
                 and w.get("symmetric", True))
        if fmt != CT_FORMAT or not nvfp4:
            raise NVFP4CheckpointError(
                f"compressed-tensors checkpoint of format {fmt!r} ({name}: {w.get('num_bits')}-bit {w.get('type')} "
                f"weights, group_size {w.get('group_size')}): only NVFP4 weights ({CT_FORMAT}) are read")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise NVFP4CheckpointError(f"compressed-tensors NVFP4 checkpoint with a {key}: not read")
    return NVFP4Scheme("compressed-tensors")


@dataclass
class NVFP4Weight(PackedWeight):
    """One linear layer's NVFP4 weight: packed codes uint8 [N, K/2] (input 2j in the low nibble of byte j), E4M3
    scale codes uint8 [N, K/16] and the global multiplier g (fp32 scalar tensor)."""
    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    out_features: int = 0
    in_features: int = 0

    def __post_init__(self):
        n, half = self.packed.shape
        self.out_features, self.in_features = n, 2 * half
        if tuple(self.scale.shape) != (n, self.in_features // 16) or self.in_features % 16:
            raise NVFP4CheckpointError(f"NVFP4 weight [{n}, {self.in_features}] with scales {tuple(self.scale.shape)}, "
                                       f"expected {(n, self.in_features // 16)}")

    @classmethod
    def from_checkpoint(cls, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                        divides: bool) -> "NVFP4Weight":
        """The checkpoint's tensors; `divides`: the global scale is a divisor (compressed-tensors)."""
        if packed.dtype != torch.uint8 or scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise NVFP4CheckpointError(f"NVFP4 weight of dtype {packed.dtype} with scales of dtype {scale.dtype}: "
                                       "expected uint8 codes and float8_e4m3fn scales")
        if global_scale.numel() != 1:
            raise NVFP4CheckpointError(f"NVFP4 global scale of shape {tuple(global_scale.shape)}: expected one value")
        g = global_scale.reshape(()).to(torch.float32)
        return cls(packed, scale.view(torch.uint8), torch.reciprocal(g) if divides else g)

    def unpack(self, device: Optional[torch.device] = None) -> Unpacked:
        """Codes uint8 [N, K] in input order, the global scale per row and 256 inputs (`d`) and the scale codes
        (`sc`, int8 bits), on `device`."""
        packed = self.packed.to(device)
        n, k = self.out_features, self.in_features
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(n, k)
        d = self.global_scale.to(device).expand(n, -(-k // NVFP4_KIND.super)).contiguous()
        return Unpacked(codes=codes, d=d, m=None, sc=self.scale.to(device).view(torch.int8), mn=None)

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        """Planes of NVFP4_KIND on `device`; the dequantized matrix where the planes cannot hold it (inputs not a
        multiple of 64)."""
        if self.in_features % GROUP:
            return self.dequantize(torch.float32, device).to(dtype)
        return to_planes(self.unpack(device), NVFP4_KIND)

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        """e2m1 * e4m3 * g [N, K], rounded once to fp32 (the planes' own reference), cast to dtype."""
        return dequantize_unpacked(self.unpack(device), NVFP4_KIND).to(dtype)


def nvfp4_weights(stream: Iterable[tuple[str, torch.Tensor]], scheme: NVFP4Scheme,
                  keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) stream with each NVFP4 layer's codes, scales and global scale gathered into one
    `<layer>.weight`: an NVFP4Weight (keep_quantized) or its dequantized fp32 matrix. Activation scales are dropped;
    other tensors (dense layers, norms, KV-cache scales) pass through."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in stream:
        prefix, _, part = name.rpartition(".")
        if part in _ACTIVATION_PARTS:
            continue
        if part == "pre_quant_scale":  # ModelOpt's AWQ / SmoothQuant input scaling: the activations would need it
            raise NVFP4CheckpointError(f"NVFP4 layer {prefix!r} has a pre_quant_scale (activation smoothing): not read")
        if ((part == scheme.weight_part and t.dtype == torch.uint8) or part == scheme.global_part
                or (part == "weight_scale" and t.dtype == torch.float8_e4m3fn)):
            parts = held.setdefault(prefix, {})
            parts[part] = t
            if len(parts) == 3:
                del held[prefix]
                w = NVFP4Weight.from_checkpoint(parts[scheme.weight_part], parts["weight_scale"],
                                                parts[scheme.global_part], scheme.global_divides)
                yield f"{prefix}.weight", w if keep_quantized else w.dequantize(torch.float32)
        else:
            yield name, t
    if held:
        prefix, parts = next(iter(held.items()))
        raise NVFP4CheckpointError(f"NVFP4 layer {prefix!r} is incomplete in the checkpoint (has "
                                   f"{', '.join(sorted(parts))})")


def dense_bytes(path: str, itemsize: int) -> int:
    """Bytes of the checkpoint's weights once dequantized to elements of `itemsize` bytes (from the safetensors
    headers: a packed byte is 2 weights of a layer that has a global scale; scales disappear)."""
    from voltllm.model.loader.safetensors_loader import stored_elements

    quantized: set[str] = set()

    def find(name: str, n: int) -> int:
        prefix, _, part = name.rpartition(".")
        if part in ("weight_scale_2", "weight_global_scale"):
            quantized.add(prefix)
        return 0

    stored_elements(path, find)

    def dense(name: str, n: int) -> int:
        prefix, _, part = name.rpartition(".")
        if part in ("weight_scale", "weight_scale_2", "weight_global_scale", *_ACTIVATION_PARTS):
            return 0
        return 2 * n if prefix in quantized and part in ("weight", "weight_packed") else n

    return itemsize * stored_elements(path, dense)
