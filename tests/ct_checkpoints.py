"""compressed-tensors checkpoints made by the compressed-tensors library itself (llm-compressor's compression layer):
tiny transformers models quantized with its schemes and packed by its compressors, and the weights its own
decompression gives back (the reference voltllm's loader must reproduce).

The scales come from the library's calculate_qparams on each group's min / max (what a min-max observer gives); for
int weights they are then rounded to fp16-representable values (by default), so the int4 / int8 planes, which hold
fp16 scales, can keep them (a bf16 checkpoint's scales are fp16-representable anyway; fp32 ones generally are not:
`fp16_scales=False` checks that fallback)."""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch

# config groups' weights (and input activations, dropped by voltllm) of the schemes the tests use, as the library's
# presets write them: W4A16 / W4A16_ASYM / W8A16 (pack-quantized), FP8 / FP8_DYNAMIC / FP8_BLOCK (float-quantized),
# INT8 W8A8 (int-quantized); and int8 weights with zero points (asymmetric) of both int formats
_TOKEN_INT8 = dict(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
SCHEMES = {
    "w4a16-asym-g32": dict(weights=dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)),
    "w4a16-g128": dict(weights=dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)),
    "w4a16-channel": dict(weights=dict(num_bits=4, type="int", symmetric=True, strategy="channel")),
    "w4a16-asym-channel": dict(weights=dict(num_bits=4, type="int", symmetric=False, strategy="channel")),
    "w4a16-tensor": dict(weights=dict(num_bits=4, type="int", symmetric=True, strategy="tensor")),
    "w8a16-g64": dict(weights=dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=64)),
    "w8a16-asym-channel": dict(weights=dict(num_bits=8, type="int", symmetric=False, strategy="channel")),
    "w8a16-asym-g32": dict(weights=dict(num_bits=8, type="int", symmetric=False, strategy="group", group_size=32)),
    "fp8-tensor": dict(weights=dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                       input_activations=dict(num_bits=8, type="float", symmetric=True, strategy="tensor")),
    "fp8-dynamic": dict(weights=dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                        input_activations=dict(num_bits=8, type="float", symmetric=True, strategy="token",
                                               dynamic=True)),
    "fp8-block": dict(weights=dict(num_bits=8, type="float", symmetric=True, strategy="block",
                                   block_structure=[128, 128]),
                      input_activations=dict(num_bits=8, type="float", symmetric=True, strategy="group",
                                             group_size=128, dynamic=True)),
    "int8-w8a8": dict(weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                      input_activations=_TOKEN_INT8),
    "int8-w8a8-asym": dict(weights=dict(num_bits=8, type="int", symmetric=False, strategy="channel"),
                           input_activations=_TOKEN_INT8),
    "int8-w8a8-asym-g128": dict(weights=dict(num_bits=8, type="int", symmetric=False, strategy="group",
                                             group_size=128), input_activations=_TOKEN_INT8),
}


def scheme(name: str, targets=("Linear",)):
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(targets=list(targets), **SCHEMES[name])


def config_dict(name: str, ignore=("lm_head",)) -> dict:
    """config.json's quantization_config of a one-group checkpoint of scheme `name` (the format the library infers
    for a Linear layer)."""
    from compressed_tensors.compressors.format import infer_module_format

    sch = scheme(name)
    group = sch.model_dump(exclude_none=True)
    group["format"] = infer_module_format(torch.nn.Linear, sch).value
    return {"quant_method": "compressed-tensors", "format": group["format"], "config_groups": {"group_0": group},
            "ignore": list(ignore)}


def read_layer(name: str, stored: dict[str, torch.Tensor], keep: bool = True,
               layer: str = "model.layers.0.mlp.down_proj"):
    """One layer's library-compressed tensors read back through voltllm's loader: its PackedWeight (keep) or its
    dequantized fp32 matrix."""
    from types import SimpleNamespace

    from voltllm.model.loader.compressed_tensors_checkpoint import ct_scheme, ct_weights

    hf_config = SimpleNamespace(model_type="qwen3", quantization_config=config_dict(name))
    out = dict(ct_weights(((f"{layer}.{p}", t) for p, t in stored.items()), ct_scheme(hf_config), keep))
    assert list(out) == [f"{layer}.weight"]
    return out[f"{layer}.weight"]


def calibrate(weight: torch.Tensor, args, fp16_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) of `weight` [N, K] for the weight QuantizationArgs: the library's calculate_qparams on the
    min / max of each tensor / row / group / block."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = weight.float()
    n, k = w.shape
    if args.strategy == "tensor":
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "group":
        g = w.reshape(n, k // args.group_size, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        bh, bw = args.block_structure
        lo = torch.empty(math.ceil(n / bh), math.ceil(k / bw))
        hi = torch.empty_like(lo)
        for i in range(lo.shape[0]):
            for j in range(lo.shape[1]):
                blk = w[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw]
                lo[i, j], hi[i, j] = blk.min(), blk.max()
    scale, zero = calculate_qparams(lo, hi, args)
    if fp16_scales and args.type == "int":
        scale = scale.to(torch.float16).to(scale.dtype)
    return scale.to(weight.dtype), zero


def compress_layer(weight: torch.Tensor, sch, fp16_scales: bool = True,
                   zero: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors (local names) as the library's compressor for the scheme's format writes them;
    `zero` overrides the calibrated zero points (asymmetric schemes)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format

    scale, zp = calibrate(weight, sch.weights, fp16_scales)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zp if zero is None else zero}
    fmt = infer_module_format(torch.nn.Linear, sch)
    return BaseCompressor.get_value_from_registry(fmt.value).compress(state, sch)


def decompress_layer(tensors: dict[str, torch.Tensor], sch) -> torch.Tensor:
    """The library's own decompression of one layer's tensors (in the scale's dtype)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format

    fmt = infer_module_format(torch.nn.Linear, sch)
    return BaseCompressor.get_value_from_registry(fmt.value).decompress(dict(tensors), sch)["weight"]


def quantize_model(path: str, name: str, ignore=("lm_head",), targets=("Linear",), fp16_scales: bool = True) -> None:
    """Rewrite the tiny transformers model at `path` (tests/tiny_models.make_model) in place as a compressed-tensors
    checkpoint of scheme `name`, through the library's model API: apply_quantization_config, scales set on the
    modules (calibrate), ModelCompressor.compress_model, save_pretrained, update_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    qc = QuantizationConfig(config_groups={"group_0": scheme(name, targets)}, ignore=list(ignore))
    apply_quantization_config(model, qc, show_progress=False)
    with torch.no_grad():
        for _, module in model.named_modules():
            sch = getattr(module, "quantization_scheme", None)
            if sch is None:
                continue
            scale, zero = calibrate(module.weight, sch.weights, fp16_scales)
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero)
            if hasattr(module, "input_scale"):  # a static activation scale (FP8 preset): dropped by voltllm
                module.input_scale.fill_(0.5)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)


def quantize_files(path: str, name: str, ignore=("lm_head",), targets=("Linear",)) -> None:
    """The same through the library's model-free API, tensor by tensor of the safetensors file (for checkpoints whose
    layers transformers holds as no Linear modules: qwen3_moe's per-expert projections): match_quantizable_tensors,
    the format's compressor, ModelCompressor.update_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from compressed_tensors.utils.match import match_quantizable_tensors
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    sch = scheme(name, targets)
    for module, tensor_name in list(match_quantizable_tensors(tensors, ignore=list(ignore), targets=list(targets))):
        if tensors[tensor_name].dim() != 2 or module.endswith("embed_tokens"):  # (conv kernels, embeddings)
            continue
        for part, t in compress_layer(tensors.pop(tensor_name), sch).items():
            tensors[f"{module}.{part}"] = t
    save_file(tensors, file, metadata={"format": "pt"})
    sch.format = infer_module_format(torch.nn.Linear, sch)
    qc = QuantizationConfig(config_groups={"group_0": sch}, ignore=list(ignore), format=sch.format.value,
                            quantization_status=QuantizationStatus.COMPRESSED)
    ModelCompressor(quantization_config=qc).update_config(path)


def decompressed_weights(path: str) -> dict[str, torch.Tensor]:
    """{name: fp32 tensor} of the checkpoint as the library's own model-free dequantizer gives it back (every
    quantized layer's `weight`, and the dense tensors as stored)."""
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    # (its name matching takes every `.weight` of a "Linear"-targeted format that stores a quantized layer's codes as
    # `weight` for a quantized one: the embeddings and the GDN conv kernels, never quantized here, are named ignored)
    ignore = ["re:.*embed_tokens$", "re:.*conv1d$"]
    return CompressedTensorsDequantizer(path, ignore=ignore, dtype=torch.float32).process(tensors)


def reference_model(ref_dir: str, path: str):
    """transformers' model of `ref_dir` (a copy of the unquantized model) after its weights file takes the
    library-decompressed weights of `path` (saved and loaded, so qwen3_moe's per-expert tensors are fused by
    transformers' own loading)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    file = os.path.join(ref_dir, "model.safetensors")
    tensors = load_file(file)
    tensors.update(decompressed_weights(path))
    save_file(tensors, file, metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


def quantization_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["quantization_config"]
