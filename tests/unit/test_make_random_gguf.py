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


def test_written_file_loads_and_generates(tmp_path, smollm2_gguf):
    pytest.importorskip("gguf")
    from voltllm import LLM, SamplingParams
    from voltllm.model.layers.quantized_linear import GGUFBlocks
    from voltllm.model.loader.gguf_loader import gguf_config, gguf_weights

    out = str(tmp_path / "random-smollm2-q8.gguf")
    sizes = _script().write("smollm2-135m-shape", "Q8_0", smollm2_gguf, out)
    assert set(sizes) == {"Q8_0"}
    config = gguf_config(out)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    blocks = {n: t for n, t in gguf_weights(out, config, keep_quantized=True) if isinstance(t, GGUFBlocks)}
    assert {t.type_name for t in blocks.values()} == {"Q8_0"} and "model.embed_tokens.weight" in blocks
    llm = LLM(out, device="cpu", max_model_len=256, dtype="float32")
    got = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(got.token_ids) == 4 and all(0 <= t < 49152 for t in got.token_ids)
