"""4-bit AWQ / GPTQ and 8-bit GPTQ checkpoints (model/loader/int4_checkpoint.py): the unpacking against words worked
out by hand from the formats' definitions and against the tests' own loop packers (tests/quant_checkpoints.py), the
planes of the int4 / int8 kinds, act-order groups, the tensor stream, and the config errors."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from quant_checkpoints import pack_awq, pack_gptq, quantize_rtn

from voltllm.model.layers.gguf_planes import Planes, dequantize_planes
from voltllm.model.loader.int4_checkpoint import (Int4CheckpointError, Int4Scheme, Int4Weight, int4_scheme,
                                                  int4_weights)

AWQ = Int4Scheme("awq", 32, desc_act=False, zero_offset=0)
GPTQ = Int4Scheme("gptq", 32, desc_act=False, zero_offset=1)
GPTQ8 = Int4Scheme("gptq", 32, desc_act=False, zero_offset=1, bits=8)


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def test_awq_word_by_hand():
    """AutoAWQ: nibble i holds column AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7; columns 0..7 = codes 1..8 put
    1, 3, 5, 7, 2, 4, 6, 8 in nibbles 0..7: the word 0x86427531."""
    qweight = torch.tensor([[_int32(0x86427531)]] * 32, dtype=torch.int32)  # K = 32 rows, N = 8 columns
    qzeros = torch.tensor([[_int32(0x00000021)]], dtype=torch.int32)  # zeros 1, 0, 2, 0, ... (columns 0, 2 <- 1, 2)
    w = Int4Weight(AWQ, qweight, qzeros, torch.ones(1, 8, dtype=torch.float16), None)
    codes, scales, zeros = w.unpack()
    assert (w.out_features, w.in_features) == (8, 32)
    assert codes[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert zeros[:, 0].tolist() == [1, 0, 2, 0, 0, 0, 0, 0]


def test_gptq_word_by_hand():
    """GPTQ: qweight packs 8 inputs per word in order (input 8r + i in nibble i); qzeros 8 outputs in order, v1
    storing zero - 1."""
    qweight = torch.tensor([[_int32(0x87654321)] * 8] * 4, dtype=torch.int32)  # K = 32, N = 8
    qzeros = torch.tensor([[_int32(0x7777777F)]], dtype=torch.int32)
    w = Int4Weight(GPTQ, qweight, qzeros, torch.ones(1, 8, dtype=torch.float16), torch.arange(32) // 32)
    codes, _, zeros = w.unpack()
    assert codes[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert zeros[:, 0].tolist() == [16, 8, 8, 8, 8, 8, 8, 8]


def test_gptq8_word_by_hand():
    """8-bit GPTQ: 4 inputs per qweight word in order (input 4r + i in byte i); qzeros 4 outputs per word in order,
    v1 storing zero - 1 (a stored 255 reads 256, no wrap: the 4-bit rule)."""
    qweight = torch.tensor([[_int32(0xFF807F01)] * 4] * 8, dtype=torch.int32)  # K = 32, N = 4
    qzeros = torch.tensor([[_int32(0x7F00FF7F)]], dtype=torch.int32)
    w = Int4Weight(GPTQ8, qweight, qzeros, torch.ones(1, 4, dtype=torch.float16), torch.arange(32) // 32)
    assert (w.out_features, w.in_features) == (4, 32)
    codes, _, zeros = w.unpack()
    assert codes[0, :8].tolist() == [1, 127, 128, 255] * 2
    assert zeros[:, 0].tolist() == [128, 256, 1, 128]


def _random(n=48, k=192, group=32, symmetric=False, g_idx=None, seed=0, bits=4):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    return quantize_rtn(w, group, symmetric, g_idx, bits)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 192])
def test_gptq8_round_trip_and_planes(symmetric, group):
    """8-bit GPTQ layers become int8 planes (Q8_0's code layout, an fp16 scale per group; asymmetric ones the zero
    minus 128 per group in `mn`, symmetric ones the fixed zero 128) that dequantize to the checkpoint's values bit
    for bit: fp32 d * (q - zero)."""
    codes, scales, zeros, deq = _random(group=group, symmetric=symmetric, bits=8)
    assert int(codes.max()) > 15  # really 8-bit codes
    w = Int4Weight(Int4Scheme("gptq", group, False, 1, bits=8),
                   **pack_gptq(codes, zeros, scales, torch.arange(192) // group, bits=8))
    got_codes, got_scales, got_zeros = w.unpack()
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
    assert torch.equal(got_zeros.long(), zeros)
    ref = (codes.float() - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
    assert torch.equal(w.dequantize(), ref) and torch.equal(ref, deq)
    planes = w.to_weight(None, torch.float32)
    assert isinstance(planes, Planes) and planes.kind.name == f"INT8_G{group}" + ("" if symmetric else "_ZP")
    assert planes.kind.hi_bits == 4 and planes.kind.zero == 128 and planes.kind.super == group
    assert (planes.mn is None) == symmetric
    assert torch.equal(dequantize_planes(planes), deq)


def test_gptq8_extreme_zero_points():
    """Zeros 1 and 255 (int8's -127 / 127 in `mn`) stay planes; a v1 field of 255 (zero 256) does not fit the int8
    zero plane, so that layer is dequantized at load, with the zero as read (256)."""
    codes = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    scales = torch.full((8, 2), 0.01, dtype=torch.float16)
    zeros = torch.tensor([[1, 255]] * 8)
    w = Int4Weight(GPTQ8, **pack_gptq(codes, zeros, scales, torch.arange(64) // 32, bits=8))
    ref = (codes.float() - zeros.float().repeat_interleave(32, 1)) * scales.float().repeat_interleave(32, 1)
    planes = w.to_weight(None, torch.float32)
    assert isinstance(planes, Planes) and planes.mn.tolist() == [[-127, 127]] * 8
    assert torch.equal(dequantize_planes(planes), ref)
    over = Int4Weight(GPTQ8, **pack_gptq(codes, zeros + 1, scales, torch.arange(64) // 32, bits=8))
    dense = over.to_weight(None, torch.float32)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, ref - scales.float().repeat_interleave(32, 1))


def test_gptq8_act_order_dequantizes_at_load():
    g_idx = (torch.arange(192) // 32)[torch.randperm(192, generator=torch.Generator().manual_seed(3))]
    codes, scales, zeros, deq = _random(g_idx=g_idx, bits=8)
    w = Int4Weight(Int4Scheme("gptq", 32, True, 1, bits=8), **pack_gptq(codes, zeros, scales, g_idx, bits=8))
    dense = w.to_weight(None, torch.float32)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, deq)


def test_dense_bytes_counts_codes_per_word(tmp_path):
    """The dequantized size from the headers: a qweight word is 8 weights at 4 bits, 4 at 8 bits."""
    import json

    from safetensors.torch import save_file

    from voltllm.model.loader.int4_checkpoint import dense_bytes

    for bits, per in ((4, 8), (8, 4)):
        save_file({"l.qweight": torch.zeros(64 // per, 32, dtype=torch.int32), "l.qzeros": torch.zeros(2, 32 // per,
                   dtype=torch.int32), "l.scales": torch.zeros(2, 32, dtype=torch.float16), "norm": torch.zeros(10)},
                  str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq",
                                                                                  "bits": bits}}))
        assert dense_bytes(str(tmp_path), 2) == 2 * (64 * 32 + 10)


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("group", [32, 64, 192])
def test_round_trip_and_planes(method, group):
    codes, scales, zeros, deq = _random(group=group)
    if method == "awq":
        w = Int4Weight(Int4Scheme("awq", group, False, 0), **pack_awq(codes, zeros, scales), g_idx=None)
    else:
        w = Int4Weight(Int4Scheme("gptq", group, False, 1), **pack_gptq(codes, zeros, scales, torch.arange(192) // group))
    got_codes, got_scales, got_zeros = w.unpack()
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
    assert torch.equal(got_zeros.long(), zeros)
    assert torch.equal(w.dequantize(), deq)  # exact: fp16 scale times a small integer
    planes = w.to_weight(None, torch.float32)
    assert isinstance(planes, Planes) and planes.kind.zero_points and planes.kind.super == group
    assert torch.equal(dequantize_planes(planes), deq)


def test_symmetric_gptq_drops_the_zero_plane():
    codes, scales, zeros, deq = _random(symmetric=True)
    w = Int4Weight(GPTQ, **pack_gptq(codes, zeros, scales, torch.arange(192) // 32))
    planes = w.to_weight(None, torch.float32)
    assert not planes.kind.zero_points and planes.kind.zero == 8 and planes.mn is None
    assert torch.equal(dequantize_planes(planes), deq)


def test_act_order_groups_dequantize_at_load():
    """GPTQ desc_act: g_idx assigns inputs to groups out of order; the planes cannot hold that, so the layer
    gets its dense matrix (each input with its own group's scale and zero)."""
    g_idx = (torch.arange(192) // 32)[torch.randperm(192, generator=torch.Generator().manual_seed(3))]
    codes, scales, zeros, deq = _random(g_idx=g_idx)
    w = Int4Weight(Int4Scheme("gptq", 32, True, 1), **pack_gptq(codes, zeros, scales, g_idx))
    dense = w.to_weight(None, torch.float32)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, deq)


def test_stream_gathers_layers_and_passes_the_rest():
    codes, scales, zeros, deq = _random()
    parts = pack_gptq(codes, zeros, scales, torch.arange(192) // 32)
    stream = [("model.norm.weight", torch.ones(4))] + [(f"layers.0.q_proj.{p}", t) for p, t in parts.items()]
    scheme = Int4Scheme("gptq", 32, False, 1)
    kept = dict(int4_weights(iter(stream), scheme, keep_quantized=True))
    assert set(kept) == {"model.norm.weight", "layers.0.q_proj.weight"}
    assert isinstance(kept["layers.0.q_proj.weight"], Int4Weight)
    dense = dict(int4_weights(iter(stream), scheme, keep_quantized=False))
    assert torch.equal(dense["layers.0.q_proj.weight"], deq)
    with pytest.raises(Int4CheckpointError, match="incomplete"):
        list(int4_weights(iter(stream[:-2]), scheme, keep_quantized=True))


def test_mismatched_tensors_are_refused():
    codes, scales, zeros, _ = _random()
    parts = pack_awq(codes, zeros, scales)
    with pytest.raises(Int4CheckpointError, match="disagree"):
        Int4Weight(AWQ, parts["qweight"], parts["qzeros"], parts["scales"][:-1], None)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "8-bit"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM packing"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "format"),
])
def test_unread_variants_are_named(qc, message):
    with pytest.raises(Int4CheckpointError, match=message):
        int4_scheme(SimpleNamespace(quantization_config=qc))


def test_schemes():
    awq = int4_scheme(SimpleNamespace(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128,
                                                           "zero_point": True, "version": "GEMM"}))
    assert awq == Int4Scheme("awq", 128, False, 0)
    gptq = int4_scheme(SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": -1,
                                                            "desc_act": True, "checkpoint_format": "gptq_v2"}))
    assert gptq == Int4Scheme("gptq", -1, True, 0) and gptq.group(4096) == 4096
    # Qwen's *-GPTQ-Int8 config (v1 format: no checkpoint_format)
    qwen8 = int4_scheme(SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 8, "group_size": 128,
                                                             "desc_act": False, "sym": True}))
    assert qwen8 == Int4Scheme("gptq", 128, False, 1, bits=8) and qwen8.per_word == 4
    assert int4_scheme(SimpleNamespace()) is None
    assert int4_scheme(SimpleNamespace(quantization_config={"quant_method": "fp8"})) is None
