"""compressed-tensors checkpoints (llm-compressor's output, `quant_method: compressed-tensors`) other than NVFP4
(nvfp4_checkpoint.py reads those): int4 / int8 weights packed into int32 words, FP8 (E4M3) weights, int8 weights.

config.json's quantization_config holds `config_groups`, each a scheme (`weights`: num_bits, type int | float,
symmetric, strategy tensor | channel | group | block, group_size, block_structure, actorder; `input_activations`;
`format`, else the top-level `format`) applied to the layers its `targets` name, minus the `ignore` list (the LM head,
MoE routers ...: stored dense). A target is a layer name, a regex (`re:` prefix, matched from the name's start) or a
module class (`Linear`); as compressed-tensors and vLLM match them, an exact name wins over a regex, a regex over a
class. Here a class target stands for every layer the checkpoint stores quantized (only linear layers are), and the
tensors tell which layers those are.

Formats read, per layer (`<layer>.` + these names):
- `pack-quantized` (int weights, W4A16 / W8A16 presets): `weight_packed` int32 [N, ceil(K * bits / 32)], row-major,
  element k of a row at bits (k * bits) % 32 of word (k * bits) // 32, stored as q + 2^(bits-1) (q signed);
  `weight_scale` [N, K/G] (channel: [N, 1]; tensor: [1]); `weight_shape` [N, K]; asymmetric layers
  `weight_zero_point` packed the same way along the outputs (int32 [ceil(N * bits / 32), K/G]); act-order ("group")
  layers `weight_g_idx` [K]. w = (q - zero) * scale. 4-bit layers become int4_checkpoint.Int4Weight (its CT method),
  8-bit ones Int8Weight (below).
- `float-quantized` / `naive-quantized` with float weights (FP8, FP8_DYNAMIC, FP8_BLOCK presets): `weight`
  float8_e4m3fn [N, K] and `weight_scale` per tensor [1], per channel [N, 1], per group [N, K/G] or per block
  [ceil(N/bh), ceil(K/bw)]: w = e4m3 * scale, an fp8_checkpoint.FP8Weight.
- `int-quantized` / `naive-quantized` with int weights (W8A8 int8): `weight` int8 [N, K], `weight_scale`,
  asymmetric layers `weight_zero_point` int8 (not packed): Int8Weight.

Weight-only, as voltllm runs every quantized checkpoint: activation quantization (`input_activations`: static
`input_scale` / `input_zero_point`, dynamic per-token scales) is dropped and activations stay fp16 / bf16, as vLLM's
W8A16 / Marlin paths do on GPUs without FP8 / int8 instructions. A KV-cache scale stored as `k_proj.output_scale` /
`v_proj.output_scale` (older kv_cache_scheme checkpoints) is handed on as the attention's `k_scale` / `v_scale`, as
vLLM does.

Kept quantized on the GPU: int4 layers as the int4 planes (AWQ / GPTQ's: codes, fp16 scale and, asymmetric, int8 zero
point per group), int8 symmetric layers as Q8_0 planes (8-bit codes, the fp16 scale repeated per 32 inputs: 8.5 bits
per weight), int8 asymmetric layers as the int8 planes with zero points (8-bit GPTQ's, gguf_planes.int8_kind: the
signed int8 zero point is the plane's zero - 128 as it is; the checkpoint's groups, 8.1875 bits per weight at 128, or
for one scale per row the scale and zero repeated per 64 inputs, 8.375, so tensor parallelism cuts at 64 inputs),
FP8 layers as FP8 planes. Where the planes cannot hold a layer (inputs not a multiple of 64, act-order groups, int8
groups not a multiple of 32, or of 16 with zero points, scales fp16 cannot hold exactly, FP8 inputs not a multiple of
128) it is dequantized at load, layer by layer, with one log line per reason. Dequantized values are the
checkpoint's exactly: (q - zero) and e4m3 are exact in fp32 and so is their product with an fp16 / bf16 scale (one
rounding with an fp32 scale), then one rounding to the compute dtype (compressed-tensors' own decompression rounds
the product to the scale's dtype instead: the same value when the compute dtype is that dtype).
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from voltllm.model.layers.gguf_planes import GROUP, KINDS, PlaneKind, Planes, Unpacked, int8_kind, to_planes
from voltllm.model.layers.quantized_linear import PackedWeight, log_dense_at_load
from voltllm.model.loader.fp8_checkpoint import FP8Weight
from voltllm.model.loader.int4_checkpoint import CT, Int4Scheme, Int4Weight, fp16_exact

logger = logging.getLogger("voltllm")

PACKED = "pack-quantized"
UNPACKED = ("float-quantized", "naive-quantized", "int-quantized")
_QPARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
_ACTIVATION_PARTS = ("input_scale", "input_zero_point", "input_global_scale")
_KV_OUTPUT = re.compile(r"^(?P<attn>.*)\.(?P<proj>k_proj|v_proj)\.output_(?P<what>scale|zero_point)$")
Q8_0 = KINDS["Q8_0"]  # 8-bit codes q + 128 and an fp16 scale per 32 inputs: w = d * (code - 128)
INT8_GROUP_MULTIPLE = 16  # the int8 kinds' groups (gguf_planes.int8_kind): whole 16-input units of the kernels


class CTCheckpointError(ValueError):
    """A compressed-tensors quantization_config or tensor this loader cannot read."""


@dataclass(frozen=True)
class CTWeights:
    """One config group's weight quantization."""
    name: str  # the config group's name (for messages)
    targets: tuple[str, ...]
    format: str
    num_bits: int
    type: str  # "int" | "float"
    symmetric: bool
    strategy: str  # "tensor" | "channel" | "group" | "block"
    group_size: Optional[int]  # strategy "group"
    block: Optional[tuple[int, int]]  # strategy "block": (rows, inputs)
    act_order: bool  # actorder "group": the layers store weight_g_idx

    @property
    def packed(self) -> bool:
        return self.format == PACKED

    def describe(self) -> str:
        what = "FP8 E4M3" if self.type == "float" else f"int{self.num_bits}"
        how = {"group": f"groups of {self.group_size}", "block": f"{self.block[0]} x {self.block[1]} blocks"
               if self.block else "blocks"}.get(self.strategy, f"per {self.strategy}")
        return f"{what} ({how}{'' if self.symmetric else ', zero points'})"


@dataclass(frozen=True)
class CTScheme:
    groups: tuple[CTWeights, ...]
    ignore: tuple[str, ...]

    def weights_for(self, layer: str) -> Optional[CTWeights]:
        """The config group that quantizes `layer` (a checkpoint module name such as model.layers.0.mlp.down_proj);
        None when the ignore list names it or no target does."""
        if any(_name_matches(layer, t) for t in self.ignore):
            return None
        for level in (_exact, _regex, _class):
            for g in self.groups:
                if any(level(layer, t) for t in g.targets):
                    return g
        return None

    def describe(self) -> str:
        return " / ".join(dict.fromkeys(g.describe() for g in self.groups))


def _exact(layer: str, target: str) -> bool:
    return target == layer


def _regex(layer: str, target: str) -> bool:
    return target.startswith("re:") and re.match(target[3:], layer) is not None


def _class(layer: str, target: str) -> bool:
    """A module class name (`Linear`, ...): every layer stored quantized is a linear layer here."""
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _name_matches(layer: str, target: str) -> bool:
    return _exact(layer, target) or _regex(layer, target)


def _quantization_config(hf_config: Any) -> Optional[dict]:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def ct_scheme(hf_config: Any) -> Optional[CTScheme]:
    """The checkpoint's compressed-tensors scheme; None when it is not compressed-tensors or is NVFP4 throughout
    (nvfp4_checkpoint.py). Variants not read here raise CTCheckpointError naming what was found."""
    from voltllm.model.loader.nvfp4_checkpoint import is_nvfp4_group

    qc = _quantization_config(hf_config)
    if qc is None or str(qc.get("quant_method", "")).lower() != CT:
        return None
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CTCheckpointError("compressed-tensors checkpoint without config_groups: not read")
    nvfp4 = [is_nvfp4_group(g, qc.get("format")) for g in groups.values()]
    if all(nvfp4):
        return None
    if any(nvfp4):
        raise CTCheckpointError("compressed-tensors checkpoint mixing NVFP4 with other formats: not read")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")).lower() != "dense":
        raise CTCheckpointError(f"compressed-tensors checkpoint with a sparsity_config of format "
                                f"{sparsity.get('format')!r}: not read (only dense storage is)")
    if qc.get("transform_config"):
        raise CTCheckpointError("compressed-tensors checkpoint with a transform_config (rotated weights): not read")
    parsed = [w for name, g in groups.items() if (w := _group(name, g, qc.get("format"))) is not None]
    if not parsed:
        raise CTCheckpointError("compressed-tensors checkpoint whose config_groups quantize no weights: not read")
    return CTScheme(tuple(parsed), tuple(qc.get("ignore") or ()))


def _group(name: str, g: dict, top_format: Optional[str]) -> Optional[CTWeights]:
    w = g.get("weights")
    if not w:
        return None  # activations only: the weights stay dense
    fmt = str(g.get("format") or top_format or "").lower()
    bits, kind = int(w.get("num_bits", 8)), str(w.get("type", "int")).lower()
    symmetric = bool(w.get("symmetric", True))
    group_size = w.get("group_size")
    strategy = w.get("strategy") or ("tensor" if group_size is None else "channel" if group_size == -1 else "group")
    strategy = str(strategy).lower()
    what = f"{name}: {bits}-bit {kind} weights, strategy {strategy}"

    def refuse(why: str) -> CTCheckpointError:
        return CTCheckpointError(f"compressed-tensors checkpoint of format {fmt or None!r} ({what}): {why}")

    if w.get("dynamic"):
        raise refuse("dynamic weight quantization is not read")
    if fmt == PACKED:
        ok = kind == "int" and bits in (4, 8) and strategy in ("group", "channel", "tensor")
    elif fmt in UNPACKED:
        ok = bits == 8 and strategy in ("tensor", "channel", "group", "block") and (
            (kind == "float" and fmt != "int-quantized") or (kind == "int" and fmt != "float-quantized"))
    else:
        ok = False
    if not ok:
        raise refuse("not read (read: pack-quantized int4 / int8; float-quantized, naive-quantized FP8 E4M3; "
                     "int-quantized, naive-quantized int8; nvfp4-pack-quantized)")
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise refuse(f"group_size {group_size!r} is not a positive group size")
    if not symmetric and (kind == "float" or strategy == "tensor"):
        raise refuse("asymmetric float or per-tensor weights are not read")
    if w.get("scale_dtype") not in (None, "torch.float16", "torch.bfloat16", "torch.float32"):
        raise refuse(f"scales of dtype {w.get('scale_dtype')} are not read")
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        bs = [int(b) for b in bs.split("x")] if isinstance(bs, str) else bs
        if not bs or len(bs) != 2 or min(bs) < 1:
            raise refuse(f"block_structure {w.get('block_structure')!r}: expected [rows, inputs]")
        block = (int(bs[0]), int(bs[1]))
    act_order = w.get("actorder") in (True, "group", "dynamic")
    return CTWeights(name, tuple(g.get("targets") or ("Linear",)), fmt, bits, kind, symmetric, strategy,
                     group_size if strategy == "group" else None, block, act_order)


def _unpack_words(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words [R, W] holding `bits`-bit values (4 or 8: whole values per word, element i of a row at bits
    i * bits) -> the unsigned values int16 [R, count]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    vals = (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(words.shape[0], words.shape[1] * per)[:, :count].to(torch.int16)


@dataclass
class Int8Weight(PackedWeight):
    """One linear layer's int8 weight: `stored` as the checkpoint has it (int8 [N, K], or int32 words [N, K/4] of a
    pack-quantized layer holding q + 128), scales [N, K/G] and zero points int8 [N, K/G] (None: symmetric)."""
    stored: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    g_idx: Optional[torch.Tensor]
    group: int
    out_features: int = 0
    in_features: int = 0

    def __post_init__(self):
        n = self.stored.shape[0]
        k = self.in_features or self.stored.shape[1] * (4 if self.stored.dtype == torch.int32 else 1)
        self.out_features, self.in_features = n, k
        want = (n, k // self.group)
        if k % self.group or tuple(self.scale.shape) != want or (self.zero is not None and self.zero.shape != want):
            raise CTCheckpointError(f"int8 weight [{n}, {k}] with scales {tuple(self.scale.shape)}, expected {want} "
                                    f"for groups of {self.group}")

    def codes(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """q + 128, uint8 [N, K] on `device` (Q8_0's code convention)."""
        s = self.stored.to(device)
        if s.dtype == torch.int32:
            return _unpack_words(s, 8, self.in_features).to(torch.uint8)
        return (s.to(torch.int16) + 128).to(torch.uint8)

    def _group_index(self, device: torch.device) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.to(device=device, dtype=torch.int64)
        return torch.arange(self.in_features, device=device) // self.group

    def plane_kind(self) -> PlaneKind:
        """The planes' kind: symmetric, Q8_0 (the scale repeated per 32 inputs); asymmetric, an int8 kind with the
        zero point per `d` (int8_kind): the checkpoint's groups, or for one scale per row (channel / tensor) the scale
        and zero repeated per 64 inputs, so tensor parallelism cuts the row at 64 inputs as for symmetric layers."""
        if self.zero is None:
            return Q8_0
        return int8_kind(GROUP if self.group == self.in_features else self.group, zero_points=True)

    def _planes_refusal(self) -> Optional[str]:
        """Why the planes cannot hold this layer (None: they can)."""
        k = self.in_features
        if self.g_idx is not None and not torch.equal(self.g_idx.to(torch.int64).cpu(), torch.arange(k) // self.group):
            return "act-order groups (g_idx not in input order)"
        if k % GROUP:
            return f"inputs not a multiple of {GROUP}"
        if self.zero is None and self.group % Q8_0.super:
            return f"groups of {self.group} inputs (not a multiple of {Q8_0.super})"
        if self.zero is not None and self.group % INT8_GROUP_MULTIPLE:
            return f"zero points in groups of {self.group} inputs (not a multiple of {INT8_GROUP_MULTIPLE})"
        if not fp16_exact(self.scale):
            return f"{self.scale.dtype} scales that fp16 cannot hold exactly"
        return None

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        """Planes of plane_kind() on `device`; the dequantized matrix where they cannot hold the layer."""
        why = self._planes_refusal()
        if why is not None:
            log_dense_at_load(f"int8 layers with {why}")
            return self.dequantize(torch.float32, device).to(dtype)
        kind = self.plane_kind()
        repeat = self.group // kind.super
        d = self.scale.to(device=device, dtype=torch.float16).repeat_interleave(repeat, dim=1)
        # the int8 kinds' zero plane holds zero - ZERO 128 in code space (code = q + 128): the signed zero itself
        mn = None if self.zero is None else self.zero.to(device=device, dtype=torch.int8).repeat_interleave(repeat, 1)
        return to_planes(Unpacked(codes=self.codes(device), d=d.contiguous(), m=None, sc=None,
                                  mn=None if mn is None else mn.contiguous()), kind)

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        """(q - zero) * scale [N, K] in fp32 (exact for fp16 / bf16 scales), cast to dtype."""
        codes = self.codes(device)
        idx = self._group_index(codes.device)
        q = codes.to(torch.float32) - 128
        if self.zero is not None:
            q = q - self.zero.to(device=codes.device, dtype=torch.float32)[:, idx]
        return (q * self.scale.to(device=codes.device, dtype=torch.float32)[:, idx]).to(dtype)


def _layer_weight(prefix: str, w: CTWeights, parts: dict[str, torch.Tensor]) -> PackedWeight:
    """The layer's weight object from its gathered tensors."""
    scale = parts["weight_scale"]
    if w.type == "float":
        weight = parts["weight"]
        if weight.dtype != torch.float8_e4m3fn:
            raise CTCheckpointError(f"{prefix}: FP8 weight of dtype {weight.dtype}, expected float8_e4m3fn")
        block = w.block if w.strategy == "block" else (1, w.group_size) if w.strategy == "group" else None
        return FP8Weight.from_checkpoint(weight, scale, block)
    if w.packed:
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        stored = parts["weight_packed"]
    else:
        stored = parts["weight"]
        if stored.dtype != torch.int8:
            raise CTCheckpointError(f"{prefix}: int8 weight of dtype {stored.dtype}, expected int8")
        n, k = stored.shape
    group = w.group_size if w.strategy == "group" else k
    scale = scale.reshape(1, 1).expand(n, 1) if w.strategy == "tensor" else scale.reshape(n, -1)
    zero = parts.get("weight_zero_point")
    if w.num_bits == 4:
        scheme = Int4Scheme(CT, group if w.strategy == "group" else -1, desc_act=w.act_order, zero_offset=0)
        return Int4Weight(scheme, stored, None if w.symmetric else zero, scale, parts.get("weight_g_idx"),
                          in_features=k)
    if zero is not None and w.packed:  # int32 words along the outputs, each zero stored + 128
        zero = (_unpack_words(zero.t(), 8, n).t() - 128).to(torch.int8)
    return Int8Weight(stored, scale, None if w.symmetric else zero.reshape(n, -1), parts.get("weight_g_idx"), group,
                      in_features=k)


def _required(w: CTWeights) -> set[str]:
    need = {"weight_packed", "weight_shape"} if w.packed else {"weight"}
    need.add("weight_scale")
    if not w.symmetric:
        need.add("weight_zero_point")
    if w.act_order and w.packed:
        need.add("weight_g_idx")
    return need


def ct_weights(stream: Iterable[tuple[str, torch.Tensor]], scheme: CTScheme,
               keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) stream with each quantized layer's parts gathered into one `<layer>.weight`:
    an Int4Weight / Int8Weight / FP8Weight (keep_quantized) or its dequantized fp32 matrix. Activation scales are
    dropped; k_proj / v_proj output scales become the attention's k_scale / v_scale; other tensors (dense layers,
    norms, embeddings) pass through."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    done: dict[str, CTWeights] = {}
    for name, t in stream:
        prefix, _, part = name.rpartition(".")
        if part in _ACTIVATION_PARTS:
            continue
        if part.startswith("output_"):
            if (m := _KV_OUTPUT.match(name)) is None or m["what"] != "scale":
                raise CTCheckpointError(f"{name}: output activation quantization is not read")
            yield f"{m['attn']}.{m['proj'][0]}_scale", t
            continue
        quantized_weight = part == "weight" and t.dtype in (torch.float8_e4m3fn, torch.int8)
        if not (quantized_weight or part in _QPARTS):
            yield name, t
            continue
        if prefix in done:
            if part == "weight_g_idx" and torch.equal(t.to(torch.int64), torch.arange(t.numel()) //
                                                      (done[prefix].group_size or t.numel())):
                continue  # groups in input order: adds nothing
            raise CTCheckpointError(f"{name}: found after its layer's weight was complete")
        parts = held.setdefault(prefix, {})
        parts[part] = t
        if "weight_packed" not in parts and "weight" not in parts:
            continue
        w = scheme.weights_for(prefix)
        if w is None:
            raise CTCheckpointError(f"{prefix} is stored quantized but no config group targets it (or it is ignored)")
        stored = "weight_packed" if "weight_packed" in parts else "weight"
        if (stored == "weight_packed") != w.packed:
            raise CTCheckpointError(f"{prefix}: stored as {stored} but its config group {w.name} has format "
                                    f"{w.format}")
        if not _required(w) <= parts.keys():
            continue
        del held[prefix]
        done[prefix] = w
        qw = _layer_weight(prefix, w, parts)
        yield f"{prefix}.weight", qw if keep_quantized else qw.dequantize(torch.float32)
    if held:
        prefix, parts = next(iter(held.items()))
        raise CTCheckpointError(f"quantized layer {prefix!r} is incomplete in the checkpoint (has "
                                f"{', '.join(sorted(parts))}; a weight stored unquantized beside its scales is not "
                                "read)")


def describe(hf_config: Any) -> str:
    """What a compressed-tensors checkpoint's layers hold (acceleration report)."""
    from voltllm.model.loader.nvfp4_checkpoint import nvfp4_scheme

    try:
        if nvfp4_scheme(hf_config) is not None:
            return "NVFP4 E2M1 with E4M3 group scales (decoded in software)"
        scheme = ct_scheme(hf_config)
    except ValueError:
        scheme = None
    return f"compressed-tensors {scheme.describe()}" if scheme else "compressed-tensors"


def dense_bytes(path: str, itemsize: int) -> int:
    """Bytes of the checkpoint's weights once dequantized to elements of `itemsize` bytes (from config.json and the
    safetensors headers: a packed word is 32 / bits weights; scales, zero points, shapes and g_idx disappear)."""
    from voltllm.model.loader import nvfp4_checkpoint
    from voltllm.model.loader.safetensors_loader import stored_elements

    with open(os.path.join(path, "config.json")) as f:
        cfg = SimpleNamespace(quantization_config=json.load(f).get("quantization_config"))
    scheme = ct_scheme(cfg)
    if scheme is None:
        return nvfp4_checkpoint.dense_bytes(path, itemsize)

    def dense(name: str, n: int) -> int:
        prefix, _, part = name.rpartition(".")
        if part == "weight_packed":
            w = scheme.weights_for(prefix)
            return n * 32 // (w.num_bits if w else 4)
        return 0 if part in _QPARTS or part in _ACTIVATION_PARTS or part.startswith("output_") else n

    return itemsize * stored_elements(path, dense)
