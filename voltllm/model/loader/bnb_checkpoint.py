"""bitsandbytes checkpoints (`quant_method: bitsandbytes`, as the Hub's "...-bnb-4bit" repos) and `--quantization
bitsandbytes` on an unquantized one. The codec is bnb_codec.py.

4-bit layers (`load_in_4bit`, what transformers / bitsandbytes save): for a linear layer's weight name W,
- `W`: the packed codes, uint8 [ceil(N * K / 2), 1] (another `bnb_4bit_quant_storage` dtype holds the same bytes);
- `W.absmax`: fp32 per block, or with double quantization uint8 codes, with `W.nested_absmax` (fp32 per 256 codes)
  and `W.nested_quant_map` (fp32 [256]);
- `W.quant_map`: the 16 table values (fp32), checked against the table the kernels use for the layer's type;
- `W.quant_state.bitsandbytes__nf4` (or `__fp4`): JSON as uint8 bytes with quant_type, blocksize, dtype (the
  weight's, e.g. "bfloat16"), shape [N, K] and, when nested, nested_blocksize, nested_dtype, nested_offset.
8-bit layers (`load_in_8bit`): `W` int8 [N, K], `<layer>.SCB` fp32 [N], `<layer>.weight_format` (0: row-major; older
tile layouts are refused).
Layers the quantizer skipped (`llm_int8_skip_modules`, the LM head) are stored dense and pass through.

Kept quantized (on a GPU, `ModelConfig.quantized_weights`), a 4-bit layer becomes a Bnb4bitWeight whose planes are
gguf_planes.bnb_kind(quant_type, blocksize): the codes re-laid into `lo` and each block's absmax in `d`, double
quantization resolved at load (bnb_codec.block_absmax, fp32) and rounded to fp16. fp16 holds an absmax well: it is
a weight magnitude (the largest |w| of its block), far inside fp16's range; without double quantization the absmax of
an fp16 or bf16 checkpoint is one of its weights, so fp16 holds it exactly (bf16 down to 2^-17); with double
quantization the fp32 absmax is itself an 8-bit code's value (about 1% apart), and fp16's rounding (at most 2^-11
relative) adds twenty times less. An element is then table[q] * absmax in fp32, one rounding, as bitsandbytes does:
the layer is 4.25 bits per weight on the device (bitsandbytes' own 4.13 with double quantization). A layer the
planes cannot hold (inputs not a multiple of 64 or of the block, so blocks straddle rows; a block size other than 64
/ 128; an absmax beyond fp16's range) is dequantized at load, with one log line per reason.

Kept quantized, an 8-bit layer becomes a Bnb8bitWeight whose planes are the symmetric int8 kind of 8-bit GPTQ
(gguf_planes.int8_kind(64), `INT8_G64`): the codes q + 128 in `lo` / `hi` (ZERO 128) and the row's scale
SCB / 127 rounded to fp16 in `d`, repeated per 64 inputs (8.25 bits per weight, so tensor parallelism cuts a row at
64 inputs as for 4-bit layers; bitsandbytes' own: 8 + 32 / K). An element is then q * fp16(SCB / 127) in fp32, exact
(an 8-bit integer times an 11-bit significand), so it is bitsandbytes' q * SCB / 127 up to that one fp16 rounding of
the scale (2^-11 relative at most: the bound of the fp16 weight the dequantized load gives, finer than a bf16 one).
A layer whose inputs are not a multiple of 64, or with a row scale fp16 holds only as a subnormal (SCB below
127 x 2^-14, about 0.0078: the relative error would grow past 2^-11; an all-zero row's 0 is exact) or not at all, is
dequantized at load (one log line per reason). The product is weight-only, as for every kept-quantized layer:
x @ (q * scale) in fp16 / bf16 with fp32 accumulation, as the dequantized load computes it, not bitsandbytes' own
int8 matmul (int8 activations, outlier columns over llm_int8_threshold in fp16), which vLLM calls:
llm_int8_threshold is ignored.

On the CPU, or where the weights are not kept quantized, every layer is dequantized at load, to the layer's stored
dtype (bitsandbytes' own result; fp32 for 8-bit layers: q * SCB * (1 / 127)), then the compute dtype: on a GPU this
saves no memory against the unquantized model.

`--quantization bitsandbytes` on an unquantized llama / qwen2 / qwen3 / qwen3_moe checkpoint quantizes each
projection at load as vLLM does (NF4, blocks of 64, double quantization), then keeps it quantized or dequantizes it
as above: the model runs with NF4-rounded weights.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from voltllm.model.layers.gguf_planes import BNB_BLOCKSIZES, GROUP, Planes, Unpacked, bnb_kind, int8_kind, to_planes
from voltllm.model.layers.quantized_linear import PackedWeight, log_dense_at_load
from voltllm.model.loader.bnb_codec import (QUANT_TYPES, Bnb4bitState, NestedAbsmax, block_absmax, dequantize_4bit,
                                            dequantize_int8, quantize_4bit, table, unpack_codes)

QUANT_STATE = ".quant_state.bitsandbytes__"
_4BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_NESTED_PARTS = ("nested_absmax", "nested_quant_map")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPE_BYTES = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}
_INT8_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}
# the projections `--quantization bitsandbytes` quantizes at load, MoE experts included (embeddings, the LM head,
# norms and the router stay as they are: vLLM's in-flight quantization leaves them too)
_PROJECTION = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


class BnbCheckpointError(ValueError):
    """A quantization_config or bitsandbytes tensor this loader cannot read."""


@dataclass(frozen=True)
class BnbScheme:
    bits: int  # 4 (NF4 / FP4) or 8 (LLM.int8())
    at_load: bool = False  # an unquantized checkpoint quantized while it loads (--quantization bitsandbytes)


def bnb_scheme(hf_config: Any, quantization: Optional[str] = None) -> Optional[BnbScheme]:
    """The checkpoint's bitsandbytes scheme, or BnbScheme(4, at_load=True) for `--quantization bitsandbytes` on an
    unquantized one; None otherwise. A config that says neither 4 nor 8 bits raises."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return BnbScheme(4, at_load=True) if quantization == "bitsandbytes" else None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if str(qc.get("quant_method", "")).lower() != "bitsandbytes":
        return None
    four = bool(qc.get("load_in_4bit") or qc.get("_load_in_4bit"))
    eight = bool(qc.get("load_in_8bit") or qc.get("_load_in_8bit"))
    if four == eight:
        raise BnbCheckpointError(f"bitsandbytes checkpoint with load_in_4bit {four} and load_in_8bit {eight}: "
                                 "expected exactly one of them")
    return BnbScheme(8 if eight else 4)


FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0 ** -14
# 8-bit layers' planes: 8-bit GPTQ's symmetric kind (codes q + 128, ZERO 128), the row's scale repeated per 64 inputs
BNB8_KIND = int8_kind(GROUP, zero_points=False)


@dataclass
class Bnb4bitWeight(PackedWeight):
    """One 4-bit layer as the checkpoint stores it: the packed codes (any storage dtype, read as bytes) and its
    state. `to_weight` re-lays it as planes of bnb_kind on the device (see the module docstring)."""
    packed: torch.Tensor
    state: Bnb4bitState
    out_features: int = 0
    in_features: int = 0

    def __post_init__(self):
        self.out_features, self.in_features = self.state.shape

    def planes_refusal(self) -> Optional[str]:
        """Why the planes cannot hold this layer's layout (None: they can); the absmax is checked in to_weight."""
        bs, k = self.state.blocksize, self.in_features
        if bs not in BNB_BLOCKSIZES:
            kept = " / ".join(map(str, BNB_BLOCKSIZES))
            return f"bitsandbytes 4-bit blocks of {bs} (kept quantized: blocks of {kept})"
        if k % bs or k % GROUP:
            return f"bitsandbytes 4-bit layers whose inputs are not a multiple of {max(bs, GROUP)} (blocks of {bs})"
        return None

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        """Planes of bnb_kind on `device`; the dequantized matrix in `dtype` where they cannot hold the layer."""
        why = self.planes_refusal()
        absmax = None
        if why is None:
            absmax = block_absmax(self.state).to(device)
            if absmax.numel() and float(absmax.abs().max()) > FP16_MAX:
                why = "bitsandbytes 4-bit blocks whose absmax is beyond fp16's range"
        if why is not None:
            log_dense_at_load(why)
            return self.dequantize(dtype, device)
        n, k = self.out_features, self.in_features
        codes = unpack_codes(self.packed.to(device), n * k).reshape(n, k)
        d = absmax.reshape(n, k // self.state.blocksize).to(torch.float16)
        return to_planes(Unpacked(codes=codes, d=d, m=None, sc=None, mn=None),
                         bnb_kind(self.state.quant_type, self.state.blocksize))

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        """bitsandbytes' own dequantization (in the stored dtype), then `dtype`."""
        return dequantize_4bit(self.packed, self.state).to(device=device, dtype=dtype)


@dataclass
class Bnb8bitWeight(PackedWeight):
    """One 8-bit (LLM.int8()) layer as the checkpoint stores it: int8 codes [N, K] and each row's absmax SCB
    (fp32 [N]), weight = q * SCB / 127. `to_weight` re-lays it as planes of BNB8_KIND (see the module docstring)."""
    codes: torch.Tensor
    scb: torch.Tensor
    out_features: int = 0
    in_features: int = 0

    def __post_init__(self):
        self.out_features, self.in_features = self.codes.shape

    def row_scales(self) -> torch.Tensor:
        """SCB / 127 per row, rounded once to fp16 (from the fp64 quotient)."""
        return (self.scb.reshape(-1).to(torch.float64) / 127).to(torch.float16)

    def planes_refusal(self) -> Optional[str]:
        """Why the planes cannot hold this layer (None: they can)."""
        if self.in_features % GROUP:
            return f"bitsandbytes 8-bit layers whose inputs are not a multiple of {GROUP}"
        scale = self.scb.reshape(-1).to(torch.float64) / 127
        if bool((scale.abs() > FP16_MAX).any()) or not bool(torch.isfinite(scale).all()):
            return "bitsandbytes 8-bit rows whose scale (SCB / 127) is beyond fp16's range"
        if bool(((scale != 0) & (scale.abs() < FP16_MIN_NORMAL)).any()):
            return "bitsandbytes 8-bit rows whose scale (SCB / 127) is below fp16's normal range (SCB < 0.0078)"
        return None

    def to_weight(self, device: Optional[torch.device], dtype: torch.dtype) -> Union[Planes, torch.Tensor]:
        """Planes of BNB8_KIND on `device`; the dequantized matrix in `dtype` where they cannot hold the layer."""
        why = self.planes_refusal()
        if why is not None:
            log_dense_at_load(why)
            return self.dequantize(dtype, device)
        n, k = self.out_features, self.in_features
        codes = (self.codes.to(device).to(torch.int16) + BNB8_KIND.zero).to(torch.uint8)
        d = self.row_scales().to(device).reshape(n, 1).expand(n, k // BNB8_KIND.super)
        return to_planes(Unpacked(codes=codes, d=d.contiguous(), m=None, sc=None, mn=None), BNB8_KIND)

    def dequantize(self, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
        """bitsandbytes' own dequantization, q * SCB * (1 / 127) in fp32, then `dtype`."""
        return dequantize_int8(self.codes.to(device), self.scb.to(device)).to(dtype)


def quantized_layers(path: str) -> set[str]:
    """The weight names of the directory's 4-bit layers (those with a quant state), from the safetensors headers."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt", device="cpu") as st:
            names.update(name.split(QUANT_STATE)[0] for name in st.keys() if QUANT_STATE in name)
    return names


def _quant_state(weight: str, parts: dict[str, torch.Tensor], key: str) -> Bnb4bitState:
    """The layer's Bnb4bitState from its JSON (quant_state tensor `key`) and tensors, every field checked."""
    def fail(what: str) -> BnbCheckpointError:
        return BnbCheckpointError(f"bitsandbytes layer {weight!r}: {what}")

    try:
        info = json.loads(bytes(parts["quant_state"].to(torch.uint8).reshape(-1).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"its quant_state is not JSON ({e})") from None
    quant_type = str(info.get("quant_type"))
    if quant_type not in QUANT_TYPES or quant_type != key.rpartition("__")[2]:
        raise fail(f"quant_type {quant_type!r} under {key!r}: expected nf4 or fp4, as its key names")
    dtype = _DTYPES.get(str(info.get("dtype", "")).removeprefix("torch."))
    shape = tuple(int(s) for s in info.get("shape") or ())
    blocksize = int(info.get("blocksize") or 0)
    if dtype is None or len(shape) != 2 or blocksize <= 0:
        raise fail(f"dtype {info.get('dtype')!r}, shape {list(shape)}, blocksize {blocksize}: expected a float16 / "
                   "bfloat16 / float32 matrix in positive blocks")
    stored = parts["quant_map"].to(torch.float32).reshape(-1)
    if stored.numel() != 16 or not torch.allclose(stored, table(quant_type), rtol=0, atol=1e-6):
        raise fail(f"its quant_map is not bitsandbytes' {quant_type} table")
    state = Bnb4bitState(quant_type, blocksize, shape, dtype, parts["absmax"].reshape(-1))
    packed_bytes = parts["weight"].numel() * parts["weight"].element_size()
    if packed_bytes < -(-state.numel // 2) or state.absmax.numel() != state.blocks:
        raise fail(f"{packed_bytes} packed bytes and {state.absmax.numel()} absmax for shape {list(shape)} in "
                   f"blocks of {blocksize}: expected {-(-state.numel // 2)} and {state.blocks}")
    if "nested_blocksize" in info:
        nested_blocksize = int(info["nested_blocksize"])
        nested_map = parts["nested_quant_map"].to(torch.float32).reshape(-1)
        nested_absmax = parts["nested_absmax"].reshape(-1)
        if (str(info.get("nested_dtype", "float32")).removeprefix("torch.") != "float32" or nested_blocksize <= 0
                or nested_map.numel() != 256 or nested_absmax.numel() != -(-state.blocks // nested_blocksize)
                or state.absmax.dtype != torch.uint8):
            raise fail(f"double quantization with {nested_absmax.numel()} nested absmax in blocks of "
                       f"{nested_blocksize}, {nested_map.numel()} map values, absmax codes of {state.absmax.dtype}: "
                       "expected fp32, one per block of uint8 codes, and a 256-value map")
        state.nested = NestedAbsmax(nested_map, nested_absmax, nested_blocksize, float(info["nested_offset"]))
    elif state.absmax.dtype != torch.float32:
        raise fail(f"absmax of {state.absmax.dtype} without double quantization: expected float32")
    return state


def _complete(parts: dict[str, torch.Tensor]) -> bool:
    needed = ("weight", "absmax", "quant_map", "quant_state")
    if not all(p in parts for p in needed):
        return False
    if any(p in parts for p in _NESTED_PARTS) or b'"nested_blocksize"' in _json_bytes(parts["quant_state"]):
        return all(p in parts for p in _NESTED_PARTS)
    return True


def _json_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.to(torch.uint8).reshape(-1).tolist())


def _weights_4bit(stream: Iterable[tuple[str, torch.Tensor]], layers: set[str],
                  keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    held: dict[str, dict[str, torch.Tensor]] = {}
    keys: dict[str, str] = {}
    for name, t in stream:
        if QUANT_STATE in name:
            weight, part = name.split(QUANT_STATE)[0], "quant_state"
            keys[weight] = name
        elif name in layers:
            weight, part = name, "weight"
        else:
            weight, _, part = name.rpartition(".")
            if weight not in layers or part not in _4BIT_PARTS:
                yield name, t
                continue
        if weight not in layers:  # (a quant state the headers did not show: not a safetensors file)
            raise BnbCheckpointError(f"bitsandbytes layer {weight!r}: its quant state is not in a .safetensors "
                                     "file (bitsandbytes checkpoints are read from safetensors)")
        parts = held.setdefault(weight, {})
        parts[part] = t
        if _complete(parts):
            del held[weight]
            state = _quant_state(weight, parts, keys.pop(weight))
            yield weight, (Bnb4bitWeight(parts["weight"], state) if keep_quantized
                           else dequantize_4bit(parts["weight"], state))
    if held:
        weight, parts = next(iter(held.items()))
        raise BnbCheckpointError(f"bitsandbytes layer {weight!r} is incomplete in the checkpoint (has "
                                 f"{', '.join(sorted(parts))})")


def _weights_8bit(stream: Iterable[tuple[str, torch.Tensor]], keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in stream:
        prefix, _, part = name.rpartition(".")
        if part == "weight_format":
            fmt = int(t.reshape(-1)[0]) if t.numel() else 0
            if fmt != 0:
                raise BnbCheckpointError(f"bitsandbytes 8-bit layer {prefix!r} in the {_INT8_FORMATS.get(fmt, fmt)!r} "
                                         "tile layout: only row-major 8-bit weights are read")
            continue
        if not ((part == "weight" and t.dtype == torch.int8) or part == "SCB"):
            yield name, t
            continue
        parts = held.setdefault(prefix, {})
        parts[part] = t
        if len(parts) == 2:
            del held[prefix]
            codes, scb = parts["weight"], parts["SCB"].reshape(-1)
            if codes.dim() != 2 or scb.numel() != codes.shape[0]:
                raise BnbCheckpointError(f"bitsandbytes 8-bit layer {prefix!r}: weight {list(codes.shape)} with "
                                         f"{scb.numel()} SCB values: expected one per row")
            yield f"{prefix}.weight", (Bnb8bitWeight(codes, scb) if keep_quantized else dequantize_int8(codes, scb))
    if held:
        prefix, parts = next(iter(held.items()))
        raise BnbCheckpointError(f"bitsandbytes 8-bit layer {prefix!r} is incomplete in the checkpoint (has "
                                 f"{', '.join(sorted(parts))})")


def _quantized_at_load(stream: Iterable[tuple[str, torch.Tensor]], keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    for name, t in stream:
        if _PROJECTION.fullmatch(name) and t.dim() == 2 and t.is_floating_point():
            packed, state = quantize_4bit(t, "nf4", double_quant=True)
            t = Bnb4bitWeight(packed, state) if keep_quantized else dequantize_4bit(packed, state)
        yield name, t


def bnb_weights(stream: Iterable[tuple[str, torch.Tensor]], scheme: BnbScheme, layers: set[str],
                keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) stream with each bitsandbytes layer's tensors gathered into one weight: a 4-bit
    layer's Bnb4bitWeight (keep_quantized) or its dequantized weight in the layer's stored dtype; an 8-bit layer's
    Bnb8bitWeight (keep_quantized) or its dequantized weight (fp32). `layers`: the 4-bit layers' weight names
    (quantized_layers). With scheme.at_load, the projections of an unquantized checkpoint are quantized to NF4 (then
    kept or dequantized alike). Other tensors pass through."""
    if scheme.at_load:
        yield from _quantized_at_load(stream, keep_quantized)
    elif scheme.bits == 8:
        yield from _weights_8bit(stream, keep_quantized)
    else:
        yield from _weights_4bit(stream, layers, keep_quantized)


def dense_bytes(path: str, itemsize: int) -> int:
    """Bytes of the checkpoint's weights once dequantized to elements of `itemsize` bytes (from the safetensors
    headers: a 4-bit layer's packed bytes are two weights each; its absmax, maps and state disappear)."""
    from safetensors import safe_open

    from voltllm.model.loader.safetensors_loader import stored_elements

    layers = quantized_layers(path)
    storage: dict[str, int] = {}  # a 4-bit layer's packed storage bytes per element (bnb_4bit_quant_storage)
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                if name in layers:
                    storage[name] = _DTYPE_BYTES.get(st.get_slice(name).get_dtype(), 1)

    def dense(name: str, n: int) -> int:
        if name in layers:
            return 2 * n * storage[name]
        weight, _, part = name.rpartition(".")
        if QUANT_STATE in name or (weight in layers and part in _4BIT_PARTS):
            return 0
        return 0 if part in ("SCB", "weight_format") else n

    return itemsize * stored_elements(path, dense)
