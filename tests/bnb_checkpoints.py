"""Tiny bitsandbytes checkpoints written at test time: a tiny random model's projections quantized with voltllm's
reference codec (voltllm/model/loader/bnb_codec.py) and saved in the layout transformers / bitsandbytes save
(Params4bit's state dict: the packed codes, absmax, quant_map, the nested tensors and the quant-state JSON as uint8
bytes; Linear8bitLt's int8 weight, SCB and weight_format), with the matching config.json quantization_config.
The dequantized weights the tests compare against are computed here from the saved bytes by loops that follow the
format's definition (high nibble first, per-block absmax, nested absmax = map[c] * nested_absmax + offset), not by
voltllm's reader."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from quant_checkpoints import LINEARS

from voltllm.model.loader.bnb_codec import quantize_4bit, quantize_int8, table


def json_bytes(info: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(info).encode("utf-8")), dtype=torch.uint8)


def layer_4bit(weight_name: str, w: torch.Tensor, quant_type: str, double_quant: bool,
               storage: torch.dtype = torch.uint8) -> dict[str, torch.Tensor]:
    """The saved tensors of one 4-bit layer (w in the dtype the state records)."""
    packed, state = quantize_4bit(w, quant_type, double_quant=double_quant)
    if storage != torch.uint8:  # bnb_4bit_quant_storage: the same bytes in another dtype
        packed = torch.nn.functional.pad(packed.reshape(-1), (0, -packed.numel() % storage.itemsize))
        packed = packed.view(storage).reshape(-1, 1)
    info = {"quant_type": quant_type, "blocksize": state.blocksize, "dtype": str(w.dtype).removeprefix("torch."),
            "shape": list(w.shape)}
    out = {weight_name: packed, f"{weight_name}.absmax": state.absmax, f"{weight_name}.quant_map": table(quant_type)}
    if state.nested is not None:
        out[f"{weight_name}.nested_absmax"] = state.nested.absmax
        out[f"{weight_name}.nested_quant_map"] = state.nested.quant_map.clone()
        info.update(nested_blocksize=state.nested.blocksize, nested_dtype="float32", nested_offset=state.nested.offset)
    out[f"{weight_name}.quant_state.bitsandbytes__{quant_type}"] = json_bytes(info)
    return out


def reference_4bit(tensors: dict[str, torch.Tensor], weight_name: str) -> torch.Tensor:
    """The layer's weight from its saved tensors, element by element as the format defines it: fp32 products, one
    rounding to the recorded dtype."""
    key = next(k for k in tensors if k.startswith(f"{weight_name}.quant_state.bitsandbytes__"))
    info = json.loads(bytes(tensors[key].tolist()).decode())
    n, k = info["shape"]
    raw = tensors[weight_name].contiguous().view(torch.uint8).reshape(-1).numpy()
    codes = np.empty(2 * raw.size, dtype=np.int64)
    codes[0::2], codes[1::2] = raw >> 4, raw & 15
    values = tensors[f"{weight_name}.quant_map"].numpy().astype(np.float32)
    absmax = tensors[f"{weight_name}.absmax"].numpy()
    if "nested_blocksize" in info:
        nested_map = tensors[f"{weight_name}.nested_quant_map"].numpy().astype(np.float32)
        nested = tensors[f"{weight_name}.nested_absmax"].numpy().astype(np.float32)
        absmax = np.array([np.float32(nested_map[c] * nested[i // info["nested_blocksize"]])
                           + np.float32(info["nested_offset"]) for i, c in enumerate(absmax)], dtype=np.float32)
    out = np.array([values[codes[i]] * absmax[i // info["blocksize"]] for i in range(n * k)], dtype=np.float32)
    return torch.from_numpy(out.reshape(n, k)).to(getattr(torch, info["dtype"])).float()


def bnb_config(bits: int, quant_type: str = "nf4", double_quant: bool = True, skip: tuple[str, ...] = ()) -> dict:
    """config.json's quantization_config as transformers writes it."""
    return {"quant_method": "bitsandbytes", "_load_in_4bit": bits == 4, "_load_in_8bit": bits == 8,
            "load_in_4bit": bits == 4, "load_in_8bit": bits == 8, "bnb_4bit_quant_type": quant_type,
            "bnb_4bit_use_double_quant": double_quant, "bnb_4bit_compute_dtype": "bfloat16",
            "bnb_4bit_quant_storage": "uint8", "llm_int8_enable_fp32_cpu_offload": False,
            "llm_int8_has_fp16_weight": False, "llm_int8_skip_modules": list(skip) or None,
            "llm_int8_threshold": 6.0}


def quantize_bnb_checkpoint(path: str, ref_path: str, bits: int = 4, quant_type: str = "nf4",
                            double_quant: bool = True, dtype: torch.dtype = torch.float32,
                            storage: torch.dtype = torch.uint8, skip: tuple[str, ...] = ()) -> None:
    """Rewrite the tiny_models.make_model checkpoint at `path` in place as a bitsandbytes one (its projections
    quantized, those under a `skip` module name left dense), and write `ref_path`: a copy of the original directory
    whose projections hold the dequantized weights (fp32), the dense model the bitsandbytes one must equal."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, ref_path, dirs_exist_ok=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    out, ref = {}, dict(tensors)
    for name, t in tensors.items():
        prefix, _, part = name.rpartition(".")
        if part != "weight" or prefix.rpartition(".")[2] not in LINEARS or any(s in prefix for s in skip):
            out[name] = t
            continue
        w = t.to(dtype)
        if bits == 8:
            codes, scb = quantize_int8(w)
            out.update({name: codes, f"{prefix}.SCB": scb,
                        f"{prefix}.weight_format": torch.tensor(0, dtype=torch.uint8)})
            ref[name] = (codes.float() * scb[:, None]) * torch.tensor(1 / 127, dtype=torch.float32)
            continue
        layer = layer_4bit(name, w, quant_type, double_quant, storage)
        out.update(layer)
        ref[name] = reference_4bit(layer, name)
    save_file(out, file, metadata={"format": "pt"})
    save_file(ref, os.path.join(ref_path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = bnb_config(bits, quant_type, double_quant, skip)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def nf4_at_load_reference(path: str, ref_path: str) -> None:
    """`ref_path`: a copy of the unquantized checkpoint at `path` whose projections hold what `--quantization
    bitsandbytes` makes of them (NF4 in blocks of 64 with double quantization, dequantized to the stored dtype)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, ref_path, dirs_exist_ok=True)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name, t in tensors.items():
        prefix, _, part = name.rpartition(".")
        if part == "weight" and prefix.rpartition(".")[2] in LINEARS:
            tensors[name] = reference_4bit(layer_4bit(name, t, "nf4", True), name).to(t.dtype)
    save_file(tensors, os.path.join(ref_path, "model.safetensors"), metadata={"format": "pt"})


def planes_reference(path: str, ref_path: str, quantization: str | None = None) -> None:
    """`ref_path`: an unquantized copy of the checkpoint at `path` whose 4-bit / 8-bit layers hold the values of the
    planes they become when kept quantized (table[q] * the fp16-rounded absmax; q * the fp16-rounded SCB / 127; fp32):
    the dense model a kept-quantized engine must equal. `quantization`: "bitsandbytes" to quantize an unquantized
    checkpoint at load."""
    from safetensors.torch import save_file

    from voltllm.model.layers.gguf_planes import Planes, dequantize_planes
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model
    from voltllm.model.loader.bnb_checkpoint import Bnb4bitWeight, Bnb8bitWeight

    shutil.copytree(path, ref_path, dirs_exist_ok=True)
    source = resolve_model(path)
    tensors = {}
    for name, t in iter_weights(source, load_hf_config(source), keep_quantized=True, quantization=quantization):
        if isinstance(t, (Bnb4bitWeight, Bnb8bitWeight)):
            t = t.to_weight(torch.device("cpu"), torch.float32)
            t = dequantize_planes(t) if isinstance(t, Planes) else t
        tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(ref_path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ref_path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    with open(os.path.join(ref_path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
