"""4-bit AWQ and 4- / 8-bit GPTQ checkpoints: Hugging Face directories whose config.json carries a
`quantization_config`.

Each quantized linear layer stores `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`) instead of `weight`; the
element at output n, input k is (q - zero) * scale of its group of `group_size` inputs. The two formats pack the
4-bit values differently:
- AWQ (AutoAWQ's GEMM version): qweight int32 [K, N/8], qzeros int32 [K/G, N/8]: word j of a row holds columns
  8j .. 8j + 7, column 8j + AWQ_ORDER[i] in bits 4i .. 4i + 3; scales [K/G, N].
- GPTQ: qweight int32 [K/8, N], packed along the inputs (bits 4i of row r: input 8r + i); qzeros int32 [K/G, N/8],
  packed along the outputs in order; scales [K/G, N]; g_idx [K], each input's group (act-order checkpoints
  permute it). The original format ("gptq", v1) stores zero - 1; "gptq_v2" stores the zero itself.
- GPTQ 8-bit (`"bits": 8`, e.g. Qwen's *-GPTQ-Int8): the same with 4 codes per word: qweight int32 [K/4, N] (bits 8i
  of row r: input 4r + i), qzeros int32 [K/G, N/4] (bits 8i of word j: output 4j + i); symmetric checkpoints' zero
  is 128 (v1 stores 127). As for 4 bits, a zero is the stored field plus the v1 offset (no wrap: a v1 field of 255
  reads 256, as vLLM's GPTQ kernels read it).

- compressed-tensors' `pack-quantized` int4 layers (read by compressed_tensors_checkpoint.py, which builds the
  Int4Weight): weight_packed int32 [N, ceil(K/8)], packed along the inputs (bits 4i of word j: input 8j + i), each
  code stored as q + 8 (q signed in [-8, 7]); weight_scale [N, K/G]; asymmetric layers' weight_zero_point int32
  [ceil(N/8), K/G], packed along the outputs (bits 4i of word j: output 8j + i), stored as zero + 8 too, so
  (code - stored zero) = q - zero; weight_g_idx [K] for act-order ("group") layers.

`int4_weights` turns the checkpoint's tensor stream into one item per layer: an `Int4Weight` (kept quantized: it
becomes gguf_planes.Planes of an int4 kind, or of an int8 kind for 8-bit GPTQ, on the device,
model/layers/quantized_linear.py) or the dequantized matrix
(the CPU, small models, architectures without quantized layers). Scales are kept in their stored dtype: the planes
hold fp16 scales, so a layer whose scales fp16 cannot hold exactly (bf16 / fp32 values outside fp16's range or
precision) is dequantized at load instead (never rounded); so is an 8-bit layer with a zero of 256 (the int8 zero
plane holds zero - 128).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from voltllm.model.layers.quantized_linear import PackedWeight, log_dense_at_load
from voltllm.model.layers.gguf_planes import GROUP, Planes, int4_kind, int8_kind, to_planes, Unpacked

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing order within a 32-bit word
_AWQ_UNPACK = tuple(AWQ_ORDER.index(c) for c in range(8))  # the nibble holding column c
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
METHODS = ("awq", "gptq")  # quant_method values read here
GPTQ_BITS = (4, 8)  # GPTQ weight widths read (AWQ: 4)
CT = "compressed-tensors"  # Int4Scheme.method of compressed-tensors' pack-quantized int4 layers


class Int4CheckpointError(ValueError):
    """A quantization_config or quantized tensor this loader cannot read."""


@dataclass(frozen=True)
class Int4Scheme:
    method: str  # "awq" | "gptq" | CT
    group_size: int  # inputs per scale; -1: one group per row
    desc_act: bool  # GPTQ act-order: g_idx permutes the groups
    zero_offset: int  # added to a stored zero point (GPTQ v1 stores zero - 1)
    bits: int = 4  # code width: 4, or 8 (GPTQ only)

    @property
    def per_word(self) -> int:
        """Codes per packed int32 word."""
        return 32 // self.bits

    def group(self, in_features: int) -> int:
        return in_features if self.group_size in (-1, 0) else self.group_size


def quantization_method(hf_config: Any) -> Optional[str]:
    """The checkpoint's `quantization_config.quant_method` (lower case), or None for an unquantized one."""
    qc = _quantization_config(hf_config)
    if qc is None:
        return None
    return str(qc.get("quant_method", "unknown")).lower()


def _quantization_config(hf_config: Any) -> Optional[dict]:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def int4_scheme(hf_config: Any) -> Optional[Int4Scheme]:
    """The checkpoint's AWQ (4-bit) / GPTQ (4- or 8-bit) scheme; None when it is neither. Variants not read here
    raise."""
    qc = _quantization_config(hf_config)
    method = quantization_method(hf_config)
    if method not in METHODS:
        return None
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits not in (GPTQ_BITS if method == "gptq" else (4,)):
        raise Int4CheckpointError(f"{method} checkpoint with {bits}-bit weights: read are 4-bit AWQ and 4- or 8-bit "
                                  "GPTQ checkpoints")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise Int4CheckpointError(f"AWQ checkpoint of version {version!r}: only AutoAWQ's GEMM packing is read")
        if not qc.get("zero_point", True):
            raise Int4CheckpointError("AWQ checkpoint without zero points: not read (AutoAWQ writes them by default)")
        return Int4Scheme("awq", group, desc_act=False, zero_offset=0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise Int4CheckpointError(f"GPTQ checkpoint format {fmt!r}: only gptq and gptq_v2 are read")
    return Int4Scheme("gptq", group, desc_act=bool(qc.get("desc_act", False)),
                      zero_offset=1 if fmt == "gptq" else 0, bits=bits)


def fp16_exact(t: torch.Tensor) -> bool:
    """Whether fp16 holds every value of the float tensor t exactly (the planes' scales are fp16)."""
    h = t.to(torch.float16)
    return bool(torch.isfinite(h).all()) and torch.equal(h.to(t.dtype), t)


def _nibbles(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 32 / bits]: field i of each word (bits `bits` i .. `bits` (i + 1) - 1)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return ((words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def _columns_packed(words: torch.Tensor, method: str, bits: int = 4) -> torch.Tensor:
    """int32 [R, C / (32 / bits)] packed along the columns -> uint8 [R, C] in column order."""
    nib = _nibbles(words, bits)
    if method == "awq":
        nib = nib[..., list(_AWQ_UNPACK)]
    return nib.reshape(words.shape[0], -1)


@dataclass
class Int4Weight(PackedWeight):
    """One linear layer's 4-bit (or 8-bit GPTQ) weight as the checkpoint stores it (CPU tensors until `to_weight`). CT
    layers give in_features (their weight_shape: the packed words may pad a row); the others' shapes follow from
    qweight."""
    scheme: Int4Scheme
    qweight: torch.Tensor
    qzeros: Optional[torch.Tensor]  # None: a symmetric CT layer (the fixed zero 8)
    scales: torch.Tensor
    g_idx: Optional[torch.Tensor]
    out_features: int = 0
    in_features: int = 0

    def __post_init__(self):
        method = self.scheme.method
        if method == "awq":
            self.in_features, self.out_features = self.qweight.shape[0], self.qweight.shape[1] * 8
        elif method == "gptq":
            self.in_features, self.out_features = self.qweight.shape[0] * self.scheme.per_word, self.qweight.shape[1]
        else:
            self.out_features = self.qweight.shape[0]
            self.in_features = self.in_features or self.qweight.shape[1] * 8
        n, k = self.out_features, self.in_features
        group = self.scheme.group(k)
        groups = k // group
        if method == CT:
            scales_ok = k % group == 0 and tuple(self.scales.shape) == (n, groups)
            zeros_ok = self.qzeros is None or tuple(self.qzeros.shape) == (-(-n // 8), groups)
            words_ok = self.qweight.shape[1] == -(-k // 8)
        else:
            scales_ok = tuple(self.scales.shape) == (groups, n)
            zeros_ok = self.qzeros is not None and tuple(self.qzeros.shape) == (groups, n // self.scheme.per_word)
            words_ok = True
        if not (scales_ok and zeros_ok and words_ok):
            zeros = None if self.qzeros is None else tuple(self.qzeros.shape)
            raise Int4CheckpointError(
                f"{method} tensors disagree: qweight {tuple(self.qweight.shape)}, qzeros {zeros}, scales "
                f"{tuple(self.scales.shape)} for a [{n}, {k}] weight (group size {self.scheme.group_size})")

    def unpack(self, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 [N, K], scales [N, K/G] in their stored dtype, zero points int16 [N, K/G]: 0..16, 8-bit GPTQ
        0..256) on `device`, with the inputs in group order (g_idx is applied by `to_weight`)."""
        qweight = self.qweight.to(device)
        n, k = self.out_features, self.in_features
        method = self.scheme.method
        if method == "awq":
            codes = _columns_packed(qweight, "awq").t()
        elif method == "gptq":
            codes = _nibbles(qweight.t(), self.scheme.bits).reshape(n, k)
        else:
            codes = _nibbles(qweight).reshape(n, -1)[:, :k]
        scales = self.scales.to(device)
        if method == CT:
            groups = scales.shape[1]
            zeros = torch.full((n, groups), 8, dtype=torch.int16, device=codes.device) if self.qzeros is None else \
                _nibbles(self.qzeros.to(device).t()).reshape(groups, -1)[:, :n].t().to(torch.int16)
        else:
            scales = scales.t()
            zeros = (_columns_packed(self.qzeros.to(device), method, self.scheme.bits).t().to(torch.int16)
                     + self.scheme.zero_offset)
        return codes.contiguous(), scales.contiguous(), zeros.contiguous()

    def _groups_in_order(self) -> bool:
        if self.g_idx is None:
            return True
        group = self.scheme.group(self.in_features)
        return torch.equal(self.g_idx.to(torch.int64).cpu(), torch.arange(self.in_features) // group)

    def _planes_refusal(self) -> Optional[str]:
        """Why the planes cannot hold this layer's layout (None: they can), before its codes are unpacked."""
        group = self.scheme.group(self.in_features)
        if not self._groups_in_order():
            return "act-order groups (g_idx not in input order)"
        if self.in_features % GROUP:
            return f"inputs not a multiple of {GROUP}"
        if group % 16:
            return f"groups of {group} inputs (not a multiple of 16)"
        return None

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        """Planes on `device`; the dequantized matrix in `dtype` where the planes cannot hold the layout (act-order
        groups, inputs not a multiple of 64, groups not a multiple of 16, scales fp16 cannot hold exactly, an 8-bit
        zero of 256)."""
        why = self._planes_refusal()
        eight = self.scheme.bits == 8
        if why is None:
            codes, scales, zeros = self.unpack(device)
            if not fp16_exact(scales):
                why = f"{scales.dtype} group scales that fp16 cannot hold exactly"
            elif eight and bool((zeros > 255).any()):
                why = "zero points of 256 (a GPTQ v1 field of 255)"
        if why is not None:
            log_dense_at_load(f"{self.scheme.method} int{self.scheme.bits} layers with {why}")
            return self.dequantize(torch.float32, device).to(dtype)
        group = self.scheme.group(self.in_features)
        fixed = 128 if eight else 8  # the symmetric checkpoints' zero
        symmetric = bool((zeros == fixed).all())
        kind = (int8_kind if eight else int4_kind)(group, zero_points=not symmetric)
        # the int8 kinds' zero plane holds zero - 128 (their ZERO), the int4 kinds' the zero itself (ZERO 0)
        mn = None if symmetric else (zeros - kind.zero).to(torch.int8)
        return to_planes(Unpacked(codes=codes, d=scales.to(torch.float16), m=None, sc=None, mn=mn), kind)

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        """The weight [N, K]: (q - zero) * scale of each input's group, computed in fp32 (exact for fp16 / bf16
        scales: a small integer times an 8- or 11-bit significand; one rounding for fp32 ones), cast to dtype."""
        codes, scales, zeros = self.unpack(device)
        group = self.scheme.group(self.in_features)
        if self.g_idx is not None and not self._groups_in_order():
            idx = self.g_idx.to(device=codes.device, dtype=torch.int64)
        else:
            idx = torch.arange(self.in_features, device=codes.device) // group
        w = (codes.to(torch.float32) - zeros.to(torch.float32)[:, idx]) * scales.to(torch.float32)[:, idx]
        return w.to(dtype)


def int4_weights(stream: Iterable[tuple[str, torch.Tensor]], scheme: Int4Scheme,
                 keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) stream with each quantized layer's parts gathered into one
    `<layer>.weight`: an Int4Weight (keep_quantized) or its dequantized fp32 matrix. Other tensors pass through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    needs_g_idx = scheme.method == "gptq" and scheme.desc_act
    for name, tensor in stream:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, tensor
            continue
        if prefix in done and part == "g_idx" and not needs_g_idx:
            continue  # groups in order by the config: a late g_idx adds nothing
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if all(p in parts for p in ("qweight", "qzeros", "scales")) and ("g_idx" in parts or not needs_g_idx):
            w = Int4Weight(scheme, parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"))
            del pending[prefix]
            done.add(prefix)
            yield f"{prefix}.weight", w if keep_quantized else w.dequantize(torch.float32)
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise Int4CheckpointError(f"quantized layer {prefix!r} is incomplete in the checkpoint (has "
                                  f"{', '.join(sorted(parts))})")


def dense_bytes(path: str, itemsize: int) -> int:
    """Bytes of the checkpoint's weights once dequantized to elements of `itemsize` bytes (from the safetensors
    headers: a qweight word is 8 weights, 4 for 8-bit GPTQ (config.json's bits); zeros, scales and g_idx
    disappear)."""
    import json
    import os

    from voltllm.model.loader.safetensors_loader import stored_elements

    config = os.path.join(path, "config.json")
    qc = {}
    if os.path.exists(config):
        with open(config) as f:
            qc = json.load(f).get("quantization_config") or {}
    per_word = 32 // int(qc.get("bits", qc.get("w_bit", 4)))

    def dense(name: str, n: int) -> int:
        part = name.rpartition(".")[2]
        return 0 if part in ("qzeros", "scales", "g_idx") else per_word * n if part == "qweight" else n

    return itemsize * stored_elements(path, dense)
