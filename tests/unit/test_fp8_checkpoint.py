"""FP8 (E4M3) weights (model/loader/fp8_checkpoint.py): block-wise, per-channel and per-tensor scales against the
tests' own quantizer (tests/quant_checkpoints.py), the FP8 planes bit for bit, the layouts the planes cannot hold,
quantization at load, the tensor stream and the config errors."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from quant_checkpoints import quantize_fp8

from voltllm.model.layers.gguf_planes import FP8_KIND, Planes, dequantize_planes
from voltllm.model.loader.fp8_checkpoint import (FP8CheckpointError, FP8Scheme, FP8Weight, QuantizeAtLoad,
                                                 fp8_scheme, fp8_weights)


def _w(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("n,k,block", [(200, 384, (128, 128)), (64, 256, None), (96, 256, (128, 256))])
def test_scales_and_planes(n, k, block):
    """Row counts that end inside a 128-row block; per-channel scales; a block of 256 inputs (two plane scales)."""
    codes, scales, deq = quantize_fp8(_w(n, k), block)
    w = FP8Weight.from_checkpoint(codes, scales, block)
    assert (w.out_features, w.in_features) == (n, k)
    assert torch.equal(w.dequantize(), deq)
    planes = w.to_weight(None, torch.float32)
    assert isinstance(planes, Planes) and planes.kind == FP8_KIND and planes.d.dtype == torch.float32
    assert torch.equal(dequantize_planes(planes), deq)


def test_per_tensor_scale():
    w = _w(64, 128)
    s = float(w.abs().max()) / 448
    codes = (w / s).to(torch.float8_e4m3fn)
    fw = FP8Weight.from_checkpoint(codes, torch.tensor(s), None)
    assert fw.block == (64, 128)
    assert torch.equal(dequantize_planes(fw.to_weight(None, torch.float32)), codes.float() * torch.tensor(s))


def test_layouts_the_planes_cannot_hold_are_dequantized():
    codes, scales, deq = quantize_fp8(_w(64, 192), (128, 128))  # 192 inputs: not whole 128-input scales
    dense = FP8Weight.from_checkpoint(codes, scales, (128, 128)).to_weight(None, torch.float16)
    assert isinstance(dense, torch.Tensor) and dense.dtype == torch.float16 and torch.equal(dense, deq.half())
    codes, scales, deq = quantize_fp8(_w(64, 256), (64, 64))  # blocks of 64 inputs
    assert torch.equal(FP8Weight.from_checkpoint(codes, scales, (64, 64)).to_weight(None, torch.float32), deq)


def test_quantize_at_load():
    w = _w(48, 384)
    w[0, :128] = 0  # an all-zero block: scale 1, codes 0
    q = FP8Weight.quantize(w)
    assert q.block == (1, 128) and q.scale[0, 0] == 1 and q.scale.shape == (48, 3)
    assert torch.equal(q.dequantize(), quantize_fp8(w, (1, 128))[2])
    err = (q.dequantize() - w).abs() / w.abs().clamp_min(1e-3)
    assert float(err.max()) <= 2 ** -4 + 1e-6  # E4M3: 3 mantissa bits, round to nearest
    lazy = QuantizeAtLoad(w)
    assert (lazy.out_features, lazy.in_features) == (48, 384)
    assert torch.equal(dequantize_planes(lazy.to_weight(None, torch.float32)), q.dequantize())


def test_stream():
    codes, scales, deq = quantize_fp8(_w(64, 128), (128, 128))
    stream = [("model.embed_tokens.weight", torch.ones(4, 8)), ("layers.0.q_proj.input_scale", torch.tensor(1.0)),
              ("layers.0.q_proj.weight", codes), ("layers.0.q_proj.weight_scale_inv", scales)]
    scheme = FP8Scheme((128, 128))
    kept = dict(fp8_weights(iter(stream), scheme, keep_quantized=True))
    assert set(kept) == {"model.embed_tokens.weight", "layers.0.q_proj.weight"}
    assert isinstance(kept["layers.0.q_proj.weight"], FP8Weight)
    assert torch.equal(dict(fp8_weights(iter(stream), scheme, keep_quantized=False))["layers.0.q_proj.weight"], deq)
    with pytest.raises(FP8CheckpointError, match="incomplete"):
        list(fp8_weights(iter(stream[:-1]), scheme, keep_quantized=True))
    at_load = dict(fp8_weights(iter([("model.layers.0.mlp.down_proj.weight", _w(64, 128)),
                                     ("model.embed_tokens.weight", torch.ones(4, 8))]),
                               FP8Scheme((1, 128), at_load=True), keep_quantized=True))
    assert isinstance(at_load["model.layers.0.mlp.down_proj.weight"], QuantizeAtLoad)
    assert isinstance(at_load["model.embed_tokens.weight"], torch.Tensor)


def test_schemes_and_errors():
    qwen = SimpleNamespace(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": [128, 128]})
    assert fp8_scheme(qwen) == FP8Scheme((128, 128))
    assert fp8_scheme(SimpleNamespace(quantization_config={"quant_method": "fp8"})) == FP8Scheme(None)
    assert fp8_scheme(SimpleNamespace(), "fp8") == FP8Scheme((1, 128), at_load=True)
    assert fp8_scheme(SimpleNamespace()) is None
    with pytest.raises(FP8CheckpointError, match="E4M3"):
        fp8_scheme(SimpleNamespace(quantization_config={"quant_method": "fp8", "fmt": "e5m2"}))
    codes, scales, _ = quantize_fp8(_w(64, 128), (128, 128))
    with pytest.raises(FP8CheckpointError, match="expected"):
        FP8Weight.from_checkpoint(codes, scales.repeat(2, 1), (128, 128))


def test_fp8_policy():
    from voltllm.config import ConfigError, _resolve_quantization

    llama, hybrid = SimpleNamespace(model_type="qwen3"), SimpleNamespace(model_type="qwen3_next")
    assert _resolve_quantization("fp8", "hf", llama) == "fp8"  # quantized at load
    with pytest.raises(ConfigError, match="llama / qwen2 / qwen3"):
        _resolve_quantization("fp8", "hf", hybrid)
    fp8 = SimpleNamespace(model_type="qwen3_next", quantization_config={"quant_method": "fp8"})
    assert _resolve_quantization(None, "hf", fp8) == "fp8"  # read (kept quantized on a GPU for a hybrid too)
    with pytest.raises(ConfigError, match="an FP8 checkpoint"):
        _resolve_quantization("awq", "hf", fp8)
    with pytest.raises(ConfigError, match="a GGUF file"):
        _resolve_quantization("fp8", "gguf", None)
