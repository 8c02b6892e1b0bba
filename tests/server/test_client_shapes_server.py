"""Request shapes popular OpenAI-API clients send that vLLM takes (found by replaying them against voltllm): nulls
for fields with defaults, tool messages without content, reasoning_effort, and echo with max_tokens 0 (scoring a
prompt's logprobs, as lm-evaluation-harness's local-completions does)."""
from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.usefixtures("tiny_server")


def _post(server, path, body):
    return httpx.post(server.base + path, json=body, timeout=60)


def test_nulls_mean_the_defaults(tiny_server):
    r = _post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2, "stream": None, "n": None, "logprobs": None,
                                                    "parallel_tool_calls": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_tool_message_without_content_and_reasoning_effort(tiny_server):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1"}]
    r = _post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2,
                                                    "reasoning_effort": "low"})
    assert r.status_code == 200, r.text


def test_echo_with_max_tokens_0_scores_the_prompt(tiny_server):
    body = {"model": "tiny", "prompt": "Hello there", "echo": True, "max_tokens": 0, "logprobs": 1}
    r = _post(tiny_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    got = r.json()
    c = got["choices"][0]
    assert c["text"] == "Hello there" and c["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 0
    assert len(c["logprobs"]["tokens"]) == got["usage"]["prompt_tokens"]
    assert c["logprobs"]["token_logprobs"][0] is None and all(v <= 0 for v in c["logprobs"]["token_logprobs"][1:])
    with httpx.stream("POST", tiny_server.base + "/v1/completions", json=dict(body, stream=True), timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "Hello there"
    streamed_tokens = [t for ch in chunks if ch["choices"][0]["logprobs"]
                       for t in ch["choices"][0]["logprobs"]["tokens"]]
    assert streamed_tokens == c["logprobs"]["tokens"]
    # without echo, 0 stays an error, as in vLLM
    assert _post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}).status_code == 400
