"""The real SmolLM2-135M-Instruct GGUF: voltllm greedy == transformers greedy on the same file."""

import pytest
import torch

from voltllm import LLM, SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def engines(smollm2_gguf, smollm2_transformers):
    llm = LLM(smollm2_gguf, max_model_len=1024, max_num_batched_tokens=64)
    return smollm2_transformers, llm


def test_greedy_matches_transformers_on_gguf(engines):
    ref, llm = engines
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)  # EOS masked, as min_new_tokens
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    for out in outs:
        ids = out.prompt_token_ids
        exp = ref.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert out.outputs[0].token_ids == exp[0, len(ids):].tolist(), tok.decode(ids)
    llm.engine.check_integrity()


def test_capital_of_france(engines):
    _, llm = engines
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends on <|im_end|> (EOS from the GGUF tokenizer)
