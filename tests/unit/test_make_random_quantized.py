"""benchmarks/make_random_quantized.py: a Hugging Face checkpoint of random 4-bit AWQ / GPTQ, 8-bit GPTQ, FP8 or NVFP4
weights at a named shape, with a tokenizer converted from a GGUF file, that voltllm reads (dequantized on the CPU) and
generates from."""
from pathlib import Path

import pytest
import torch
from interp_util import load_script


def _script(tokenizer=None):
    """The script, fresh (tests patch its SHAPES); with tokenizer, its load_tokenizer answers that one for the GGUF."""
    script = load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "make_random_quantized.py")
    if tokenizer is not None:
        path, tok = tokenizer
        script.load_tokenizer = lambda p: tok if p == path else pytest.fail(f"tokenizer asked of {p}")
    return script


@pytest.fixture(scope="module")
def gguf_tok(smollm2_gguf):
    """(path, tokenizer): the script's own load_tokenizer of the GGUF, run once per module (converting the GGUF's
    tokenizer takes ~4 s on the CPU, and every test here writes the same one); write() only reads and saves it."""
    return smollm2_gguf, _script().load_tokenizer(smollm2_gguf)


@pytest.mark.parametrize("method", ["awq", "gptq", "gptq8", "fp8", "nvfp4"])
def test_written_checkpoint_loads_and_generates(tmp_path, smollm2_gguf, gguf_tok, method):
    from voltllm import LLM, SamplingParams
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model
    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.quantized_linear import PackedWeight

    out = str(tmp_path / f"random-smollm2-{method}")
    bits = 8 if method == "gptq8" else 4
    method = "gptq" if method == "gptq8" else method
    _script(gguf_tok).write("smollm2-135m-shape", method, 64, smollm2_gguf, out, bits=bits)  # 576 inputs: groups of 64
    src = resolve_model(out)
    cfg = load_hf_config(src)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 30, 49152)
    layers = [t for _, t in iter_weights(src, cfg, keep_quantized=True) if isinstance(t, PackedWeight)]
    assert len(layers) == 30 * 7
    if bits == 8:  # every layer kept as int8 planes (no zero of 256 among the random fields)
        assert all(isinstance(p := w.to_weight(None, torch.float32), Planes) and p.kind.name == "INT8_G64_ZP"
                   for w in layers[:7])
    # (4 requests' KV cache: at --max-num-seqs 256 the 30 layers' cache fills the CPU's whole 2 GiB, zeroed each time)
    llm = LLM(out, device="cpu", max_model_len=256, dtype="float32", max_num_seqs=4)
    assert llm.engine.config.model.quantization == {"nvfp4": "modelopt_fp4"}.get(method, method)
    got = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(got.token_ids) == 4 and all(0 <= t < 49152 for t in got.token_ids)


def test_moe_shape(tmp_path, smollm2_gguf, gguf_tok, monkeypatch):
    """A qwen3_moe shape: per-expert packed projections and an fp16 router, read back and generated from."""
    from voltllm import LLM, SamplingParams
    from voltllm.bench import shapes

    monkeypatch.setitem(shapes.SHAPES, "tiny-moe-shape", ("Qwen3MoeConfig", dict(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        mlp_only_layers=[1], tie_word_embeddings=False, max_position_embeddings=512)))
    script = _script(gguf_tok)
    monkeypatch.setattr(script, "SHAPES", shapes.SHAPES)
    out = str(tmp_path / "tiny-moe-awq")
    script.write("tiny-moe-shape", "awq", 64, smollm2_gguf, out)
    llm = LLM(out, device="cpu", max_model_len=128, dtype="float32")
    assert llm.engine.config.model.quantization == "awq" and llm.engine.runner.model.has_moe
    got = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(got.token_ids) == 3


@pytest.mark.parametrize("cls,extra", [
    ("Qwen3_5MoeTextConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=64)),
    ("Qwen3NextConfig", dict(intermediate_size=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64, mlp_only_layers=[1], decoder_sparse_step=1)),
    ("Qwen3_5TextConfig", dict(intermediate_size=256))])
def test_hybrid_shape(tmp_path, smollm2_gguf, gguf_tok, monkeypatch, cls, extra):
    """Hybrid shapes: packed attention / GDN / MLP / expert projections, fp16 GDN b / a, routers and shared-expert
    gates; read back kept quantized (the GDN in_proj: planes for q k v z, dense b / a) and generated from."""
    import torch

    from voltllm import LLM, SamplingParams
    from voltllm.bench import shapes
    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.quantized_linear import QuantizedLinearMethod
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model
    from voltllm.model.models.registry import build_model

    monkeypatch.setitem(shapes.SHAPES, "tiny-hybrid-shape", (cls, dict(
        vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=16, tie_word_embeddings=False, max_position_embeddings=512, **extra)))
    script = _script(gguf_tok)
    monkeypatch.setattr(script, "SHAPES", shapes.SHAPES)
    out = str(tmp_path / "tiny-hybrid-awq")
    script.write("tiny-hybrid-shape", "awq", 64, smollm2_gguf, out)
    src = resolve_model(out)
    cfg = load_hf_config(src)
    kept = build_model(cfg, torch.float32, 64, QuantizedLinearMethod())
    kept.load_weights(iter_weights(src, cfg, keep_quantized=True))
    segs = kept.layers[0].linear_attn.in_proj.gguf_segments
    assert [type(s.weight) for s in segs] == [Planes, torch.Tensor] and segs[1].size == 16
    assert isinstance(kept.layers[3].self_attn.o_proj.gguf_segments[0].weight, Planes)
    if "num_experts" in extra:
        assert kept.layers[0].mlp.qexperts.ready
        assert isinstance(kept.layers[0].mlp.shared_expert.down_proj.gguf_segments[0].weight, Planes)
    llm = LLM(out, device="cpu", max_model_len=128, dtype="float32")
    assert llm.engine.config.model.quantization == "awq" and llm.engine.runner.is_hybrid
    got = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(got.token_ids) == 3
