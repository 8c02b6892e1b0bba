"""Tensor parallelism with weights kept quantized on the CPU (gloo): tiny fp32 quantized checkpoints with -tp 2
against -tp 1, both kept quantized (as on a GPU: the config says "quantized"; the CPU's QuantizedLinearMethod
multiplies by the torch reference's dequantized planes, so this checks the sharding of the planes itself: every
rank's column-parallel rows, row-parallel input columns cut on block / group boundaries, vocabulary rows)."""
import random

import pytest
import torch

from gguf_files import write_tiny_qwen2_gguf
from parallel_checks import ENGINE, PROMPTS
from quant_checkpoints import quantize_checkpoint, quantized_hybrid
from tiny_models import HYBRID_VOCAB, full_prompt_logprobs, make_model
from voltllm import LLM, SamplingParams
from voltllm.model.layers.gguf_planes import Planes

# every row-parallel input a multiple of 128 per rank at tp 2 (heads x head_dim 128, intermediate 256): whole
# int4 / int8 groups, NVFP4 64-groups and FP8 128-blocks on each rank
SHAPE = dict(hidden_size=128, head_dim=32, intermediate_size=256)

CASES = {
    # AWQ int4 (groups of 32, zero points), untied dense head
    "awq-qwen3": ("qwen3", dict(tie_word_embeddings=False), dict(method="awq")),
    # NVFP4 (ModelOpt), tied head over a vocabulary that does not divide by 2 (the embedding's padded shard)
    "nvfp4-llama-tied": ("llama", dict(vocab_size=401), dict(method="modelopt_fp4")),
    # FP8 in 128 x 128 blocks: 4 heads x 64 = 256 attention inputs, 128 per rank (whole 128-input scale blocks)
    "fp8-qwen3": ("qwen3", dict(head_dim=64), dict(method="fp8")),
    # GPTQ 8-bit (groups of 32, zero points: the int8 planes' codes in lo / hi and zero plane cut by columns)
    "gptq8-qwen3": ("qwen3", dict(tie_word_embeddings=False), dict(method="gptq", bits=8)),
}


def _kept(monkeypatch):
    import voltllm.config

    monkeypatch.setattr(voltllm.config, "_quantized_weights", lambda *a, **k: "quantized")


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, tmp_path_factory):
    kind, overrides, quant = CASES[request.param]
    path = make_model(str(tmp_path_factory.mktemp(request.param)), kind, **{**SHAPE, **overrides})
    quantize_checkpoint(path, **quant)
    with pytest.MonkeyPatch.context() as mp:
        _kept(mp)
        one = LLM(path, **ENGINE)
        two = LLM(path, tensor_parallel_size=2, **ENGINE)
    yield one, two
    two.engine.shutdown()


def _check_kept(llm, tp: int, cfg) -> None:
    assert llm.config.model.quantized_weights == "quantized" and llm.engine.runner.keep_quantized
    layer = llm.engine.runner.model.layers[0]
    down = layer.mlp.down_proj.gguf_segments
    o = layer.self_attn.o_proj.gguf_segments
    assert len(down) == 1 and isinstance(down[0].weight, Planes) and down[0].weight.k == cfg.intermediate_size // tp
    assert isinstance(o[0].weight, Planes) and o[0].weight.k == cfg.num_attention_heads * cfg.head_dim // tp


def test_logits_match_tp1(engines):
    """Full distributions at every prompt position (prompt logprobs over the whole vocabulary), batched."""
    one, two = engines
    cfg = one.config.model.hf_config
    _check_kept(one, 1, cfg)
    _check_kept(two, 2, cfg)
    a, b = full_prompt_logprobs(one, PROMPTS), full_prompt_logprobs(two, PROMPTS)
    assert not a.isnan().any() and not b.isnan().any()
    assert torch.allclose(a, b, atol=2e-5, rtol=0), (a - b).abs().max()


def test_greedy_matches_tp1(engines):
    one, two = engines
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)] == expected
    two.engine.check_integrity()


def _assert_same_outputs(one, two, prompts) -> None:
    """-tp 2's prompt logprobs and 12 greedy tokens equal -tp 1's."""
    a, b = full_prompt_logprobs(one, prompts), full_prompt_logprobs(two, prompts)
    assert not a.isnan().any() and torch.allclose(a, b, atol=2e-5, rtol=0), (a - b).abs().max()
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == expected


def test_uneven_group_split_of_the_mlp_matches_tp1(tmp_path, monkeypatch):
    """An intermediate size of 192 kept quantized at -tp 2: an even 96 per rank would cut a 64-input plane group, so
    rank 0 holds 128 rows and rank 1 64 (sharding.intermediate_split); the outputs equal -tp 1's."""
    path = make_model(str(tmp_path / "m"), "qwen3", **{**SHAPE, "intermediate_size": 192})
    quantize_checkpoint(path, method="awq")
    _kept(monkeypatch)
    one = LLM(path, **ENGINE)
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert two.config.parallel.intermediate_align == 64
        assert two.engine.runner.model.layers[0].mlp.down_proj.gguf_segments[0].weight.k == 128
        _assert_same_outputs(one, two, PROMPTS)
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("scheme,kind", [("int8-w8a8-asym", "INT8_G64_ZP"), ("w8a16-asym-g32", "INT8_G32_ZP")])
def test_compressed_tensors_asymmetric_int8_matches_tp1(tmp_path, monkeypatch, scheme, kind):
    """compressed-tensors int8 with zero points (the library's compressors) kept quantized at -tp 2: the int8 planes'
    codes, scales and zero plane cut by columns (one scale per row: repeated per 64 inputs, so 64 per rank holds;
    groups of 32: whole groups); the outputs equal -tp 1's."""
    from ct_checkpoints import quantize_model

    path = make_model(str(tmp_path / "m"), "qwen3", **SHAPE)
    quantize_model(path, scheme)
    _kept(monkeypatch)
    one = LLM(path, **ENGINE)
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        cfg = one.config.model.hf_config
        _check_kept(one, 1, cfg)
        _check_kept(two, 2, cfg)
        assert two.engine.runner.model.layers[0].self_attn.o_proj.gguf_segments[0].weight.kind.name == kind
        _assert_same_outputs(one, two, PROMPTS)
    finally:
        two.engine.shutdown()


def test_bnb_int8_matches_tp1(tmp_path, monkeypatch):
    """bitsandbytes 8-bit rows kept quantized at -tp 2: the int8 planes' codes and the row scale repeated per 64
    inputs cut by columns (row-parallel o_proj / down_proj: 64 / 128 inputs per rank); the outputs equal -tp 1's."""
    from bnb_checkpoints import quantize_bnb_checkpoint

    path = make_model(str(tmp_path / "m"), "qwen3", **SHAPE)
    quantize_bnb_checkpoint(path, str(tmp_path / "ref"), bits=8)
    _kept(monkeypatch)
    one = LLM(path, **ENGINE)
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        cfg = one.config.model.hf_config
        _check_kept(one, 1, cfg)
        _check_kept(two, 2, cfg)
        assert two.engine.runner.model.layers[0].self_attn.o_proj.gguf_segments[0].weight.kind.name == "INT8_G64"
        _assert_same_outputs(one, two, PROMPTS)
    finally:
        two.engine.shutdown()

def test_hybrid_awq_matches_tp1(tmp_path, monkeypatch):
    """An AWQ qwen3_5 hybrid kept quantized: GDN in_proj shards (interleaved rows) and out_proj's value-head
    columns, gated attention, MLP; prompt logprobs and greedy tokens of -tp 2 equal -tp 1's."""
    path = quantized_hybrid(str(tmp_path), "qwen3_5", dict(method="awq"), tie_word_embeddings=False)
    if path is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    _kept(monkeypatch)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(HYBRID_VOCAB) for _ in range(n)]} for n in (19, 6, 11)]
    kw = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=7, max_num_seqs=4, skip_tokenizer_init=True)
    one = LLM(path, **kw)
    two = LLM(path, tensor_parallel_size=2, **kw)
    try:
        gdn = two.engine.runner.model.layers[0].linear_attn
        out = gdn.out_proj.gguf_segments[0].weight
        cfg = two.config.model.hf_config
        cfg = getattr(cfg, "text_config", None) or cfg
        assert isinstance(out, Planes) and out.k == cfg.linear_num_value_heads * cfg.linear_value_head_dim // 2
        _assert_same_outputs(one, two, prompts)
    finally:
        two.engine.shutdown()


def test_gguf_tied_quantized_embedding_matches_tp1(tmp_path, monkeypatch):
    """A GGUF file of mixed kinds with its tied embedding kept quantized: each rank holds its vocabulary rows as
    planes (lookups summed over the ranks, the tied head's logits gathered)."""
    path = write_tiny_qwen2_gguf(str(tmp_path / "tiny-qwen2.gguf"))
    _kept(monkeypatch)
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(97) for _ in range(n)]} for n in (13, 5, 9)]
    kw = dict(block_size=4, max_num_batched_tokens=7, max_num_seqs=4, skip_tokenizer_init=True)
    one = LLM(path, **kw)
    two = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert isinstance(one.engine.runner.model.embed_tokens.table.weight, Planes)
        emb = two.engine.runner.model.embed_tokens
        assert emb.weight is None and isinstance(emb.table.weight, Planes) and emb.table.weight.n == 49
        _assert_same_outputs(one, two, prompts)
    finally:
        two.engine.shutdown()
