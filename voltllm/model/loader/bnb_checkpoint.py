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

No plane of the quantized-linear kernels holds NF4 / FP4 exactly (their 4-bit table is IQ4's integers, fixed in the
kernels; an NF4 value times an fp32 absmax is no 8-bit code times a scale), so every layer is dequantized at load, to
the layer's stored dtype (bitsandbytes' own result), then the compute dtype: on a GPU this saves no memory against
the unquantized model.

`--quantization bitsandbytes` on an unquantized llama / qwen2 / qwen3 / qwen3_moe checkpoint quantizes each
projection at load as vLLM does (NF4, blocks of 64, double quantization), then dequantizes it as above: the model
runs with NF4-rounded weights.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch

from voltllm.model.loader.bnb_codec import (QUANT_TYPES, Bnb4bitState, NestedAbsmax, dequantize_4bit, dequantize_int8,
                                            quantize_4bit, table)

QUANT_STATE = ".quant_state.bitsandbytes__"
_4BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_NESTED_PARTS = ("nested_absmax", "nested_quant_map")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
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


def _weights_4bit(stream: Iterable[tuple[str, torch.Tensor]], layers: set[str]) -> Iterator[tuple[str, Any]]:
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
            yield weight, dequantize_4bit(parts["weight"], _quant_state(weight, parts, keys.pop(weight)))
    if held:
        weight, parts = next(iter(held.items()))
        raise BnbCheckpointError(f"bitsandbytes layer {weight!r} is incomplete in the checkpoint (has "
                                 f"{', '.join(sorted(parts))})")


def _weights_8bit(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
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
            yield f"{prefix}.weight", dequantize_int8(codes, scb)
    if held:
        prefix, parts = next(iter(held.items()))
        raise BnbCheckpointError(f"bitsandbytes 8-bit layer {prefix!r} is incomplete in the checkpoint (has "
                                 f"{', '.join(sorted(parts))})")


def _quantized_at_load(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
    for name, t in stream:
        if _PROJECTION.fullmatch(name) and t.dim() == 2 and t.is_floating_point():
            t = dequantize_4bit(*quantize_4bit(t, "nf4", double_quant=True))
        yield name, t


def bnb_weights(stream: Iterable[tuple[str, torch.Tensor]], scheme: BnbScheme,
                layers: set[str]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) stream with each bitsandbytes layer's tensors gathered into its dequantized
    weight (4-bit: in the layer's stored dtype; 8-bit: fp32); `layers`: the 4-bit layers' weight names
    (quantized_layers). With scheme.at_load, the projections of an unquantized checkpoint are quantized to NF4 and
    dequantized. Other tensors pass through."""
    if scheme.at_load:
        yield from _quantized_at_load(stream)
    elif scheme.bits == 8:
        yield from _weights_8bit(stream)
    else:
        yield from _weights_4bit(stream, layers)
