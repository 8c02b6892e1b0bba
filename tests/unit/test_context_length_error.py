"""A request too long for the context is a 400 in vLLM's (and OpenAI's) words, "This model's maximum context length
is M tokens. However, you requested ...", which clients match to tell it from other errors (LiteLLM's
ContextWindowExceededError, aider's "context too large" advice), with code context_length_exceeded and the field at
fault; checked on AsyncLLM's admission checks without an engine."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from voltllm.engine.async_llm import AsyncLLM
from voltllm.engine.request_checks import InvalidRequestError
from voltllm.entrypoints.openai.serving_common import submission_error
from voltllm.sampling.params import SamplingParams

ENGINE = SimpleNamespace(max_model_len=100, vocab_size=1000)
LITELLM = "This model's maximum context length is 100 tokens. However, you requested"


@pytest.mark.parametrize("prompt,max_tokens,total,param", [(60, 50, 110, "max_tokens"), (100, None, 101, "prompt"),
                                                           (120, 5, 125, "prompt")])
def test_generation_requests_over_the_context(prompt, max_tokens, total, param):
    with pytest.raises(InvalidRequestError) as e:
        AsyncLLM._check_prompt(ENGINE, [1] * prompt, SamplingParams(max_tokens=max_tokens))
    message = str(e.value)
    assert message.startswith(f"{LITELLM} {total} tokens ({prompt} in the prompt, {total - prompt} in the completion)")
    err = submission_error(e.value)
    assert (err.status, err.param, err.code) == (400, param, "context_length_exceeded")
    assert err.message == message


def test_an_input_to_embed_over_the_context():
    with pytest.raises(InvalidRequestError) as e:
        AsyncLLM._check_pooling_prompt(ENGINE, [1] * 101)
    assert str(e.value).startswith(f"{LITELLM} 101 tokens in the input. Please reduce the length of the input")
    assert e.value.param == "input"


def test_requests_that_fit_pass():
    AsyncLLM._check_prompt(ENGINE, [1] * 60, SamplingParams(max_tokens=40))
    AsyncLLM._check_prompt(ENGINE, [1] * 99, SamplingParams(max_tokens=None))
    AsyncLLM._check_pooling_prompt(ENGINE, [1] * 100)
