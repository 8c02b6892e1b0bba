"""NVFP4 weights (model/loader/nvfp4_checkpoint.py): the E2M1 and E4M3 decodes worked by hand for every code (and the
kernels' fp16-bit reading of them), a layer worked by hand, the NVFP4 planes against the format's definition (the
tests' own quantizer and packer, tests/quant_checkpoints.py) bit for bit for both producers, merged shards with
different global scales, the tensor stream, the size estimate and the config errors."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from quant_checkpoints import nvfp4_config, nvfp4_layer, pack_nvfp4, quantize_nvfp4

from voltllm.model.layers.gguf_planes import NVFP4_KIND, Planes, dequantize_planes, e2m1_values, e4m3_values
from voltllm.model.loader.nvfp4_checkpoint import (NVFP4CheckpointError, NVFP4Scheme, NVFP4Weight, nvfp4_scheme,
                                                   nvfp4_weights)

# code -> value, by hand: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal (m * 0.5)
E2M1_BY_HAND = {0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5, 0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0,
                0b0111: 6.0, 0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5, 0b1100: -2.0, 0b1101: -3.0,
                0b1110: -4.0, 0b1111: -6.0}
# E4M3 (bias 7, no infinities): subnormals m * 2^-9, normals 2^(e - 7) * (1 + m / 8), 0x7E the largest
E4M3_BY_HAND = {0x00: 0.0, 0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x30: 0.5, 0x38: 1.0, 0x3C: 1.5,
                0x3F: 1.875, 0x40: 2.0, 0x55: 2.0 ** 3 * 1.625, 0x7E: 448.0, 0x80: -0.0, 0x81: -(2.0 ** -9),
                0xB8: -1.0, 0xFE: -448.0}


def _fp16_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).to(torch.int16).view(torch.float16).to(torch.float32)


def test_e2m1_codes_by_hand():
    codes = torch.tensor(list(E2M1_BY_HAND), dtype=torch.uint8)
    want = torch.tensor(list(E2M1_BY_HAND.values()))
    got = e2m1_values(codes)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    # the kernels read a code as fp16 bits (exponent and mantissa at bits 11-9, sign at 15): value / 2^14, exactly,
    # the subnormal 0.5 (0b0001 -> fp16 subnormal 2^-15) included
    c = codes.to(torch.int32)
    assert torch.equal(_fp16_bits(((c & 7) << 9) | ((c & 8) << 12)) * 2.0 ** 14, want)


def test_e4m3_scales_by_hand():
    codes = torch.tensor(list(E4M3_BY_HAND), dtype=torch.uint8)
    want = torch.tensor(list(E4M3_BY_HAND.values()))
    assert torch.equal(e4m3_values(codes), want)
    assert torch.equal(e4m3_values(codes.view(torch.int8)), want)  # the `sc` plane holds the bits as int8
    # the kernels read the sign-extended int8 as fp16 bits (exponent and mantissa moved up 7 bits): value / 2^8
    c = codes.view(torch.int8).to(torch.int32)
    assert torch.equal(_fp16_bits(((c & 0x7F) << 7) | ((c & 0x80) << 8)) * 256.0, want)


def test_layer_worked_by_hand():
    """One row of 64 inputs: byte j = (code of input 2j + 1) << 4 | code of input 2j; group 0's scale 0x38 (1.0),
    group 1's 0x30 (0.5), group 2's 0x01 (2^-9), group 3's 0x40 (2.0); ModelOpt's global 0.25 multiplies,
    compressed-tensors' 4.0 divides (the same weights)."""
    packed = torch.zeros(1, 32, dtype=torch.uint8)
    packed[0, 0] = 0x21  # input 0: code 1 (0.5), input 1: code 2 (1.0)
    packed[0, 1] = 0xF7  # input 2: 6.0, input 3: -6.0
    packed[0, 8] = 0x9B  # group 1, inputs 16 / 17: -1.5, -0.5
    packed[0, 16] = 0x05  # group 2, input 32: 3.0
    packed[0, 31] = 0xE0  # group 3, input 63: -4.0
    scale = torch.tensor([[0x38, 0x30, 0x01, 0x40]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = torch.zeros(1, 64)
    want[0, :4] = torch.tensor([0.5, 1.0, 6.0, -6.0]) * 1.0 * 0.25
    want[0, 16:18] = torch.tensor([-1.5, -0.5]) * 0.5 * 0.25
    want[0, 32] = 3.0 * 2.0 ** -9 * 0.25
    want[0, 63] = -4.0 * 2.0 * 0.25
    for g, divides in ((torch.tensor(0.25), False), (torch.tensor([4.0]), True)):
        w = NVFP4Weight.from_checkpoint(packed, scale, g, divides)
        assert (w.out_features, w.in_features) == (1, 64)
        assert torch.equal(w.dequantize(), want)
        planes = w.to_weight(None, torch.float32)
        assert isinstance(planes, Planes) and planes.kind == NVFP4_KIND and torch.equal(dequantize_planes(planes), want)


@pytest.mark.parametrize("producer", ["modelopt_fp4", "compressed-tensors"])
@pytest.mark.parametrize("n,k", [(40, 256), (24, 320), (8, 1024)])  # 320: the last 256-input global span is partial
def test_planes_equal_the_definition(producer, n, k):
    """The tests' quantizer and packer (written from the format) -> NVFP4Weight: dequantize() and the planes' torch
    reference equal code * scale * multiplier rounded once to fp32, bit for bit; 4.625 bits per weight."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05
    w[0, :16] = 0  # an all-zero group
    w[1, 5] = 1.0  # an outlier, and a row of tiny weights: their groups' E4M3 scales are subnormal
    w[2] *= 1e-4
    tensors, deq = nvfp4_layer(w, producer)
    scheme = NVFP4Scheme("modelopt" if producer == "modelopt_fp4" else "compressed-tensors")
    nw = NVFP4Weight.from_checkpoint(tensors[scheme.weight_part], tensors["weight_scale"],
                                     tensors[scheme.global_part], scheme.global_divides)
    assert bool((tensors["weight_scale"][2].view(torch.uint8) < 8).all()) and bool(deq[2].abs().max() > 0)
    assert torch.equal(nw.dequantize(), deq)
    planes = nw.to_weight(None, torch.float16)
    assert isinstance(planes, Planes) and planes.d.dtype == torch.float32 and planes.sc.dtype == torch.int8
    assert torch.equal(dequantize_planes(planes), deq)
    assert planes.nbytes * 8 == n * (k * 4 + k // 16 * 8 + -(-k // 256) * 32)
    if k % 256 == 0:
        assert planes.nbytes * 8 / (n * k) == 4.625


def test_compressed_tensors_division_within_one_rounding():
    """compressed-tensors' own dequantization divides each group's scale by the global scale; taking the reciprocal
    once (vLLM, here) differs from code * scale / G rounded once by at most one fp32 unit in the last place."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.03
    codes, scales, stored, deq = quantize_nvfp4(w, "compressed-tensors")
    exact = (e2m1_values(codes).double() * e4m3_values(scales).double().repeat_interleave(16, 1)
             / float(stored)).float()
    ulp = torch.nextafter(exact.abs(), torch.tensor(float("inf"))) - exact.abs()
    assert bool(((deq - exact).abs() <= ulp).all())


def test_inputs_the_planes_cannot_hold_are_dequantized():
    w = torch.randn(16, 48) * 0.05  # 48 inputs: whole groups of 16, not of 64
    tensors, deq = nvfp4_layer(w, "modelopt_fp4")
    nw = NVFP4Weight.from_checkpoint(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"], False)
    dense = nw.to_weight(None, torch.float16)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, deq.half())


def test_merged_shards_keep_their_global_scales():
    """q / k / v shards quantized with different global scales stack into one NVFP4 segment (each row keeps its own
    global) whose product equals the dense matrices'."""
    from voltllm.model.layers.linear import Linear
    from voltllm.model.layers.quantized_linear import QuantizedLinearMethod

    gen = torch.Generator().manual_seed(5)
    ws = [torch.randn(n, 128, generator=gen) * s for n, s in ((64, 0.02), (32, 0.2), (32, 1.0))]
    layer = Linear(128, [64, 32, 32], method=QuantizedLinearMethod())
    deqs = []
    for i, w in enumerate(ws):
        tensors, deq = nvfp4_layer(w, "modelopt_fp4")
        deqs.append(deq)
        layer.load_weight(NVFP4Weight.from_checkpoint(tensors["weight"], tensors["weight_scale"],
                                                      tensors["weight_scale_2"], False), i)
    segs = layer.gguf_segments
    assert len(segs) == 1 and segs[0].weight.kind == NVFP4_KIND and len(set(segs[0].weight.d[:, 0].tolist())) == 3
    x = torch.randn(3, 128, generator=gen)
    torch.testing.assert_close(layer(x), x @ torch.cat(deqs).T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("producer", ["modelopt_fp4", "compressed-tensors"])
def test_tensor_stream(producer):
    scheme = NVFP4Scheme("modelopt" if producer == "modelopt_fp4" else "compressed-tensors")
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    tensors, deq = nvfp4_layer(w, producer)
    dense_o = torch.randn(64, 32)
    stream = [(f"model.layers.0.self_attn.q_proj.{p}", t) for p, t in tensors.items()]
    stream += [("model.layers.0.self_attn.o_proj.weight", dense_o),  # an ignored layer: dense
               ("model.layers.0.self_attn.k_proj.k_scale", torch.tensor(0.5))]  # a KV-cache scale: passes
    kept = dict(nvfp4_weights(iter(stream), scheme, keep_quantized=True))
    assert set(kept) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                         "model.layers.0.self_attn.k_proj.k_scale"}  # the activation scale is dropped
    assert isinstance(kept["model.layers.0.self_attn.q_proj.weight"], NVFP4Weight)
    assert kept["model.layers.0.self_attn.o_proj.weight"] is dense_o
    dense = dict(nvfp4_weights(iter(stream), scheme, keep_quantized=False))
    assert torch.equal(dense["model.layers.0.self_attn.q_proj.weight"], deq)
    with pytest.raises(NVFP4CheckpointError, match="incomplete"):
        list(nvfp4_weights(iter(stream[:2]), scheme, keep_quantized=True))
    with pytest.raises(NVFP4CheckpointError, match="pre_quant_scale"):
        list(nvfp4_weights(iter([("model.layers.0.mlp.down_proj.pre_quant_scale", torch.ones(64))]), scheme, True))
    with pytest.raises(NVFP4CheckpointError, match="expected"):
        NVFP4Weight.from_checkpoint(tensors[scheme.weight_part], tensors["weight_scale"][:, :2],
                                    tensors[scheme.global_part], False)


def test_dense_bytes(tmp_path):
    from safetensors.torch import save_file

    from voltllm.model.loader.nvfp4_checkpoint import dense_bytes

    tensors, _ = nvfp4_layer(torch.randn(32, 64) * 0.05, "modelopt_fp4")
    out = {f"model.layers.0.mlp.up_proj.{p}": t for p, t in tensors.items()}
    out["lm_head.weight"] = torch.zeros(10, 64, dtype=torch.bfloat16)
    save_file(out, str(tmp_path / "model.safetensors"))
    assert dense_bytes(str(tmp_path), 2) == 2 * (32 * 64 + 10 * 64)


def _cfg(qc):
    return SimpleNamespace(model_type="qwen3", quantization_config=qc)


def test_schemes_and_errors():
    assert nvfp4_scheme(_cfg(nvfp4_config("modelopt_fp4", []))) == NVFP4Scheme("modelopt")
    assert nvfp4_scheme(_cfg(nvfp4_config("compressed-tensors", []))) == NVFP4Scheme("compressed-tensors")
    legacy = {"quant_method": "modelopt", "producer": {"name": "modelopt"},
              "quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    assert nvfp4_scheme(_cfg(legacy)).method == "modelopt_fp4"
    assert nvfp4_scheme(_cfg({"quant_method": "awq"})) is None and nvfp4_scheme(SimpleNamespace()) is None
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}
    assert nvfp4_scheme(_cfg(int4)) is None  # compressed_tensors_checkpoint.py reads it
    bad = {
        "quant_algo 'FP8'": {"quant_method": "modelopt", "quant_algo": "FP8"},
        "group_size 32": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32},
        "format 'mxfp4-pack-quantized'": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                           "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                                                     "group_size": 32}}}},
        "without config_groups": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
        "sparsity_config": {**nvfp4_config("compressed-tensors", []), "sparsity_config": {"format": "sparse-24"}},
    }
    for message, qc in bad.items():
        with pytest.raises(NVFP4CheckpointError, match=message):
            nvfp4_scheme(_cfg(qc))


def test_quantization_flag_must_name_the_checkpoint():
    from voltllm.config import ConfigError, _resolve_quantization

    modelopt, ct = _cfg(nvfp4_config("modelopt_fp4", [])), _cfg(nvfp4_config("compressed-tensors", []))
    assert _resolve_quantization(None, "hf", modelopt) == "modelopt_fp4"
    assert _resolve_quantization("modelopt_fp4", "hf", modelopt) == "modelopt_fp4"
    assert _resolve_quantization("modelopt", "hf", modelopt) == "modelopt_fp4"
    assert _resolve_quantization("compressed-tensors", "hf", ct) == "compressed-tensors"
    with pytest.raises(ConfigError, match="the model is a compressed-tensors checkpoint"):
        _resolve_quantization("modelopt_fp4", "hf", ct)
    with pytest.raises(ConfigError, match="the model is a ModelOpt NVFP4 checkpoint"):
        _resolve_quantization("awq", "hf", modelopt)
    with pytest.raises(ConfigError, match="not a quantized checkpoint"):
        _resolve_quantization("modelopt_fp4", "hf", SimpleNamespace(model_type="qwen3"))
    with pytest.raises(ConfigError, match="only NVFP4"):
        _resolve_quantization(None, "hf", _cfg({"quant_method": "modelopt", "quant_algo": "FP8"}))
