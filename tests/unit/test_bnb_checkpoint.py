"""The bitsandbytes codec and reader (voltllm/model/loader/bnb_codec.py, bnb_checkpoint.py): the NF4 / FP4 tables
against the values bitsandbytes' kernels hard-code, the packing worked by hand, dequantization against the format's
definition element by element (tests/bnb_checkpoints.py), double quantization, 8-bit rows, and the refusals (config,
tensors, flags)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from bnb_checkpoints import bnb_config, json_bytes, layer_4bit, reference_4bit

from voltllm.config import ConfigError, _check_bnb_load_format, _quantized_weights, _resolve_quantization
from voltllm.model.loader.bnb_checkpoint import BnbCheckpointError, BnbScheme, bnb_scheme, bnb_weights
from voltllm.model.loader.bnb_codec import (Bnb4bitState, dequantize_4bit, dequantize_int8, dynamic_map, normal_map,
                                            pack_codes, quantize_4bit, quantize_int8, table, unpack_codes)

# the QLoRA paper's NF4 values, as bitsandbytes' CUDA dequantization (dDequantizeNF4) writes them
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]
# bitsandbytes' FP4 decision tree (dDequantizeFP4Tree): codes 0..7, then the same negated
PUBLISHED_FP4 = [0.0, 5.208333333e-03, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25]


def test_tables_are_the_published_values():
    nf4 = table("nf4")
    assert torch.equal(nf4, torch.tensor(PUBLISHED_NF4, dtype=torch.float32))
    assert torch.equal(normal_map(), nf4)  # the normal quantiles, computed: the same fp32 values
    fp4 = torch.tensor(PUBLISHED_FP4, dtype=torch.float32)
    assert torch.equal(table("fp4"), torch.cat([fp4, -fp4]))
    dyn = dynamic_map()
    assert dyn.numel() == 256 and len(set(dyn.tolist())) == 256 and torch.equal(dyn, dyn.sort().values)
    assert dyn[0] == -dyn[-2] and dyn[-1] == 1.0 and 0.0 in dyn.tolist()
    assert dyn[dyn > 0].min().item() == pytest.approx(0.55e-6)  # the finest step: 10^-6 x the midpoint of [0.1, 1]
    with pytest.raises(ValueError, match="int4"):
        table("int4")


def test_packing_worked_by_hand():
    assert pack_codes(torch.tensor([15, 0, 7, 8, 3], dtype=torch.uint8)).reshape(-1).tolist() == [0xF0, 0x78, 0x30]
    assert unpack_codes(torch.tensor([[0xF0], [0x78], [0x30]], dtype=torch.uint8), 5).tolist() == [15, 0, 7, 8, 3]
    # one block: the absmax is the largest magnitude, each element the nearest table value (a tie: the lower one)
    w = torch.tensor([[2.0, -2.0, 0.0, 1.0, 0.0795 * 2, 0.03979014977812767 * 2]])
    packed, state = quantize_4bit(w, "nf4", double_quant=False)
    assert state.absmax.tolist() == [2.0]
    # 1.0 / 2 -> 0.4407 (code 12) is nearer than 0.5626; 0.0398 is the midpoint of codes 7 (0) and 8: the lower
    assert unpack_codes(packed, 6).tolist() == [15, 0, 7, 12, 8, 7]
    assert dequantize_4bit(packed, state).tolist()[0][:3] == [2.0, -2.0, 0.0]
    packed, _ = quantize_4bit(torch.tensor([[6.0, -3.0, 0.0, -0.0]]), "fp4", double_quant=False)
    assert unpack_codes(packed, 4).tolist() == [3, 13, 0, 0]  # 6 / 6 = 1.0 (code 3); -0.5 is code 8 + 5


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_equals_the_format_definition(quant_type, double_quant, dtype):
    # 37 x 50: the flattened blocks of 64 straddle rows and the last one is partial; 29 blocks -> one nested block
    w = (torch.randn(37, 50, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype)
    tensors = layer_4bit("x.weight", w, quant_type, double_quant)
    assert tensors["x.weight"].shape == (37 * 25, 1) and tensors["x.weight"].dtype == torch.uint8
    assert ("x.weight.nested_absmax" in tensors) == double_quant
    (name, got), = bnb_weights(tensors.items(), BnbScheme(4), {"x.weight"})
    assert name == "x.weight" and got.dtype == dtype and got.shape == (37, 50)
    assert torch.equal(got.float(), reference_4bit(tensors, "x.weight"))
    scale = w.float().abs().max()
    assert (got.float() - w.float()).abs().max() < (0.3 if quant_type == "fp4" else 0.2) * scale


def test_double_quantization_keeps_the_block_absmax_close():
    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(2))
    _, plain = quantize_4bit(w, "nf4", double_quant=False)
    packed, nested = quantize_4bit(w, "nf4", double_quant=True)
    from voltllm.model.loader.bnb_codec import block_absmax

    assert nested.absmax.dtype == torch.uint8 and nested.nested.absmax.numel() == -(-1200 // 256)
    assert nested.nested.offset == pytest.approx(plain.absmax.mean().item())
    assert torch.allclose(block_absmax(nested), plain.absmax, rtol=0.02)


def test_quant_storage_of_another_dtype_is_read_as_its_bytes():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tensors = layer_4bit("x.weight", w, "nf4", True, storage=torch.bfloat16)
    assert tensors["x.weight"].dtype == torch.bfloat16
    (_, got), = bnb_weights(tensors.items(), BnbScheme(4), {"x.weight"})
    assert torch.equal(got.float(), reference_4bit(tensors, "x.weight"))


def test_int8_rows():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    codes, scb = quantize_int8(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127 and torch.equal(scb, w.abs().amax(1))
    stream = [("l.weight", codes), ("l.SCB", scb), ("l.weight_format", torch.tensor(0, dtype=torch.uint8)),
              ("l.bias", torch.ones(8))]
    got = dict(bnb_weights(stream, BnbScheme(8), set()))
    assert set(got) == {"l.weight", "l.bias"}
    assert torch.equal(got["l.weight"], dequantize_int8(codes, scb))
    assert got["l.weight"][0, 0].item() == pytest.approx(codes[0, 0].item() * scb[0].item() / 127, rel=1e-6)
    assert (got["l.weight"] - w).abs().max() <= scb.max() / 254 * 1.001


def test_reader_refusals():
    w = torch.randn(4, 64)
    good = layer_4bit("x.weight", w, "nf4", True)

    def read(tensors, scheme=BnbScheme(4)):
        return list(bnb_weights(tensors.items(), scheme, {"x.weight"}))

    with pytest.raises(BnbCheckpointError, match="not bitsandbytes' nf4 table"):
        read({**good, "x.weight.quant_map": table("fp4")})
    with pytest.raises(BnbCheckpointError, match="incomplete in the checkpoint"):
        read({k: v for k, v in good.items() if k != "x.weight.nested_absmax"})
    with pytest.raises(BnbCheckpointError, match="quant_type 'fp4' under"):
        key = "x.weight.quant_state.bitsandbytes__nf4"
        read({**good, key: json_bytes({"quant_type": "fp4", "blocksize": 64, "dtype": "float32", "shape": [4, 64]})})
    with pytest.raises(BnbCheckpointError, match="shape"):
        key = "x.weight.quant_state.bitsandbytes__nf4"
        read({**good, key: json_bytes({"quant_type": "nf4", "blocksize": 64, "dtype": "int8", "shape": [4, 64]})})
    with pytest.raises(BnbCheckpointError, match="not in a .safetensors"):
        list(bnb_weights(good.items(), BnbScheme(4), set()))
    stream = [("l.weight", torch.zeros(2, 4, dtype=torch.int8)), ("l.SCB", torch.ones(2)),
              ("l.weight_format", torch.tensor(2, dtype=torch.uint8))]
    with pytest.raises(BnbCheckpointError, match="'col_turing' tile layout"):
        list(bnb_weights(stream, BnbScheme(8), set()))
    with pytest.raises(BnbCheckpointError, match="incomplete"):
        list(bnb_weights(stream[:1], BnbScheme(8), set()))


def test_quantization_config_and_flags():
    four, eight = (SimpleNamespace(model_type="qwen3", quantization_config=bnb_config(b)) for b in (4, 8))
    llama, hybrid = SimpleNamespace(model_type="llama"), SimpleNamespace(model_type="qwen3_next")
    assert bnb_scheme(four) == BnbScheme(4) and bnb_scheme(eight) == BnbScheme(8)
    assert bnb_scheme(llama, "bitsandbytes") == BnbScheme(4, at_load=True) and bnb_scheme(llama) is None
    # the method is read from the checkpoint (the flag is optional, as in vLLM); at load it needs the flag
    assert _resolve_quantization(None, "hf", four) == _resolve_quantization("bitsandbytes", "hf", eight) == \
        "bitsandbytes"
    assert _resolve_quantization("bitsandbytes", "hf", llama) == "bitsandbytes"
    assert _resolve_quantization(None, "hf", llama) is None
    with pytest.raises(ConfigError, match="exactly one of them"):
        _resolve_quantization(None, "hf", SimpleNamespace(quantization_config={"quant_method": "bitsandbytes"}))
    with pytest.raises(ConfigError, match="--quantization awq: the model is a bitsandbytes checkpoint"):
        _resolve_quantization("awq", "hf", four)
    with pytest.raises(ConfigError, match="--quantization bitsandbytes: the model is a GGUF file"):
        _resolve_quantization("bitsandbytes", "gguf", None)
    with pytest.raises(ConfigError, match="--quantization bitsandbytes quantizes the projections at load for the "
                                          "llama .* not 'qwen3_next'"):
        _resolve_quantization("bitsandbytes", "hf", hybrid)
    _check_bnb_load_format("bitsandbytes", "bitsandbytes")
    _check_bnb_load_format("auto", None)
    with pytest.raises(ConfigError, match="--load-format bitsandbytes reads bitsandbytes checkpoints .* not quantized"):
        _check_bnb_load_format("bitsandbytes", None)
    with pytest.raises(ConfigError, match="quantized with 'awq'"):
        _check_bnb_load_format("bitsandbytes", "awq")
    # 4-bit and 8-bit layers are kept quantized on a GPU (with the flag; else by size), also quantized at load; the
    # CPU dequantizes
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _quantized_weights("bitsandbytes", "bitsandbytes", four, gpu, "auto") == "quantized"
    assert _quantized_weights("bitsandbytes", None, four, gpu, "auto") == "auto"
    assert _quantized_weights("bitsandbytes", "bitsandbytes", llama, gpu, "auto") == "quantized"
    assert _quantized_weights("bitsandbytes", "bitsandbytes", eight, gpu, "auto") == "quantized"
    assert _quantized_weights("bitsandbytes", None, eight, gpu, "auto") == "auto"
    assert _quantized_weights("bitsandbytes", "bitsandbytes", eight, cpu, "auto") == "dequantized"
    assert _quantized_weights("bitsandbytes", "bitsandbytes", four, cpu, "auto") == "dequantized"


def test_state_sizes_are_checked():
    packed, state = quantize_4bit(torch.randn(4, 64), "nf4", double_quant=False)
    tensors = {"x.weight": packed[:-1], "x.weight.absmax": state.absmax, "x.weight.quant_map": table("nf4"),
               "x.weight.quant_state.bitsandbytes__nf4": json_bytes(
                   {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [4, 64]})}
    with pytest.raises(BnbCheckpointError, match="127 packed bytes"):
        list(bnb_weights(tensors.items(), BnbScheme(4), {"x.weight"}))
    assert isinstance(state, Bnb4bitState)


def test_kept_quantized_planes_and_their_refusals(caplog, monkeypatch):
    """A 4-bit layer kept quantized: planes of its kind (codes re-laid, fp16 absmax: 4.25 bits per weight) whose
    values are the codec's up to the absmax's fp16 rounding; layouts the planes cannot hold come dense (bitsandbytes'
    own dequantization), said once per reason in the log."""
    from voltllm.model.layers.gguf_planes import Planes, bnb_kind, dequantize_planes
    from voltllm.model.loader.bnb_checkpoint import Bnb4bitWeight

    import voltllm.model.layers.quantized_linear as quantized_linear

    monkeypatch.setattr(quantized_linear, "_DENSE_REASONS_LOGGED", set())  # (each reason is logged once a process)
    cpu = torch.device("cpu")
    w = torch.randn(6, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    for quant_type, blocksize, double_quant in (("nf4", 64, True), ("fp4", 128, False)):
        packed, state = quantize_4bit(w, quant_type, blocksize, double_quant=double_quant)
        p = Bnb4bitWeight(packed, state).to_weight(cpu, torch.float16)
        assert isinstance(p, Planes) and p.kind == bnb_kind(quant_type, blocksize) and p.d.dtype == torch.float16
        assert p.nbytes * 8 / w.numel() == 4 + 16 / blocksize
        ref = dequantize_4bit(packed, state)
        torch.testing.assert_close(dequantize_planes(p), ref, rtol=2 ** -11, atol=0)
    with pytest.raises(ValueError, match="blocks of 64 / 128"):
        bnb_kind("nf4", 256)
    cases = {"blocks of 256": (w, 256), "not a multiple of 64": (w[:, :96].contiguous(), 64),
             "beyond fp16's range": (w * 1e7, 64)}
    for reason, (x, blocksize) in cases.items():
        packed, state = quantize_4bit(x, "nf4", blocksize, double_quant=False)
        with caplog.at_level("WARNING", logger="voltllm"):
            got = Bnb4bitWeight(packed, state).to_weight(cpu, torch.float32)
        assert isinstance(got, torch.Tensor) and torch.equal(got, dequantize_4bit(packed, state))
        assert reason in caplog.text


def test_dense_size_and_tensor_parallel_multiple(tmp_path):
    """The "auto" policy's dequantized size of a 4-bit or 8-bit checkpoint equals the unquantized model's;
    row-parallel cuts fall on whole 64-input groups (4-bit blocks of 128: checked per layer at load; 8-bit rows: the
    scale repeated per 64 inputs)."""
    from bnb_checkpoints import quantize_bnb_checkpoint
    from tiny_models import make_model

    from voltllm.distributed.support import _column_multiple
    from voltllm.model.loader.bnb_checkpoint import dense_bytes
    from voltllm.model.loader.safetensors_loader import stored_elements

    path = make_model(str(tmp_path / "m"), "qwen3", hidden_size=128, intermediate_size=256, head_dim=32)
    elements = stored_elements(path, lambda name, n: n)
    quantize_bnb_checkpoint(path, str(tmp_path / "ref"), storage=torch.bfloat16)
    assert dense_bytes(path, 2) == 2 * elements
    four, eight = (SimpleNamespace(model_type="qwen3", quantization_config=bnb_config(b)) for b in (4, 8))
    assert _column_multiple(four, "bitsandbytes") == (64, "bitsandbytes 4-bit")
    assert _column_multiple(SimpleNamespace(model_type="qwen3"), "bitsandbytes") == (64, "bitsandbytes 4-bit")
    assert _column_multiple(eight, "bitsandbytes") == (64, "bitsandbytes 8-bit")
    path8 = make_model(str(tmp_path / "m8"), "qwen3", hidden_size=128, intermediate_size=256, head_dim=32)
    quantize_bnb_checkpoint(path8, str(tmp_path / "ref8"), bits=8)
    assert dense_bytes(path8, 2) == 2 * elements  # (SCB and weight_format are not weights)


def test_int8_kept_quantized_planes_and_their_refusals(caplog, monkeypatch):
    """An 8-bit layer kept quantized: planes of 8-bit GPTQ's symmetric kind (codes q + 128, the row's SCB / 127 in
    fp16 repeated per 64 inputs: 8.25 bits per weight) whose values are exactly q * fp16(SCB / 127), so bitsandbytes'
    q * SCB / 127 up to one fp16 rounding of the scale; an all-zero row stays zero; layouts the planes cannot hold
    come dense (bitsandbytes' own dequantization), said once per reason in the log."""
    from voltllm.model.layers.gguf_planes import Planes, dequantize_planes, int8_kind
    from voltllm.model.loader.bnb_checkpoint import BNB8_KIND, Bnb8bitWeight

    import voltllm.model.layers.quantized_linear as quantized_linear

    monkeypatch.setattr(quantized_linear, "_DENSE_REASONS_LOGGED", set())  # (each reason is logged once a process)
    cpu = torch.device("cpu")
    assert BNB8_KIND == int8_kind(64, zero_points=False) and BNB8_KIND.zero == 128 and not BNB8_KIND.zero_points
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = (torch.randn(7, 256, generator=g) * torch.logspace(-2, 1, 7)[:, None]).to(dtype)
        w[3] = 0  # an all-zero row: SCB 0
        codes, scb = quantize_int8(w)
        p = Bnb8bitWeight(codes, scb).to_weight(cpu, torch.float16)
        assert isinstance(p, Planes) and p.kind == BNB8_KIND and p.d.dtype == torch.float16
        assert p.nbytes * 8 / w.numel() == 8.25
        got = dequantize_planes(p)
        # exactly the integer times the fp16-rounded scale (an 8-bit integer times an 11-bit significand: exact)
        scale16 = (scb.double() / 127).to(torch.float16).float()
        assert torch.equal(got, codes.float() * scale16[:, None])
        ref = dequantize_int8(codes, scb)  # what the dequantized load gives (fp32)
        assert torch.equal(got[3], torch.zeros(256)) and torch.equal(ref[3], torch.zeros(256))
        nz = ref != 0
        assert float(((got - ref).abs()[nz] / ref.abs()[nz]).max()) <= 2 ** -11 * (1 + 2 ** -10)
        assert torch.equal(got == 0, ref == 0)
        # against today's dequantized fp16 weights: within one fp16 rounding of the weight and one of the scale
        ref16 = ref.to(torch.float16).float()
        assert float(((got - ref16).abs()[nz] / ref.abs()[nz]).max()) <= 2 ** -10 * (1 + 2 ** -9)
    cases = {"not a multiple of 64": torch.randn(4, 96, generator=g),
             "below fp16's normal range": torch.randn(4, 128, generator=g) * torch.tensor([1, 1, 1e-3, 1])[:, None],
             "beyond fp16's range": torch.randn(4, 128, generator=g) * 1e7}
    for reason, x in cases.items():
        codes, scb = quantize_int8(x)
        with caplog.at_level("WARNING", logger="voltllm"):
            got = Bnb8bitWeight(codes, scb).to_weight(cpu, torch.float32)
        assert isinstance(got, torch.Tensor) and torch.equal(got, dequantize_int8(codes, scb))
        assert reason in caplog.text


def test_int8_reader_keeps_layers_quantized():
    """With keep_quantized the 8-bit reader gathers a layer's int8 weight and SCB into a Bnb8bitWeight (whatever the
    order they come in); without it, the fp32 dequantized weight as before. Dense tensors pass through."""
    from voltllm.model.loader.bnb_checkpoint import Bnb8bitWeight

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(6))
    codes, scb = quantize_int8(w)
    stream = [("l.SCB", scb), ("l.weight_format", torch.tensor(0, dtype=torch.uint8)), ("l.weight", codes),
              ("lm_head.weight", w)]
    kept = dict(bnb_weights(stream, BnbScheme(8), set(), keep_quantized=True))
    assert set(kept) == {"l.weight", "lm_head.weight"} and kept["lm_head.weight"] is w
    q = kept["l.weight"]
    assert isinstance(q, Bnb8bitWeight) and (q.out_features, q.in_features) == (8, 64)
    assert torch.equal(q.codes, codes) and torch.equal(q.scb, scb)
    assert torch.equal(q.dequantize(), dequantize_int8(codes, scb))
    dense = dict(bnb_weights(stream, BnbScheme(8), set()))
    assert torch.equal(dense["l.weight"], dequantize_int8(codes, scb))
