"""GGUF loading: the real SmolLM2 file against transformers' own GGUF loader, and tiny synthetic
llama / qwen2 / qwen3 files written here against the HF weights they were made from."""

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import writer_with_header  # noqa: E402

from voltllm.model.loader.gguf_loader import gguf_config, gguf_weights  # noqa: E402

CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                 "bos_token_id", "eos_token_id", "model_type")


def _assert_config_matches(ours, ref):
    assert type(ours) is type(ref)
    for field in CONFIG_FIELDS:
        default = ref.hidden_size // ref.num_attention_heads if field == "head_dim" else None  # Qwen2Config has none
        assert getattr(ours, field) == getattr(ref, field, default), field
    # GGUF keeps floats as float32; compare at that precision
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours.rope_parameters["rope_theta"] == pytest.approx(ref.rope_parameters["rope_theta"], rel=1e-6)
    assert ours.rope_parameters["rope_type"] == ref.rope_parameters["rope_type"]


def test_smollm2_matches_transformers(smollm2_gguf, smollm2_transformers):
    ref_model = smollm2_transformers
    config = gguf_config(smollm2_gguf)
    _assert_config_matches(config, ref_model.config)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) == ("llama", 30, 576, 9, 3, 64, 49152)
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-5

    ref = ref_model.state_dict()
    ours = dict(gguf_weights(smollm2_gguf, config))
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied: transformers' lm_head is the embedding
    assert set(ours) <= set(ref)
    for key, tensor in ours.items():
        assert tensor.dtype == torch.float32, key
        assert torch.equal(tensor, ref[key]), key


# ---- tiny synthetic files -------------------------------------------------------------------------

_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                  "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate",
                  "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf_name):
    module, suffix = hf_name.rsplit(".", 1)
    if module in _TO_GGUF:
        return f"{_TO_GGUF[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_LAYER_TO_GGUF[rest]}.{suffix}"


def _interleave_rows(w, n_heads):
    """What llama.cpp's converter does to llama q/k rows: each head's (first half, second half) rows
    become (h0[0], h1[0], h0[1], h1[1], ...)."""
    d = w.shape[0] // n_heads
    halves = w.reshape(n_heads, 2, d // 2, *w.shape[1:])
    return np.stack([halves[:, 0], halves[:, 1]], axis=2).reshape(w.shape)


_UP_Q8 = {"mlp.up_proj.weight": gguf.GGMLQuantizationType.Q8_0}


def _deinterleave_rows(w, n_heads):
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(0, 2, 1, *range(3, w.ndim + 2)).reshape(w.shape)


def _write_tiny(path, arch, hf_config, state_dict, quantize=None, split_max_tensors=0):
    """Write state_dict as a GGUF the way llama.cpp's converter lays it out; return the expected
    (HF name -> float32 tensor) after the file's quantization. quantize: HF name suffix -> GGUF type (default:
    up_proj Q8_0; gate_proj is stored F16 unless named). split_max_tensors: split it as gguf-split does."""
    quantize = _UP_Q8 if quantize is None else quantize
    c = hf_config
    w = writer_with_header(path, arch, c, split_max_tensors)
    expected = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        expected[name] = torch.from_numpy(array.copy())
        if arch == "llama" and ".q_proj." in name:
            array = _interleave_rows(array, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _interleave_rows(array, c.num_key_value_heads)
        qtype = next((t for suffix, t in quantize.items() if name.endswith(suffix)), None)
        if qtype is not None:
            q = gguf.quants.quantize(array, qtype)
            w.add_tensor(_gguf_name(name), q, raw_dtype=qtype)
            deq = gguf.quants.dequantize(q, qtype)
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):  # undo the interleave in expected
                heads = hf_config.num_attention_heads if ".q_proj." in name else hf_config.num_key_value_heads
                deq = _deinterleave_rows(deq, heads)
            expected[name] = torch.from_numpy(np.ascontiguousarray(deq))
        elif name.endswith("mlp.gate_proj.weight"):
            w.add_tensor(_gguf_name(name), array.astype(np.float16))
            expected[name] = torch.from_numpy(array.astype(np.float16).astype(np.float32))
        else:
            w.add_tensor(_gguf_name(name), array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _tiny(arch):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    if arch == "llama":  # untied, GQA
        config = LlamaConfig(**common, tie_word_embeddings=False)
    elif arch == "qwen2":  # tied, q/k/v biases
        config = Qwen2Config(**common, tie_word_embeddings=True)
    else:  # head_dim != hidden / heads, q/k norms
        config = Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms are ones at init; make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    return config, model.state_dict()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_roundtrip(tmp_path, arch):
    hf_config, state_dict = _tiny(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_tiny(path, arch, hf_config, state_dict)

    config = gguf_config(str(path))
    _assert_config_matches(config, hf_config)
    ours = dict(gguf_weights(str(path), config))
    assert set(ours) == set(expected)
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in ours
    if arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in ours
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == state_dict[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def test_a_split_model_reads_as_one_file(tmp_path):
    """llama.cpp's gguf-split parts (NAME-0000k-of-0000N.gguf) read as the one file they were cut from: the first
    part's metadata, every part's tensors; any part names the model; a missing part is a clear error."""
    from voltllm.model.loader import ModelLoadError, resolve_model
    from voltllm.model.loader.gguf_loader import dense_bytes, split_files

    hf_config, state_dict = _tiny("qwen3")
    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    expected = _write_tiny(tmp_path / "one" / "tiny.gguf", "qwen3", hf_config, state_dict)
    _write_tiny(tmp_path / "split" / "tiny.gguf", "qwen3", hf_config, state_dict, split_max_tensors=7)
    parts = sorted(str(p) for p in (tmp_path / "split").iterdir())
    assert len(parts) >= 3 and parts[0].endswith(f"tiny-00001-of-{len(parts):05d}.gguf")
    assert split_files(parts[-1]) == parts
    assert resolve_model(parts[1]).path == parts[0]  # any part, or their folder, names the model by the first
    assert resolve_model(str(tmp_path / "split")).path == parts[0]

    one = str(tmp_path / "one" / "tiny.gguf")
    _assert_config_matches(gguf_config(parts[0]), gguf_config(one))
    ours = dict(gguf_weights(parts[0]))
    assert set(ours) == set(expected) and all(torch.equal(ours[n], expected[n]) for n in expected)
    assert dense_bytes(parts[0], 2) == dense_bytes(one, 2)

    os.remove(parts[1])
    with pytest.raises(ModelLoadError, match=f"lacks 1 of its {len(parts)} files: tiny-00002-of-"):
        resolve_model(parts[0])
    with pytest.raises(ValueError, match="lacks 1 of its"):
        gguf_config(parts[0])


def test_unsupported_arch(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'gpt2'"):
        gguf_config(str(path))
    with pytest.raises(ValueError, match="'gpt2'"):
        next(gguf_weights(str(path), None))


# every kind with a device layout that the gguf package can quantize (merged qkv and gate_up of mixed kinds);
# down_proj (96 input features: no whole 64-element groups) stays dense
_KEPT = {"q_proj.weight": gguf.GGMLQuantizationType.Q8_0, "k_proj.weight": gguf.GGMLQuantizationType.Q4_0,
         "v_proj.weight": gguf.GGMLQuantizationType.Q5_0, "o_proj.weight": gguf.GGMLQuantizationType.Q4_1,
         "gate_proj.weight": gguf.GGMLQuantizationType.Q5_1, "up_proj.weight": gguf.GGMLQuantizationType.Q8_0,
         "lm_head.weight": gguf.GGMLQuantizationType.Q4_0, "embed_tokens.weight": gguf.GGMLQuantizationType.Q8_0}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_kept_quantized(tmp_path, arch):
    """keep_quantized: linear weights and embeddings of kept kinds come as raw blocks (llama q/k rows un-permuted as
    blocks), the others as float; a model built with QuantizedLinearMethod multiplies by exactly the float path's
    weights, looks up the same embeddings and computes the same logits (qwen2: through the tied, quantized table)."""
    from voltllm.model.layers.quantized_linear import GGUFBlocks, QuantizedLinearMethod
    from voltllm.model.layers.linear import Linear
    from voltllm.model.models.registry import build_model

    hf_config, state_dict = _tiny(arch)
    path = tmp_path / f"tiny-{arch}-q.gguf"
    expected = _write_tiny(path, arch, hf_config, state_dict, quantize=_KEPT)
    config = gguf_config(str(path))
    ours = dict(gguf_weights(str(path), config, keep_quantized=True))
    blocks = {n for n, t in ours.items() if isinstance(t, GGUFBlocks)}
    assert "model.layers.0.self_attn.q_proj.weight" in blocks and "model.layers.1.mlp.up_proj.weight" in blocks
    assert not any(n.endswith(("down_proj.weight", "norm.weight")) for n in blocks)
    assert ("lm_head.weight" in blocks) == (arch == "llama")  # qwen2 here ties it to the embeddings
    assert "model.embed_tokens.weight" in blocks
    model = build_model(config, torch.float32, 64, QuantizedLinearMethod())
    model.load_weights(ours.items())
    qkv = model.layers[0].self_attn.qkv_proj
    assert [type(s.weight).__name__ for s in qkv.gguf_segments] == ["Planes"] * 3  # Q8_0 | Q4_0 | Q5_0
    assert len(model.layers[0].mlp.gate_up_proj.gguf_segments) == 2  # Q5_1 | Q8_0
    floats = dict(gguf_weights(str(path), config))
    assert all(torch.equal(floats[n], expected[n]) for n in expected)
    dense = build_model(config, torch.float32, 64)
    dense.load_weights(floats.items())
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            ref = dense.get_submodule(name)
            eye = torch.eye(mod.in_features)
            assert torch.equal(mod(eye), ref(eye)), name
    ids = torch.tensor([[0, 5, 95, 17]])
    assert model.embed_tokens.weight is None and torch.equal(model.embed_tokens(ids), dense.embed_tokens(ids))
    hidden = torch.randn(3, 64)
    assert torch.allclose(model.compute_logits(hidden), dense.compute_logits(hidden), rtol=1e-5, atol=1e-5)
