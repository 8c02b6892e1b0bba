"""vLLM's chat fields that shape the answer (include_reasoning, return_prompt_text), the null keys vLLM's responses
carry (service_tier, system_fingerprint), and the Responses API's reasoning.effort / logit_bias / request_id /
service_tier, on the fake engine of test_vllm_request_params."""
from __future__ import annotations

import asyncio

import pytest

from test_vllm_request_params import FakeRaw, _state
from voltllm.engine.outputs import CompletionOutput, RequestOutput
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest
from voltllm.entrypoints.openai.responses_protocol import ResponsesRequest
from voltllm.entrypoints.openai.serving_chat import _full_response, _stream, start_chat

TEXT = "<think>plan</think>answer"


def _answer(state, **body):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=5, **body)

    async def run():
        plan, _, watcher = await start_chat(state, req, FakeRaw())
        watcher.stop()
        out = RequestOutput("r", None, plan.prompt_ids, [CompletionOutput(0, TEXT, [1, 2, 3], finish_reason="stop")],
                           True)
        if not req.stream:
            return _full_response(state, req, plan, out)

        async def outputs():
            yield 0, out
        import voltllm.entrypoints.openai.serving_chat as chat

        merge, chat.merge_streams = chat.merge_streams, lambda streams: outputs()
        try:
            return [chunk async for chunk in _stream(state, req, plan, [])]
        finally:
            chat.merge_streams = merge
    return asyncio.run(run())


def test_include_reasoning_false_leaves_the_reasoning_out():
    state = _state()
    state.reasoning_parser = "qwen3"
    message = _answer(state)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("plan", "answer")
    message = _answer(state, include_reasoning=False)["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (None, None, "answer")
    chunks = "".join(_answer(state, include_reasoning=False, stream=True))
    assert "plan" not in chunks and "answer" in chunks


def test_return_prompt_text_and_vllms_null_keys():
    state = _state()
    body = _answer(state, return_prompt_text=True)
    assert body["prompt_text"] == "hello"  # (the fake template joins the contents)
    assert body["service_tier"] is None and body["system_fingerprint"] is None
    assert "prompt_text" not in _answer(state)
    first = _answer(state, return_prompt_text=True, stream=True)[0]
    assert '"prompt_text":"hello"' in first


def test_responses_reasoning_effort_logit_bias_and_service_tier():
    req = ResponsesRequest(input="hi", reasoning={"effort": "none"}, logit_bias={"5": -100}, service_tier="flex")
    req.check()
    chat = req.to_chat([{"role": "user", "content": "hi"}])
    assert chat.reasoning_effort == "none" and chat.logit_bias == {"5": -100}
    assert chat.template_kwargs() == {"reasoning_effort": "none", "enable_thinking": False}
    assert ResponsesRequest(input="hi").service_tier == "auto"
    for body, param in (({"reasoning": {"effort": 3}}, "reasoning"), ({"request_id": ""}, "request_id")):
        with pytest.raises(OpenAIError) as e:
            ResponsesRequest(input="hi", **body).check()
        assert e.value.param == param
    with pytest.raises(Exception, match="service_tier"):
        ResponsesRequest(input="hi", service_tier="gold")
