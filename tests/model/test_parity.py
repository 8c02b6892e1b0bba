"""Tiny random llama / qwen2 / qwen3 / qwen3_moe models: voltllm vs transformers on the same weights (fp32, CPU)."""
import pytest
import torch

from tiny_models import assert_prompt_logprobs_match, make_model
from voltllm import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Hi",
    "def add(a, b):\n    return a + b\n# now the quick brown fox",
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3_moe"])
def model_pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_model(str(tmp_path_factory.mktemp(request.param)), request.param)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # small blocks and a small token budget force chunked prefill, mixed prefill + decode steps
    llm = LLM(path, block_size=4, max_num_batched_tokens=7, max_num_seqs=8)
    return request.param, ref, llm


def _hf_greedy(ref, ids, n):
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_logits_match_transformers(model_pair):
    """Full distributions at every prompt position (prompt logprobs over the whole vocab), batched."""
    _, ref, llm = model_pair
    assert_prompt_logprobs_match(llm, ref, PROMPTS)


def test_greedy_32_tokens_batched_chunked_and_cached(model_pair):
    kind, ref, llm = model_pair
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)  # as min_new_tokens
    expected = [_hf_greedy(ref, tok.encode(p), 32) for p in PROMPTS]
    cold = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in cold] == expected
    hits_before = llm.engine.stats().prefix_cache_hits
    warm = llm.generate(PROMPTS, params)  # same prompts again: prefix-cache hits
    assert [o.outputs[0].token_ids for o in warm] == expected
    assert llm.engine.stats().prefix_cache_hits > hits_before
    assert any(o.num_cached_tokens > 0 for o in warm)
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0  # everything freed (cached blocks sit in the free queue)


def test_repetition_penalty_matches_transformers(model_pair):
    """Greedy with repetition_penalty 1.8 over prompt and output ids (transformers' rule too), batched with
    unpenalized requests, async scheduling on: the penalized rows see every earlier output token."""
    _, ref, llm = model_pair
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[3])
    out = ref.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                       repetition_penalty=1.8)
    expected = out[0, len(ids):].tolist()
    plain = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    outs = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1]],
                        [plain, SamplingParams(temperature=0, max_tokens=24, min_tokens=24, repetition_penalty=1.8),
                         plain])
    assert outs[1].outputs[0].token_ids == expected
    assert outs[1].outputs[0].token_ids != _hf_greedy(ref, ids, 24)  # the penalty changed the output
