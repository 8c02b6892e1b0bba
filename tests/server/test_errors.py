"""Bad input gets an OpenAI-style error body with the right status, and the server keeps serving."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_helpers import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"

# (name, path, body (dict, or raw bytes), expected status, expected param or None)
CASES = [
    ("malformed json", CHAT, b'{"messages": [', 400, None),
    ("body not an object", CHAT, b"[1, 2]", 400, None),
    ("messages missing", CHAT, {"model": "smol"}, 400, "messages"),
    ("messages empty", CHAT, {"messages": []}, 400, "messages"),
    ("messages not a list", CHAT, {"messages": "hello"}, 400, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("content wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages"),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model"),
    ("unknown model (completions)", CMPL, {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("unknown model (tokenize)", "/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("negative temperature", CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature"),
    ("temperature NaN", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400,
     "temperature"),
    ("temperature infinite", CMPL, b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("repetition_penalty infinite", CMPL, b'{"prompt": "x", "repetition_penalty": Infinity}', 400,
     "repetition_penalty"),
    ("n far too large", CMPL, {"prompt": "x", "max_tokens": 1, "n": 10 ** 23}, 400, "n"),
    ("seed beyond int64", CMPL, {"prompt": "x", "max_tokens": 1, "seed": 2 ** 64}, 400, "seed"),
    ("response_format without type", CHAT, {"messages": MSG, "response_format": {}}, 400, "response_format"),
    ("max_completion_tokens zero", CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("prompt_logprobs with stream", CMPL, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs"),
    ("too many prompt_logprobs (chat)", CHAT, {"messages": MSG, "prompt_logprobs": 50}, 400, "prompt_logprobs"),
    ("temperature not a number", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("n zero", CMPL, {"prompt": "x", "n": 0}, 400, "n"),
    ("max_tokens zero", CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens beyond context", CHAT, {"messages": MSG, "max_tokens": 5000}, 400, "max_tokens"),
    ("prompt beyond context", CMPL, {"prompt": [1] * 2100, "max_tokens": 1}, 400, "prompt"),
    ("token id out of range", CMPL, {"prompt": [10 ** 7], "max_tokens": 1}, 400, "prompt"),
    ("stop token id out of range", CMPL, {"prompt": "x", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [10 ** 7]},
     400, "stop_token_ids"),
    ("empty prompt", CMPL, {"prompt": "", "max_tokens": 1}, 400, "prompt"),
    ("prompt wrong type", CMPL, {"prompt": {"a": 1}}, 400, "prompt"),
    ("too many logprobs", CMPL, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("stream_options without stream", CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("stream not a bool", CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("auto tool choice without parser", CHAT, {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, 400, "tool_choice"),
    ("required tool choice without tools", CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("tool choice names an unknown function", CHAT, {"messages": MSG, "tool_choice": {
        "type": "function", "function": {"name": "g"}}, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, 400, "tool_choice"),
    ("unsupported response format", CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ("structural tag without a format", CHAT, {"messages": MSG, "response_format": {"type": "structural_tag"}}, 400,
     "response_format"),
    ("two structured-output constraints", CMPL, {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, 400,
     "guided_choice"),
    ("invalid json schema", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400, "response_format"),
    ("logit_bias key not a token id", CHAT, {"messages": MSG, "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    ("logit_bias value not a number", CMPL, {"prompt": "x", "logit_bias": {"1": "lots"}}, 400, "logit_bias"),
    ("logit_bias id out of range", CMPL, {"prompt": "x", "logit_bias": {str(10 ** 7): 1}}, 400, "logit_bias"),
    ("reserved template kwarg", CHAT, {"messages": MSG, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),
    ("stop wrong type", CMPL, {"prompt": "x", "stop": 5}, 400, "stop"),
    ("detokenize bad id", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("tokenize nothing", "/tokenize", {}, 400, "prompt"),
]


def _check_error_body(resp: httpx.Response, status: int, param) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status == 400 else err["type"])
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, name, path, body, status, param):
    url = server.base + path
    if isinstance(body, bytes):
        resp = httpx.post(url, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    else:
        resp = httpx.post(url, json=body, headers=AUTH, timeout=60)
    _check_error_body(resp, status, param)
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


def test_streaming_bad_input_is_a_plain_400(server):
    resp = httpx.post(server.base + CHAT, json={"messages": MSG, "stream": True, "max_tokens": 5000}, headers=AUTH,
                      timeout=60)
    _check_error_body(resp, 400, "max_tokens")


def test_openai_client_raises_not_found_for_an_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=MSG)
    assert "nope" in str(e.value)


def test_values_past_any_limit_are_served(server):
    """top_k beyond int64 means all tokens (it once killed the engine); top_logprobs 0 without logprobs asks for
    nothing (vLLM accepts it)."""
    for body in ({"prompt": "Hi", "max_tokens": 2, "top_k": 2 ** 63, "temperature": 1, "seed": 3},
                 {"prompt": "Hi", "max_tokens": 2, "top_k": 2 ** 31, "temperature": 0.7}):
        resp = httpx.post(server.base + CMPL, json=body, headers=AUTH, timeout=60)
        assert resp.status_code == 200, resp.text
    resp = httpx.post(server.base + CHAT, json={"messages": MSG, "max_tokens": 2, "logprobs": False,
                                                "top_logprobs": 0}, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


def test_prompt_logprobs_in_the_response(server):
    """vLLM's shape: per choice (completions) or at the top (chat), None for the first prompt token, then
    {token id: {logprob, rank, decoded_token}} holding the top tokens and the prompt's own."""
    tok = httpx.post(server.base + "/tokenize", json={"prompt": "The capital of France"}, timeout=30).json()
    resp = httpx.post(server.base + CMPL, json={"prompt": "The capital of France", "max_tokens": 2,
                                                "temperature": 0, "prompt_logprobs": 2}, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == tok["count"] and plp[0] is None
    for tid, pos in zip(tok["tokens"][1:], plp[1:]):
        assert str(tid) in pos and 2 <= len(pos) <= 3
        ranks = sorted(v["rank"] for v in pos.values())  # the prompt token's too: its rank in the vocabulary
        assert ranks[:2] == [1, 2] and all(v["logprob"] <= 0 for v in pos.values())
        assert (pos[str(tid)]["rank"] > 2) == (len(pos) == 3)
    chat = httpx.post(server.base + CHAT, json={"messages": MSG, "max_tokens": 2, "prompt_logprobs": 0},
                      headers=AUTH, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and all(len(p) == 1 for p in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in httpx.post(server.base + CMPL, json={"prompt": "x", "max_tokens": 1},
                                               headers=AUTH, timeout=60).json()["choices"][0]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}],
                         ids=["no key", "wrong key", "no bearer"])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", CHAT), ("POST", CMPL)])
def test_api_key_required_on_v1(server, headers, method, path):
    resp = httpx.request(method, server.base + path, headers=headers, json={"messages": MSG, "prompt": "x"},
                         timeout=30)
    _check_error_body(resp, 401, None)
    assert resp.json()["error"]["type"] == "authentication_error"
    # routes outside /v1 stay open, and the right key works
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    assert httpx.get(server.base + "/v1/models", headers=AUTH, timeout=10).status_code == 200


def test_openai_client_wrong_key(server):
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_is_a_json_404(server):
    resp = httpx.get(server.base + "/v1/nothing-here", headers=AUTH, timeout=10)
    _check_error_body(resp, 404, None)


def test_serves_after_bad_inputs(client):
    r = client.completions.create(model="smol", prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
