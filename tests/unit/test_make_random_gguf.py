"""benchmarks/make_random_gguf.py: a GGUF file of random quantized weights at a named shape, with a copied
tokenizer, that voltllm loads (dequantized on the CPU, as raw blocks of the chosen kinds when kept quantized)."""
from pathlib import Path

import pytest
from interp_util import load_script


def _script():
    return load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "make_random_gguf.py")


def test_q4_k_m_mix():
    kind_of = _script().kind_of
    assert kind_of("output", 0, "Q4_K_M") == "Q6_K" and kind_of("attn_q", 3, "Q4_K_M") == "Q4_K"
    assert [kind_of("ffn_down", i, "Q4_K_M") for i in range(3)] == ["Q6_K", "Q4_K", "Q6_K"]
    assert kind_of("attn_v", 5, "Q8_0") == "Q8_0"


def test_low_bit_mixes():
    """llama.cpp's Q3_K_M / Q2_K / IQ4_XS file types as mixes, and its fallback types for rows of partial blocks."""
    script = _script()
    kind_of, fitted = script.kind_of, script.fitted
    assert [kind_of(n, 1, "Q3_K_M") for n in ("attn_q", "attn_output", "attn_v", "ffn_up", "output")] == [
        "Q3_K", "Q4_K", "Q4_K", "Q3_K", "Q6_K"]
    assert kind_of("ffn_down", 0, "Q3_K_M") == "Q5_K"
    assert [kind_of("ffn_down", i, "Q2_K") for i in range(2)] == ["Q4_K", "Q3_K"]
    assert kind_of("ffn_gate", 0, "Q2_K") == "Q2_K" and kind_of("attn_output", 0, "Q2_K") == "Q3_K"
    assert kind_of("attn_k", 0, "IQ4_XS") == "IQ4_XS" and kind_of("attn_v", 0, "IQ4_XS") == "Q5_K"
    assert fitted("Q3_K", 576) == "IQ4_NL" and fitted("Q6_K", 576) == "Q8_0" and fitted("Q3_K", 1024) == "Q3_K"
    assert fitted("Q4_0", 576) == "Q4_0"


def test_written_file_loads_and_generates(tmp_path, smollm2_gguf, monkeypatch):
    pytest.importorskip("gguf")
    from gguf_files import reuse_parsed_reader
    from voltllm import LLM, SamplingParams
    from voltllm.model.layers.quantized_linear import GGUFBlocks
    from voltllm.model.loader.gguf_loader import gguf_config, gguf_weights

    out = str(tmp_path / "random-smollm2-q8.gguf")
    reuse_parsed_reader(monkeypatch, smollm2_gguf)  # (SmolLM2's header, with its tokenizer, parsed once per process)
    sizes = _script().write("smollm2-135m-shape", "Q8_0", smollm2_gguf, out)
    assert set(sizes) == {"Q8_0"}
    config = gguf_config(out)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    blocks = {n: t for n, t in gguf_weights(out, config, keep_quantized=True) if isinstance(t, GGUFBlocks)}
    assert {t.type_name for t in blocks.values()} == {"Q8_0"} and "model.embed_tokens.weight" in blocks
    # (4 requests' KV cache: at --max-num-seqs 256 the 30 layers' cache fills the CPU's whole 2 GiB, zeroed)
    llm = LLM(out, device="cpu", max_model_len=256, dtype="float32", max_num_seqs=4)
    got = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(got.token_ids) == 4 and all(0 <= t < 49152 for t in got.token_ids)


def test_qwen3moe_shape(tmp_path, smollm2_gguf, monkeypatch):
    """A qwen3moe shape: stacked expert tensors of the mix's kinds (Q4_K_M: gate / up Q4_K, down Q6_K in even
    layers), read back per expert, kept quantized as MoE planes, and generated from on the CPU."""
    pytest.importorskip("gguf")
    from gguf_files import reuse_parsed_reader
    from voltllm import LLM, SamplingParams
    from voltllm.bench import shapes
    from voltllm.model.layers.quantized_linear import GGUFBlocks
    from voltllm.model.loader.gguf_loader import gguf_config, gguf_weights

    monkeypatch.setitem(shapes.SHAPES, "tiny-moe-shape", ("Qwen3MoeConfig", dict(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
        tie_word_embeddings=False, max_position_embeddings=512)))
    script = _script()
    monkeypatch.setattr(script, "SHAPES", shapes.SHAPES)
    out = str(tmp_path / "tiny-moe.gguf")
    reuse_parsed_reader(monkeypatch, smollm2_gguf)
    script.write("tiny-moe-shape", "Q4_K_M", smollm2_gguf, out)
    config = gguf_config(out)
    assert config.model_type == "qwen3_moe" and (config.num_experts, config.moe_intermediate_size) == (4, 256)
    kinds = {n: t.type_name for n, t in gguf_weights(out, config, keep_quantized=True) if isinstance(t, GGUFBlocks)}
    assert kinds["model.layers.0.mlp.experts.3.down_proj.weight"] == "Q6_K"
    assert kinds["model.layers.1.mlp.experts.3.down_proj.weight"] == "Q4_K"
    assert kinds["model.layers.1.mlp.experts.0.gate_proj.weight"] == "Q4_K"
    llm = LLM(out, device="cpu", max_model_len=128, dtype="float32")
    got = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(got.token_ids) == 3
