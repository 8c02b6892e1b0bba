"""Sliding-window attention in the llama-family models (CPU, fp32): tiny qwen2 / qwen3 checkpoints whose config turns a
window of 6 tokens on for their later layers (use_sliding_window, max_window_layers 1) against transformers on the same
weights: prompt logprobs at every position and greedy outputs well past the window (batched, chunked prefill, prefix
cache hits). The same weights read with the window off give other logits, so the window is what is compared. Config:
the window is served (no context cap) and --disable-sliding-window caps the context at it with full attention."""
import json
import os

import pytest
import torch

from tiny_models import assert_prompt_logprobs_match, make_model
from voltllm import LLM, SamplingParams

WINDOW = 6
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, again and again.",
    "What is the capital of France?",
    "Hi",
    "def add(a, b):\n    return a + b\n# now the quick brown fox",
]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def windowed(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_model(str(tmp_path_factory.mktemp(request.param)), request.param, use_sliding_window=True,
                      sliding_window=WINDOW, max_window_layers=1)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    assert ref.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    llm = LLM(path, block_size=4, max_num_batched_tokens=7, max_num_seqs=8)
    return path, ref, llm


def _hf_greedy(ref, ids, n):
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_layers_take_the_window(windowed):
    path, _, llm = windowed
    layers = llm.engine.runner.model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == [0, WINDOW, WINDOW]
    assert llm.config.model.max_model_len == 1024  # served windowed: no cap
    from voltllm.bench.limits import model_cost

    cost = model_cost(llm.engine.runner.model, llm.config.model.hf_config)  # (the bench's read limit)
    assert cost.layer_windows == (0, WINDOW, WINDOW) and cost.attended(100) == (100 + 2 * WINDOW) / 3


def test_logits_match_transformers(windowed):
    _, ref, llm = windowed
    assert_prompt_logprobs_match(llm, ref, PROMPTS)


def test_the_window_changes_the_logits(windowed):
    """transformers on the same weights with the window off: the long prompt's later positions differ."""
    from transformers import AutoModelForCausalLM

    path, ref, llm = windowed
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                layer_types=["full_attention"] * 3).eval()
    assert cfg["sliding_window"] == WINDOW and full.config.layer_types == ["full_attention"] * 3
    ids = torch.tensor([llm.get_tokenizer().encode(PROMPTS[0])])
    with torch.no_grad():
        a, b = ref(ids).logits[0], full(ids).logits[0]
    assert torch.allclose(a[:WINDOW], b[:WINDOW], atol=1e-5)  # (within the window the two agree)
    assert not torch.allclose(a[WINDOW:], b[WINDOW:], atol=1e-3)


def test_greedy_past_the_window_batched_chunked_and_cached(windowed):
    _, ref, llm = windowed
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    expected = [_hf_greedy(ref, tok.encode(p), 24) for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected
    hits = llm.engine.stats().prefix_cache_hits
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert llm.engine.stats().prefix_cache_hits > hits
    llm.engine.check_integrity()


def test_disable_sliding_window_caps_the_context(windowed, caplog):
    """--disable-sliding-window: every layer attends to the whole context, which stops at the window (where the two
    agree): the first WINDOW positions' logits still match transformers'."""
    from voltllm.config import ConfigError, EngineArgs

    path, ref, _ = windowed
    with caplog.at_level("WARNING", logger="voltllm"):
        llm = LLM(path, disable_sliding_window=True, block_size=4)
    assert llm.config.model.max_model_len == WINDOW and "sliding-window" not in caplog.text
    assert [layer.self_attn.sliding_window for layer in llm.engine.runner.model.layers] == [0, 0, 0]
    assert_prompt_logprobs_match(llm, ref, ["Hi there", "What is"])
    with pytest.raises(ConfigError, match=rf"--max-model-len 512 exceeds .*\(its sliding window, {WINDOW} tokens"):
        EngineArgs(model=path, device="cpu", disable_sliding_window=True, max_model_len=512).create_engine_config()
    assert EngineArgs(model=path, device="cpu", max_model_len=512).create_engine_config().model.max_model_len == 512
