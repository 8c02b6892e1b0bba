"""GGUF weights kept quantized (model/layers/gguf_planes.py, quantized_linear.py, kernels/quant_gemv.py) on the CPU:
the device layout dequantizes bit for bit to the `gguf` package's values for every kept kind (random blocks,
quantized data, the real SmolLM2 file); the Triton kernels equal the torch reference under the interpreter;
a layer with shards of mixed kinds multiplies like its dense weight."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from interp_util import run_interp_checks

from voltllm.model.layers.quantized_linear import GGUFBlocks, QuantizedLinearMethod
from voltllm.model.layers.gguf_planes import (KINDS, dequantize_planes, from_planes, planes_from_blocks,
                                              random_blocks, supports)
from voltllm.model.layers.linear import Linear

gguf = pytest.importorskip("gguf")


def _gguf_dequant(raw: torch.Tensor, name: str, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]).reshape(raw.shape[0], k)


# bits per weight on the device: the format's own (plus 0.125 for Q4_K's / Q5_K's / IQ4_XS's sub-scales widened to
# int8); Q2_K's / Q3_K's codes in a 4-bit `lo`, with int8 scales (and mins) per 16, still far below fp16's 16
PLANE_BITS = {"Q4_0": 4.5, "Q4_1": 5, "Q8_0": 8.5, "Q5_0": 5.5, "Q5_1": 6, "Q5_K": 5.625, "Q4_K": 4.625,
              "Q6_K": 6.5625, "Q3_K": 4.5625, "Q2_K": 5.125, "IQ4_NL": 4.5, "IQ4_XS": 4.3125}


def test_kept_kinds():
    assert set(KINDS) == set(PLANE_BITS)
    for name in ("Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"):
        kind = KINDS[name]
        assert (kind.block, kind.block_bytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


@pytest.mark.parametrize("name", list(KINDS))
def test_random_blocks_dequantize_like_gguf(name):
    g = torch.Generator().manual_seed(3)
    n, k = 7, 1024
    raw = random_blocks(name, n, k, g)
    p = planes_from_blocks(raw, name, k)
    ours = dequantize_planes(p).numpy()
    assert ours.view(np.uint32).tolist() == _gguf_dequant(raw, name, k).astype(np.float32).view(np.uint32).tolist()
    assert p.nbytes * 8 / (n * k) == PLANE_BITS[name]
    assert torch.equal(from_planes(p).codes, from_planes(planes_from_blocks(raw, name, k)).codes)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantized_data_dequantizes_like_gguf(name):
    x = np.random.default_rng(0).standard_normal((5, 576)).astype(np.float32)
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType[name])
    raw = torch.from_numpy(np.ascontiguousarray(q))
    assert np.array_equal(dequantize_planes(planes_from_blocks(raw, name, 576)).numpy(), _gguf_dequant(raw, name, 576))


def test_real_smollm2_tensors(smollm2_gguf):
    reader = gguf.GGUFReader(smollm2_gguf)
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in KINDS and kind not in seen and t.data.shape[0] <= 4096:
            seen.add(kind)
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            k = int(t.shape[0])
            assert np.array_equal(dequantize_planes(planes_from_blocks(raw, kind, k)).numpy(),
                                  _gguf_dequant(raw, kind, k)), t.name
    assert seen == {"Q4_1"}  # (its Q8_0 tensor is the 49152-row embedding, checked by the random blocks above)


def test_supports():
    assert supports("Q4_K", 4096) and supports("Q4_0", 576)
    assert not supports("Q4_K", 576)  # 256-element blocks
    assert not supports("Q4_0", 96)  # no whole 64-element groups
    assert supports("Q5_K", 4096) and not supports("IQ3_XXS", 4096) and not supports("F16", 4096)
    assert supports("Q3_K", 4096) and supports("Q2_K", 4096) and supports("IQ4_XS", 4096)
    assert supports("IQ4_NL", 576) and not supports("Q3_K", 576)  # 32- / 256-element blocks


def test_dense_at_load_said_once_per_type(monkeypatch, caplog):
    """The loader keeps the kinds with planes; a quantized type without them (IQ3_XXS), or a kind whose rows are not
    whole blocks, is dequantized and said once per reason in the log (not per tensor); float types silently."""
    from voltllm.model.layers import quantized_linear
    from voltllm.model.loader.gguf_loader import _kept

    monkeypatch.setattr(quantized_linear, "_DENSE_REASONS_LOGGED", set())
    with caplog.at_level("WARNING", logger="voltllm"):
        assert _kept("Q3_K", 4096) and _kept("Q2_K", 4096) and _kept("IQ4_XS", 4096) and _kept("IQ4_NL", 576)
        assert not any(_kept(*c) for c in (("IQ3_XXS", 4096), ("IQ3_XXS", 512), ("Q3_K", 576), ("F16", 4096)))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "GGUF IQ3_XXS matrices (a type without a plane layout)" in msgs[0]
    assert "GGUF Q3_K matrices whose inputs are not a multiple of 256" in msgs[1]


def test_low_bit_blocks_by_hand():
    """One block of each low-bit type written field by field (llama.cpp's block_q3_K / block_q2_K / block_iq4_nl /
    block_iq4_xs), so a mistake shared by the re-layout and the `gguf` package's numpy code would show."""
    d = np.float16(0.5).tobytes()
    # Q3_K: element 0 (run 0, l 0): low2 3, hbit set -> q 3; element 33 (run 1, l 1): low2 1 (bits 2-3 of qs[1]),
    # hbit clear -> q -3; sub-block 0 scale 40 (- 32 = 8), sub-block 2 (elements 32..47) scale 1 (- 32 = -31)
    hmask, qs, sc = np.zeros(32, np.uint8), np.zeros(64, np.uint8), np.zeros(12, np.uint8)
    hmask[:] = 0xFD  # every hbit set except run 1's
    qs[0], qs[1] = 3, 1 << 2
    sc[0] = 40 & 15
    sc[8] = (40 >> 4) & 3  # sub-block 0's high bits: bits 0-1 of byte 8
    sc[2] = 1
    raw = torch.from_numpy(np.concatenate([hmask, qs, sc, np.frombuffer(d, np.uint8)]).reshape(1, -1))
    w = dequantize_planes(planes_from_blocks(raw, "Q3_K", 256))[0]
    assert (float(w[0]), float(w[33])) == (0.5 * 8 * 3, 0.5 * -31 * -3)
    # Q2_K: sub-block 1 (elements 16..31): scale 3, min 2; element 17 (run 0, l 17): q = 2
    scales, qs = np.zeros(16, np.uint8), np.zeros(64, np.uint8)
    scales[1] = 3 | (2 << 4)
    qs[17] = 2
    dmin = np.float16(0.25).tobytes()
    raw = torch.from_numpy(np.concatenate([scales, qs, np.frombuffer(d + dmin, np.uint8)]).reshape(1, -1))
    w = dequantize_planes(planes_from_blocks(raw, "Q2_K", 256))[0]
    assert (float(w[17]), float(w[16])) == (0.5 * 3 * 2 - 0.25 * 2, -0.25 * 2)
    # IQ4_NL: element 3 (low nibble of qs[3]) index 0 -> -127, element 19 (its high nibble) index 15 -> 113
    qs = np.full(16, 0x88, np.uint8)
    qs[3] = 0xF0
    raw = torch.from_numpy(np.tile(np.concatenate([np.frombuffer(d, np.uint8), qs]), 2).reshape(1, -1))
    w = dequantize_planes(planes_from_blocks(raw, "IQ4_NL", 64))[0]
    assert (float(w[3]), float(w[19]), float(w[0])) == (0.5 * -127, 0.5 * 113, 0.5 * 1)
    # IQ4_XS: sub-block 5 (elements 160..191): scale low nibble 9 (high nibble of scales_l[2]), high bits 2 (bits
    # 10-11 of scales_h) -> 41 - 32 = 9; element 161 (low nibble of qs[16 * 5 + 1]) index 14 -> 89
    sh, sl, qs = np.array([2 << 10], np.uint16), np.zeros(4, np.uint8), np.full(128, 0x88, np.uint8)
    sl[2] = 9 << 4
    qs[81] = 0x8E
    raw = torch.from_numpy(np.concatenate([np.frombuffer(d, np.uint8), sh.view(np.uint8), sl, qs]).reshape(1, -1))
    w = dequantize_planes(planes_from_blocks(raw, "IQ4_XS", 256))[0]
    assert (float(w[161]), float(w[160]), float(w[0])) == (0.5 * 9 * 89, 0.5 * 9 * 1, 0.5 * -32 * 1)


def _mixed_layer(bias: bool):
    """A qkv-like layer: Q4_K, Q4_K (merged into one segment), Q6_K, dense; and its dense fp32 weight."""
    g = torch.Generator().manual_seed(5)
    k, sizes = 512, [64, 32, 32, 48]
    layer = Linear(k, sizes, bias=bias, dtype=torch.float32, method=QuantizedLinearMethod())
    parts = []
    for i, (name, size) in enumerate(zip(["Q4_K", "Q4_K", "Q6_K", None], sizes)):
        if name is None:
            w = torch.randn(size, k, generator=g) * 0.02
            layer.load_weight(w, i)
        else:
            raw = random_blocks(name, size, k, g)
            layer.load_weight(GGUFBlocks(name, raw, size, k), i)
            w = dequantize_planes(planes_from_blocks(raw, name, k))
        parts.append(w)
    if bias:
        layer.bias.data.normal_(generator=g)
    return layer, torch.cat(parts)


@pytest.mark.parametrize("bias", [False, True])
def test_mixed_kind_layer(bias):
    layer, w = _mixed_layer(bias)
    assert [s.size for s in layer.gguf_segments] == [96, 32, 48]
    x = torch.randn(3, 2, 512)
    ref = x @ w.T + (layer.bias if bias else 0)
    assert torch.allclose(layer(x), ref, rtol=1e-5, atol=1e-5)


def test_large_matrix_dequantized_in_bands():
    """A matrix whose dequantized copy exceeds the workspace bound is multiplied band by band (same result)."""
    layer, w = _mixed_layer(True)
    x = torch.randn(9, 512)
    whole = layer(x)
    layer.method = QuantizedLinearMethod()
    layer.method.workspace_max_bytes = 7 * 512 * 4  # 7 rows of fp32: bands of 7 over the 96-row Q4_K segment
    assert torch.allclose(layer(x), whole, rtol=1e-5, atol=1e-6 * float(whole.abs().max()))
    assert torch.allclose(whole, x @ w.T + layer.bias, rtol=1e-5, atol=1e-6 * float(whole.abs().max()))


def test_layer_errors():
    layer = Linear(512, [64, 64], method=QuantizedLinearMethod())
    with pytest.raises(RuntimeError, match="before all its shards"):
        layer(torch.randn(1, 512))
    with pytest.raises(ValueError, match="expected"):
        layer.load_weight(GGUFBlocks("Q4_K", random_blocks("Q4_K", 32, 512), 32, 512), 0)
    layer.load_weight(GGUFBlocks("Q4_K", random_blocks("Q4_K", 64, 512), 64, 512), 0)
    with pytest.raises(RuntimeError, match="before all its shards"):
        layer(torch.randn(1, 512))


CHECK_SCRIPT = Path(__file__).parent / "_quant_gemv_interp_check.py"


def test_kernels_under_interpreter():
    results = run_interp_checks(CHECK_SCRIPT, timeout=300)
    from interp_util import check_names

    assert set(results) == set(check_names(CHECK_SCRIPT))
    bad = {k: v for k, v in results.items() if not v.startswith("ok")}
    assert not bad, bad


@pytest.fixture(scope="module")
def kept_smollm2(smollm2_gguf):
    """SmolLM2's model with its GGUF layers kept quantized (as planes), built once: the tests below only read it."""
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model
    from voltllm.model.models.registry import build_model

    src = resolve_model(smollm2_gguf)
    cfg = load_hf_config(src)
    model = build_model(cfg, torch.float32, 64, QuantizedLinearMethod())
    model.load_weights((n, t.float() if isinstance(t, torch.Tensor) else t) for n, t in iter_weights(src, cfg, True))
    return model


def test_start_up_tuners_skip_quantized_layers(kept_smollm2):
    """The decode GEMM tuners (CUDA only) pick their candidates from dense fp16 / bf16 layers: a GGUF model kept
    quantized offers none (its layers have no dense weight), where the tuner used to read `weight.shape`."""
    from voltllm.worker.skinny_tuning import _gated_pairs, _unquantized_groups

    model = kept_smollm2
    assert _gated_pairs(model) == [] and _unquantized_groups(model) == {}
    assert model.logits_weight is None and not model.fused_decode(torch.zeros(1, dtype=torch.long))


def test_quantized_weights_policy(monkeypatch, smollm2_gguf):
    """Kept quantized only on a GPU: always with --quantization, else "auto" (by size, in the runner); the CPU,
    unquantized checkpoints, random weights and architectures without quantized layers dequantize; a
    --quantization that is not the checkpoint's own method is refused."""
    import voltllm.config as config
    from voltllm.config import ConfigError, _quantized_weights, _resolve_quantization
    from voltllm.model.loader.gguf_loader import dense_bytes

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    llama, hybrid = SimpleNamespace(model_type="qwen3"), SimpleNamespace(model_type="qwen3_next")
    assert _quantized_weights("gguf", None, llama, cuda, "auto") == "auto"
    assert _quantized_weights("gguf", "gguf", llama, cuda, "auto") == "quantized"
    assert _quantized_weights("awq", "awq_marlin", llama, cuda, "auto") == "quantized"
    assert _quantized_weights("gguf", "gguf", llama, cpu, "auto") == "dequantized"
    assert _quantized_weights("gguf", None, llama, cuda, "dummy") == "dequantized"
    assert _quantized_weights(None, None, llama, cuda, "auto") == "dequantized"
    assert _quantized_weights("gptq", "gptq", hybrid, cuda, "auto") == "quantized"  # hybrids keep them too
    assert _quantized_weights("gptq", "gptq", SimpleNamespace(model_type="mamba"), cuda, "auto") == "dequantized"
    assert _resolve_quantization(None, "gguf", None) == "gguf"
    assert _resolve_quantization(None, "hf", llama) is None
    with pytest.raises(ConfigError, match="needs a .gguf"):
        _resolve_quantization("gguf", "hf", llama)
    with pytest.raises(ConfigError, match="not a quantized checkpoint"):
        _resolve_quantization("awq", "hf", llama)
    awq = SimpleNamespace(model_type="qwen3", quantization_config={"quant_method": "awq", "bits": 4})
    assert _resolve_quantization("awq_marlin", "hf", awq) == "awq"
    with pytest.raises(ConfigError, match="the model is an AWQ checkpoint"):
        _resolve_quantization("gptq", "hf", awq)
    with pytest.raises(ConfigError, match="'hqq': reading it is not built yet"):
        _resolve_quantization(None, "hf", SimpleNamespace(quantization_config={"quant_method": "hqq"}))
    gptq8 = SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 8})
    assert _resolve_quantization(None, "hf", gptq8) == _resolve_quantization("gptq_marlin", "hf", gptq8) == "gptq"
    with pytest.raises(ConfigError, match="3-bit"):
        _resolve_quantization(None, "hf", SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 3}))
    with pytest.raises(ConfigError, match="8-bit"):
        _resolve_quantization(None, "hf", SimpleNamespace(quantization_config={"quant_method": "awq", "bits": 8}))
    monkeypatch.setattr(config, "KEEP_QUANTIZED", 0)
    assert _quantized_weights("gguf", "gguf", llama, cuda, "auto") == "dequantized"
    monkeypatch.setattr(config, "KEEP_QUANTIZED", 1)
    assert _quantized_weights("gguf", None, llama, cuda, "auto") == "quantized"
    # SmolLM2-135M: 134.5M parameters (tied embeddings stored once) -> 269 MB in fp16
    assert dense_bytes(smollm2_gguf, 2) == 2 * 134_515_008


def test_quant_tile_choice():
    """The start-up tile timing (worker/quant_tuning.py): the fastest candidate that agrees with the default; one that
    disagrees or fails is never chosen; the default when nothing beats it."""
    from voltllm.worker.quant_tuning import choose, copies_needed

    times = {"a": 5.0, "b": 3.0, "c": 1.0, "d": 2.0}
    assert choose(["a", "b", "c", "d"], times.__getitem__, lambda c: c != "c") == ("d", 2.0, 5.0)

    def fails(cfg):
        if cfg == "d":
            raise RuntimeError("out of resources")
        return times[cfg]

    assert choose(["a", "b", "d"], fails, lambda c: True) == ("b", 3.0, 5.0)
    assert choose(["c", "a"], times.__getitem__, lambda c: True) == ("c", 1.0, 1.0)
    assert copies_needed(14 << 20) == 19 and copies_needed(1 << 30) == 1 and copies_needed(4096) == 32


def test_quant_tile_groups(kept_smollm2):
    from voltllm.worker.quant_tuning import planes_groups

    model = kept_smollm2
    # qkv, o, gate_up, down (Q4_1) and the tied LM head (the Q8_0 embeddings)
    assert set(planes_groups(model)) == {("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576),
                                         ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)}


def test_out_of_memory_while_loading_is_a_clear_error(monkeypatch, smollm2_gguf):
    """Kept-quantized weights are allocated while they load, after the model is built: running out of memory there
    is the same one-line error as at build time, not an allocator trace."""
    from voltllm import LLM
    from voltllm.model.models.llama import LlamaForCausalLM

    def no_memory(self, weights):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", no_memory)
    with pytest.raises(RuntimeError, match="weights do not fit on cpu"):
        LLM(smollm2_gguf, device="cpu", max_model_len=256)
