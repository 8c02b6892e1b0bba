"""compressed-tensors int4 / int8 / FP8 checkpoints (model/loader/compressed_tensors_checkpoint.py) against the
compressed-tensors library itself: layers compressed by its own compressors (pack-quantized, float-quantized,
int-quantized; group / channel / tensor / block strategies, symmetric or not) read back by voltllm equal the library's
own decompression, dequantized and as planes; the config groups' targets / ignore matching; the tensor stream; the
refusals; the --quantization check, the dequantized size and the tensor-parallel cut rule."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ct_checkpoints import SCHEMES, compress_layer, config_dict, decompress_layer, read_layer, scheme

from voltllm.model.layers.gguf_planes import Planes, dequantize_planes
from voltllm.model.loader.compressed_tensors_checkpoint import (CTCheckpointError, CTScheme, Int8Weight,
                                                                ct_scheme, ct_weights)
from voltllm.model.loader.fp8_checkpoint import FP8Weight
from voltllm.model.loader.int4_checkpoint import Int4Weight

# the plane kind each scheme's layers are kept as (None: dequantized at load)
KEPT = {"w4a16-asym-g32": "INT4_G32_ZP", "w4a16-g128": "INT4_G128", "w4a16-channel": "INT4_G256",
        "w4a16-asym-channel": "INT4_G256_ZP", "w4a16-tensor": "INT4_G256", "w8a16-g64": "Q8_0",
        "w8a16-asym-channel": "INT8_G64_ZP", "w8a16-asym-g32": "INT8_G32_ZP", "fp8-tensor": "FP8_E4M3",
        "fp8-dynamic": "FP8_E4M3", "fp8-block": "FP8_E4M3", "int8-w8a8": "Q8_0", "int8-w8a8-asym": "INT8_G64_ZP",
        "int8-w8a8-asym-g128": "INT8_G128_ZP"}
TYPES = {"w4a16": Int4Weight, "w8a16": Int8Weight, "int8": Int8Weight, "fp8": FP8Weight}


def _config(name: str) -> dict:
    return config_dict(name)


def _cfg(qc: dict):
    return SimpleNamespace(model_type="qwen3", quantization_config=qc)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_layers_equal_the_library_decompression(name):
    """48 x 256 (fp32 weights): voltllm's dequantized matrix equals the library's decompression exactly, and so do
    the planes it is kept as (or the dense matrix where the planes cannot hold the layout)."""
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    sch = scheme(name)
    stored = compress_layer(w, sch)
    ref = decompress_layer(stored, sch)
    packed = read_layer(name, stored)
    assert isinstance(packed, TYPES[name.partition("-")[0]])
    assert (packed.out_features, packed.in_features) == (48, 256)
    assert torch.equal(packed.dequantize(), ref)
    assert torch.equal(read_layer(name, stored, keep=False), ref)
    kept = packed.to_weight(None, torch.float32)
    if KEPT[name] is None:
        assert isinstance(kept, torch.Tensor) and torch.equal(kept, ref)
    else:
        assert isinstance(kept, Planes) and kept.kind.name == KEPT[name]
        assert torch.equal(dequantize_planes(kept), ref)


@pytest.mark.parametrize("name", ["w4a16-asym-g32", "w8a16-g64", "fp8-block", "int8-w8a8", "w8a16-asym-g32",
                                  "int8-w8a8-asym"])
def test_bf16_checkpoint_one_rounding(name):
    """A bf16 layer (bf16 scales: fp16 holds them exactly, so int layers stay planes): the library decompresses in
    bf16, one rounding of the exact product; voltllm's fp32 product rounded to bf16 is the same."""
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 0.05).to(torch.bfloat16)
    sch = scheme(name)
    stored = compress_layer(w, sch, fp16_scales=False)
    assert stored["weight_scale"].dtype == torch.bfloat16
    ref = decompress_layer(stored, sch)
    packed = read_layer(name, stored)
    assert torch.equal(packed.dequantize(torch.bfloat16), ref)
    kept = packed.to_weight(None, torch.bfloat16)
    assert isinstance(kept, Planes) and torch.equal(dequantize_planes(kept).to(torch.bfloat16), ref)


def test_layouts_the_planes_cannot_hold_are_dequantized_with_a_log_line(caplog):
    """fp32 scales fp16 cannot hold, inputs not a multiple of 64 (a padded last word: K = 100 with 4-bit codes) and
    int8 groups of 16 come back dense, equal to the library's decompression, with one line per reason."""
    import voltllm.model.layers.quantized_linear as ql

    ql._DENSE_REASONS_LOGGED.clear()
    gen = torch.Generator().manual_seed(3)
    cases = [("w4a16-g128", torch.randn(32, 256, generator=gen), dict(fp16_scales=False), "fp16 cannot hold"),
             ("w4a16-channel", torch.randn(32, 100, generator=gen), {}, "inputs not a multiple of 64")]
    for name, w, kw, words in cases:
        sch = scheme(name)
        stored = compress_layer(w * 0.05, sch, **kw)
        with caplog.at_level("WARNING", logger="voltllm"):
            kept = read_layer(name, stored).to_weight(None, torch.float32)
        assert isinstance(kept, torch.Tensor) and torch.equal(kept, decompress_layer(stored, sch))
        assert words in caplog.text
    int8 = Int8Weight(torch.randint(-128, 128, (8, 64), dtype=torch.int8), torch.rand(8, 4), None, None, 16)
    assert isinstance(int8.to_weight(None, torch.float32), torch.Tensor) and "groups of 16" in caplog.text
    zero = torch.randint(-128, 128, (8, 8), dtype=torch.int8)  # zero points in groups of 8: no int8 kind holds them
    asym = Int8Weight(torch.randint(-128, 128, (8, 64), dtype=torch.int8), torch.rand(8, 8), zero, None, 8)
    kept = asym.to_weight(None, torch.float32)
    assert isinstance(kept, torch.Tensor) and torch.equal(kept, asym.dequantize())
    assert "zero points in groups of 8 inputs (not a multiple of 16)" in caplog.text


def test_asymmetric_int8_planes_by_hand():
    """int8 with zero points kept as the int8 planes: mn is the signed zero point itself (codes q + 128, ZERO 128),
    every (q, zero) pair of int8 gives d * (q - zero) exactly; one scale per row is repeated per 64 inputs (channel),
    a checkpoint's groups of 16 stay groups of 16."""
    q = torch.arange(-128, 128, dtype=torch.int8).repeat(256, 1)  # [256, 256]: every code on every row
    zero = torch.arange(-128, 128, dtype=torch.int8)[:, None]  # row r: zero r - 128, every zero point once
    scale = torch.full((256, 1), 0.5).to(torch.float16)
    per_row = Int8Weight(q, scale, zero, None, 256)
    p = per_row.to_weight(None, torch.float32)
    assert isinstance(p, Planes) and p.kind.name == "INT8_G64_ZP" and p.kind.zero == 128
    assert p.d.shape == p.mn.shape == (256, 4) and torch.equal(p.mn[:, 0], zero[:, 0])
    want = (q.float() - zero.float()) * 0.5
    assert torch.equal(dequantize_planes(p), want) and torch.equal(per_row.dequantize(), want)
    grouped = Int8Weight(q, scale.repeat(1, 16), zero.repeat(1, 16), None, 16)
    g = grouped.to_weight(None, torch.float32)
    assert g.kind.name == "INT8_G16_ZP" and torch.equal(dequantize_planes(g), want)


def test_packed_words_by_hand():
    """pack-quantized int4: word j of a row holds inputs 8j .. 8j + 7 in nibbles 0 .. 7, each q + 8; the zero
    points are packed the same way down the outputs. Inputs 0..7 = q -8..-1 (stored 0..7) -> word 0x76543210; zero
    points of rows 0..7 = -8, -7, 0, 0, ... (stored 0, 1, 8, 8, ...)."""
    qweight = torch.tensor([[0x76543210] + [0x77777777] * 7] * 8, dtype=torch.int32)  # N = 8, K = 64 (one group)
    qzeros = torch.tensor([[0x88888810 - (1 << 32)]], dtype=torch.int32)  # (the word as int32)
    stored = {"weight_packed": qweight, "weight_scale": torch.ones(8, 1), "weight_shape": torch.tensor([8, 64]),
              "weight_zero_point": qzeros}
    w = read_layer("w4a16-asym-channel", stored)
    codes, _, zeros = w.unpack()
    assert codes[0, :8].tolist() == list(range(8)) and codes[0, 8:].eq(7).all()
    assert zeros[:, 0].tolist() == [0, 1, 8, 8, 8, 8, 8, 8]
    deq = w.dequantize()
    assert deq[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7] and deq[1, :8].tolist() == list(range(-1, 7))
    assert deq[2, :8].tolist() == list(range(-8, 0))


def test_act_order_groups():
    """An act-order ("group") layer stores weight_g_idx, each input's group: the dense matrix takes each input's own
    group's scale and zero, and the planes (which need groups in input order) give way to it."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(4)
    n, k, g = 16, 128, 32
    g_idx = (torch.arange(k) // g)[torch.randperm(k, generator=gen)]
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    zp = torch.randint(-8, 8, (n, k // g), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // g, generator=gen).to(torch.float16).float()
    stored = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([n, k]),
              "weight_zero_point": pack_to_int32(zp, 4, packed_dim=0), "weight_g_idx": g_idx.to(torch.int32)}
    qc = _config("w4a16-asym-g32")
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    out = dict(ct_weights(((f"x.{p}", t) for p, t in stored.items()), ct_scheme(_cfg(qc)), True))
    want = (q.float() - zp.float()[:, g_idx]) * scale[:, g_idx]
    assert torch.equal(out["x.weight"].dequantize(), want)
    assert torch.equal(out["x.weight"].to_weight(None, torch.float32), want)


def test_targets_ignore_and_formats():
    """An exact name beats a regex, a regex beats a class name; the ignore list wins over all; several groups may
    carry different formats (mixed-precision)."""
    int4, fp8 = _config("w4a16-g128")["config_groups"]["group_0"], _config("fp8-dynamic")["config_groups"]["group_0"]
    qc = {"quant_method": "compressed-tensors", "format": "mixed-precision", "ignore": ["lm_head", "re:.*mlp.gate$"],
          "config_groups": {"a": {**int4, "targets": ["Linear"]}, "b": {**fp8, "targets": ["re:.*down_proj$"]},
                            "c": {**int4, "targets": ["model.layers.1.mlp.down_proj"]}}}
    s = ct_scheme(_cfg(qc))
    assert isinstance(s, CTScheme)
    assert s.weights_for("model.layers.0.self_attn.q_proj").name == "a"
    assert s.weights_for("model.layers.0.mlp.down_proj").name == "b"
    assert s.weights_for("model.layers.1.mlp.down_proj").name == "c"
    assert s.weights_for("model.layers.0.mlp.gate") is None and s.weights_for("lm_head") is None
    assert "int4 (groups of 128)" in s.describe() and "FP8 E4M3 (per channel)" in s.describe()


def test_stream_passes_drops_and_renames():
    """Dense tensors pass through, activation scales are dropped, a k / v projection's output scale becomes the
    attention's KV-cache scale; a late g_idx in input order is ignored."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    stored = compress_layer(w, scheme("fp8-tensor"))
    stream = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.ones(4, 4))]
    stream += [(f"model.layers.0.self_attn.k_proj.{p}", t) for p, t in stored.items()]
    stream += [("model.layers.0.self_attn.k_proj.input_scale", torch.tensor([0.5])),
               ("model.layers.0.self_attn.k_proj.output_scale", torch.tensor([0.25])),
               ("model.layers.0.self_attn.v_proj.output_scale", torch.tensor([0.125]))]
    out = dict(ct_weights(stream, ct_scheme(_cfg(_config("fp8-tensor"))), True))
    attn = "model.layers.0.self_attn"
    assert sorted(out) == ["lm_head.weight", f"{attn}.k_proj.weight", f"{attn}.k_scale", f"{attn}.v_scale",
                           "model.norm.weight"]
    assert float(out["model.layers.0.self_attn.v_scale"]) == 0.125
    packed = compress_layer(w, scheme("w4a16-g128"))
    late = [(f"x.{p}", t) for p, t in packed.items()] + [("x.weight_g_idx", torch.arange(128) // 128)]
    assert list(dict(ct_weights(late, ct_scheme(_cfg(_config("w4a16-g128"))), True))) == ["x.weight"]


def test_stream_errors():
    fp8 = ct_scheme(_cfg(_config("fp8-tensor")))
    stored = compress_layer(torch.randn(64, 128) * 0.05, scheme("fp8-tensor"))
    with pytest.raises(CTCheckpointError, match="incomplete"):  # a scale beside a dense weight
        list(ct_weights([("x.weight", torch.ones(2, 2)), ("x.weight_scale", torch.ones(1))], fp8, True))
    with pytest.raises(CTCheckpointError, match="no config group targets it"):
        list(ct_weights([(f"lm_head.{p}", t) for p, t in stored.items()], fp8, True))
    with pytest.raises(CTCheckpointError, match="output activation quantization"):
        list(ct_weights([("model.layers.0.mlp.down_proj.output_scale", torch.ones(1))], fp8, True))
    int4 = ct_scheme(_cfg(_config("w4a16-g128")))
    with pytest.raises(CTCheckpointError, match="stored as weight but its config group"):
        list(ct_weights([(f"x.{p}", t) for p, t in stored.items()], int4, True))


def test_config_refusals_and_nvfp4_hand_off():
    from quant_checkpoints import nvfp4_config

    from voltllm.model.loader.nvfp4_checkpoint import NVFP4CheckpointError, nvfp4_scheme

    assert ct_scheme(_cfg({"quant_method": "awq"})) is None and ct_scheme(SimpleNamespace()) is None
    assert ct_scheme(_cfg(nvfp4_config("compressed-tensors", []))) is None  # NVFP4: nvfp4_checkpoint's
    assert nvfp4_scheme(_cfg(_config("w4a16-g128"))) is None
    int4 = _config("w4a16-g128")

    def with_weights(**w):
        g = int4["config_groups"]["group_0"]
        return {**int4, "config_groups": {"group_0": {**g, "weights": {**g["weights"], **w}}}}

    bad = {
        "without config_groups": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
        "3-bit int weights": with_weights(num_bits=3),
        "dynamic weight quantization": with_weights(dynamic=True),
        "'marlin-24'": {**int4, "format": "marlin-24", "config_groups": {"group_0": {
            **int4["config_groups"]["group_0"], "format": "marlin-24"}}},
        "sparsity_config of format 'sparse-24-bitmask'": {**int4, "sparsity_config": {"format": "sparse-24-bitmask"}},
        "transform_config": {**int4, "transform_config": {"config_groups": {"u": {}}}},
        "asymmetric float": {**_config("fp8-dynamic"), "config_groups": {"group_0": {
            **_config("fp8-dynamic")["config_groups"]["group_0"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": False}}}},
    }
    for message, qc in bad.items():
        with pytest.raises(CTCheckpointError, match=message):
            ct_scheme(_cfg(qc))
    mixed = {**int4, "config_groups": {**int4["config_groups"],
                                       "fp4": nvfp4_config("compressed-tensors", [])["config_groups"]["group_0"]}}
    with pytest.raises(CTCheckpointError, match="mixing NVFP4"):
        ct_scheme(_cfg(mixed))
    mx = {**int4, "format": "mxfp4-pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}, "targets": ["Linear"]}}}
    with pytest.raises(NVFP4CheckpointError, match="only NVFP4"):
        nvfp4_scheme(_cfg(mx))
    assert ct_scheme(_cfg({**int4, "sparsity_config": {"format": "dense"}})) is not None


def test_quantization_flag_and_config_errors():
    from voltllm.config import ConfigError, _resolve_quantization

    ct = _cfg(_config("w4a16-g128"))
    assert _resolve_quantization(None, "hf", ct) == "compressed-tensors"
    assert _resolve_quantization("compressed-tensors", "hf", ct) == "compressed-tensors"
    with pytest.raises(ConfigError, match="the model is a compressed-tensors checkpoint"):
        _resolve_quantization("awq", "hf", ct)
    with pytest.raises(ConfigError, match="3-bit int weights"):
        _resolve_quantization(None, "hf", _cfg({**_config("w4a16-g128"), "config_groups": {"group_0": {
            "format": "pack-quantized", "weights": {"num_bits": 3, "type": "int", "group_size": 128}}}}))


def test_tensor_parallel_cut_rule():
    """Weights kept quantized split over ranks only at whole groups: int4 groups of 128 with 64 inputs per rank are
    refused, channel-wise int4 always; int8 (Q8_0 planes; with zero points one scale per row, repeated per 64) cuts at
    64 inputs, int8 with zero points in groups at whole groups, FP8 at 128."""
    from voltllm.distributed.support import quantized_split_error

    def err(name, head_dim=32):  # o_proj: 4 heads x head_dim inputs, split over 2 ranks
        cfg = SimpleNamespace(model_type="qwen3", hidden_size=256, num_attention_heads=4, head_dim=head_dim,
                              intermediate_size=512, quantization_config=_config(name))
        return quantized_split_error(2, cfg, "compressed-tensors")

    assert "groups of 128" in err("w4a16-g128")
    assert err("w4a16-asym-g32") is None
    assert "span all its inputs" in err("w4a16-channel")
    assert err("int8-w8a8") is None and err("int8-w8a8-asym") is None and err("w8a16-asym-g32") is None
    assert "groups of 128" in err("int8-w8a8-asym-g128") and err("int8-w8a8-asym-g128", head_dim=64) is None
    assert "FP8" in err("fp8-dynamic") and err("fp8-dynamic", head_dim=64) is None


def test_dense_bytes(tmp_path):
    """The dequantized size counted from config.json and the safetensors headers: a packed int32 word is 8 int4
    weights (4 int8 ones); scales, zero points and shapes count nothing."""
    import json

    from safetensors.torch import save_file

    from voltllm.model.loader.compressed_tensors_checkpoint import dense_bytes

    stored = compress_layer(torch.randn(48, 256) * 0.05, scheme("w4a16-asym-g32"))
    save_file({**{f"x.{p}": t for p, t in stored.items()}, "norm.weight": torch.ones(10)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": _config("w4a16-asym-g32")}))
    assert dense_bytes(str(tmp_path), 2) == 2 * (48 * 256 + 10)
