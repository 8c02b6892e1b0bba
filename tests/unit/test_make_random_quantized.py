"""benchmarks/make_random_quantized.py: a Hugging Face checkpoint of random 4-bit AWQ / GPTQ, FP8 or NVFP4 weights at a named
shape, with a tokenizer converted from a GGUF file, that voltllm reads (dequantized on the CPU) and generates from."""
from pathlib import Path

import pytest
from interp_util import load_script


def _script():
    return load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "make_random_quantized.py")


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8", "nvfp4"])
def test_written_checkpoint_loads_and_generates(tmp_path, smollm2_gguf, method):
    from voltllm import LLM, SamplingParams
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model
    from voltllm.model.layers.quantized_linear import PackedWeight

    out = str(tmp_path / f"random-smollm2-{method}")
    _script().write("smollm2-135m-shape", method, 64, smollm2_gguf, out)  # 576 inputs: groups of 64
    src = resolve_model(out)
    cfg = load_hf_config(src)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 30, 49152)
    layers = [t for _, t in iter_weights(src, cfg, keep_quantized=True) if isinstance(t, PackedWeight)]
    assert len(layers) == 30 * 7
    llm = LLM(out, device="cpu", max_model_len=256, dtype="float32")
    assert llm.engine.config.model.quantization == {"nvfp4": "modelopt_fp4"}.get(method, method)
    got = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(got.token_ids) == 4 and all(0 <= t < 49152 for t in got.token_ids)


def test_moe_shape(tmp_path, smollm2_gguf, monkeypatch):
    """A qwen3_moe shape: per-expert packed projections and an fp16 router, read back and generated from."""
    from voltllm import LLM, SamplingParams
    from voltllm.bench import shapes

    monkeypatch.setitem(shapes.SHAPES, "tiny-moe-shape", ("Qwen3MoeConfig", dict(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        mlp_only_layers=[1], tie_word_embeddings=False, max_position_embeddings=512)))
    script = _script()
    monkeypatch.setattr(script, "SHAPES", shapes.SHAPES)
    out = str(tmp_path / "tiny-moe-awq")
    script.write("tiny-moe-shape", "awq", 64, smollm2_gguf, out)
    llm = LLM(out, device="cpu", max_model_len=128, dtype="float32")
    assert llm.engine.config.model.quantization == "awq" and llm.engine.runner.model.has_moe
    got = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(got.token_ids) == 3
