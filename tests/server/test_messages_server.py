"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) over HTTP with httpx, sending the JSON that
Anthropic clients send, against the tiny random model conftest.py serves (`tiny_server`, shared): its output is
gibberish, so these check shapes, event order, stop reasons, equality with the chat route under greedy sampling,
forced tool calls, the round trip of tool_use / tool_result, token counts, errors in Anthropic's shape, metrics
and abort on disconnect. A second tiny server (module-scoped) runs with --api-key, --reasoning-parser qwen3,
--enable-auto-tool-choice --tool-call-parser hermes and a Qwen3-style template that opens "<think>" unless
enable_thinking is false: the key headers, "auto" accepted, `thinking` reaching the template, thinking blocks and
thinking_delta events. The output shaping with text that holds tags is in tests/unit/test_messages_unit.py."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from server_helpers import API_KEY, ServerProc, free_port, metrics
from tiny_models import make_model

HEADERS = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "current weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 3}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
PING = {"name": "ping", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.base, headers=HEADERS, timeout=120) as c:
        yield c


def _body(**kw) -> dict:
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "system": SYSTEM, "messages": MESSAGES}
    body.update(kw)
    return body


def _post(http, **kw) -> dict:
    r = http.post("/v1/messages", json=_body(**kw))
    assert r.status_code == 200, r.text
    return r.json()


def _events(http, **kw) -> list[tuple[str, dict]]:
    """The (event name, data) pairs of a streamed answer; every data's type names its event."""
    events = []
    with http.stream("POST", "/v1/messages", json=_body(stream=True, **kw)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                events.append((name, data))
                name = None
            else:
                assert line == "", line
    return events


def _text(message: dict) -> str:
    return "".join(b["text"] for b in message["content"] if b["type"] == "text")


def _check_error(r: httpx.Response, status: int, kind: str, words: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and isinstance(body["error"]["message"], str), body
    assert words in body["error"]["message"], body


def test_message_equals_chat_completion(http):
    chat = http.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, *MESSAGES]}).json()
    msg = _post(http)
    assert set(msg) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    assert msg["id"].startswith("msg_") and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["model"] == "tiny"
    choice = chat["choices"][0]
    assert _text(msg) == choice["message"]["content"] and _text(msg)
    assert all(set(b) == {"type", "text"} and b["type"] == "text" for b in msg["content"])
    assert msg["stop_reason"] == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    assert msg["stop_sequence"] is None
    assert msg["usage"] == {"input_tokens": chat["usage"]["prompt_tokens"],
                            "output_tokens": chat["usage"]["completion_tokens"]}
    # system as text blocks (cache_control ignored) is the same prompt
    blocks = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    again = _post(http, system=blocks, metadata={"user_id": "u1"})
    assert again["content"] == msg["content"] and again["usage"] == msg["usage"] and again["id"] != msg["id"]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_tokens_cut(http, n):
    msg = _post(http, max_tokens=n)
    assert msg["stop_reason"] == "max_tokens" and msg["usage"]["output_tokens"] == n


def test_stop_sequence(http):
    full = _text(_post(http, max_tokens=16))
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].strip() == full[i:i + 2])
    msg = _post(http, max_tokens=16, stop_sequences=["@@never@@", stop])
    assert msg["stop_reason"] == "stop_sequence" and msg["stop_sequence"] == stop
    assert _text(msg) == full[:full.index(stop)]


def test_stream_events(http):
    whole = _post(http)
    events = _events(http)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"] == {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}
    middle = events[2:-2]
    assert middle[0][0] == "content_block_start" and middle[-1][0] == "content_block_stop"
    assert middle[0][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert {n for n, _ in middle[1:-1]} == {"content_block_delta"}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in middle[1:-1])
    assert "".join(d["delta"]["text"] for _, d in middle[1:-1]) == _text(whole)
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": whole["stop_reason"],
                                                                "stop_sequence": None},
                             "usage": {"output_tokens": whole["usage"]["output_tokens"]}}


def test_forced_named_tool(http):
    msg = _post(http, max_tokens=60, tools=[WEATHER, PING], tool_choice={"type": "tool", "name": "get_weather"})
    assert msg["stop_reason"] == "tool_use"
    [block] = msg["content"]
    assert set(block) == {"type", "id", "name", "input"} and block["type"] == "tool_use"
    assert block["id"].startswith("toolu_") and block["name"] == "get_weather"
    assert set(block["input"]) == {"city", "unit"} and block["input"]["unit"] in ("c", "f")
    assert len(block["input"]["city"]) <= 3


def test_forced_any_tool_streamed(http):
    kw = dict(max_tokens=80, tools=[WEATHER, PING], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    whole = _post(http, **kw)
    assert whole["stop_reason"] == "tool_use" and [b["type"] for b in whole["content"]] == ["tool_use"]
    events = _events(http, **kw)
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use"]
    block = starts[0]["content_block"]
    assert block["input"] == {} and block["name"] == whole["content"][0]["name"] and block["id"].startswith("toolu_")
    pieces = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"]
    assert all(d["delta"]["type"] == "input_json_delta" for n, d in events if n == "content_block_delta")
    assert json.loads("".join(pieces)) == whole["content"][0]["input"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


TOOL_ROUND = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "call it", "signature": "sig"},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Par", "unit": "c"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_abc", "content": [{"type": "text", "text": "18 degrees"}]}]},
]
TOOL_ROUND_CHAT = [  # what TOOL_ROUND is served as (the thinking block is dropped)
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Par", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_abc", "content": "18 degrees"},
]


def test_tool_round_trip_and_count_tokens(http):
    count = http.post("/v1/messages/count_tokens", json={
        "model": "tiny", "system": SYSTEM, "messages": TOOL_ROUND, "tools": [WEATHER]})
    assert count.status_code == 200 and set(count.json()) == {"input_tokens"}
    tok = http.post("/tokenize", json={"model": "tiny", "messages": TOOL_ROUND_CHAT,
                                       "tools": [{"type": "function", "function": {
                                           "name": "get_weather", "description": "current weather",
                                           "parameters": WEATHER["input_schema"]}}]}).json()
    assert count.json()["input_tokens"] == tok["count"] > 20
    msg = _post(http, messages=TOOL_ROUND, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=4)
    assert msg["usage"]["input_tokens"] == tok["count"] and msg["stop_reason"] == "max_tokens"
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "temperature": 0,
                                                   "messages": TOOL_ROUND_CHAT}).json()
    assert _text(msg) == chat["choices"][0]["message"]["content"]
    # the same body as /v1/messages counts what the message's usage says
    plain = http.post("/v1/messages/count_tokens", json=_body()).json()
    assert plain["input_tokens"] == _post(http, max_tokens=1)["usage"]["input_tokens"]


def _tokens(http, chat_messages: list[dict]) -> int:
    return http.post("/tokenize", json={"model": "tiny", "messages": chat_messages}).json()["count"]


def test_system_role_messages(http):
    # Claude Code >= 2.1.154 sends system messages inside `messages`: one that opens them joins `system`, a later one
    # stays a system turn in place (the ChatML template renders one anywhere, so the probe keeps them)
    messages = [{"role": "system", "content": "Lead."}, *MESSAGES, {"role": "system", "content": "Be brief."}]
    chat_messages = [{"role": "system", "content": SYSTEM + "\n\nLead."}, *MESSAGES,
                     {"role": "system", "content": "Be brief."}]
    count = http.post("/v1/messages/count_tokens", json={"model": "tiny", "system": SYSTEM, "messages": messages})
    assert count.status_code == 200 and count.json()["input_tokens"] == _tokens(http, chat_messages)
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 12, "temperature": 0,
                                                   "messages": chat_messages}).json()
    assert _text(_post(http, messages=messages)) == chat["choices"][0]["message"]["content"]


def test_tool_search_result_and_adaptive_thinking(http):
    # Claude Code's tool search answers with tool_reference blocks naming the deferred tools it loaded; its
    # requests carry thinking {"type": "adaptive"} and output_config.effort
    result = {"type": "tool_result", "tool_use_id": "toolu_abc", "content": [
        {"type": "text", "text": "18 degrees"}, {"type": "tool_reference", "tool_name": "ping"}]}
    msg = _post(http, messages=[*TOOL_ROUND[:2], {"role": "user", "content": [result]}], max_tokens=4,
                tools=[WEATHER, {**PING, "defer_loading": True}], tool_choice={"type": "none"},
                thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "high"})
    reference = {"role": "tool", "tool_call_id": "toolu_abc", "content": '[{"type": "tool_reference", "name": "ping"}]'}
    assert msg["usage"]["input_tokens"] == _tokens(http, [*TOOL_ROUND_CHAT, reference])


def test_output_config_json_schema(http):
    fmt = {"type": "json_schema", "schema": WEATHER["input_schema"]}
    msg = _post(http, max_tokens=60, output_config={"format": fmt})
    value = json.loads(_text(msg))
    assert set(value) == {"city", "unit"} and value["unit"] in ("c", "f") and len(value["city"]) <= 3
    assert msg["stop_reason"] == "end_turn"
    events = _events(http, max_tokens=60, output_format=fmt)  # the beta's older spelling
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == _text(msg)
    _check_error(http.post("/v1/messages", json=_body(output_config={"format": {"type": "xml"}})), 400,
                 "invalid_request_error", "json_schema")
    bad = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
    _check_error(http.post("/v1/messages", json=_body(output_config={"format": bad})), 400,
                 "invalid_request_error", "output_config.format.schema")


def test_errors(http, tiny_server):
    _check_error(http.post("/v1/messages", json={"model": "tiny", "messages": MESSAGES}), 400,
                 "invalid_request_error", "max_tokens")
    _check_error(http.post("/v1/messages", json=_body(model="claude-sonnet-4-5")), 404, "not_found_error",
                 "claude-sonnet-4-5")
    _check_error(http.post("/v1/messages/count_tokens", json={"model": "nope", "messages": MESSAGES}), 404,
                 "not_found_error")
    _check_error(http.post("/v1/messages", content=b"{not json"), 400, "invalid_request_error", "JSON")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    _check_error(http.post("/v1/messages", json=_body(messages=[{"role": "user", "content": [image]}])), 400,
                 "invalid_request_error", "image")
    _check_error(http.post("/v1/messages", json=_body(tools=[{"type": "web_search_20250305", "name": "web_search",
                                                              "max_uses": 3}])),
                 400, "invalid_request_error", "server tools")
    _check_error(http.post("/v1/messages", json=_body(mcp_servers=[{"type": "url", "url": "https://x", "name": "x"}])),
                 400, "invalid_request_error", "mcp_servers")
    # "auto" needs --enable-auto-tool-choice and --tool-call-parser, as in chat
    _check_error(http.post("/v1/messages", json=_body(tools=[WEATHER], tool_choice={"type": "auto"})), 400,
                 "invalid_request_error", "--enable-auto-tool-choice")
    _check_error(http.post("/v1/messages", json=_body(tools=[WEATHER])), 400, "invalid_request_error", "auto")
    _check_error(http.post("/v1/messages", json=_body(max_tokens=100000)), 400, "invalid_request_error")
    _check_error(http.get("/v1/messages"), 405, "invalid_request_error")
    _check_error(http.post("/v1/messages/batches", json={}), 404, "not_found_error")
    # the OpenAI routes keep their own shape
    r = http.post("/v1/chat/completions", json={"model": "claude", "messages": MESSAGES})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_metrics_count_the_routes(http, tiny_server):
    def counts() -> dict:
        out = {}
        for line in httpx.get(tiny_server.base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("voltllm:http_requests_total{") and "/v1/messages" in line:
                labels, value = line.rsplit(" ", 1)
                out[labels] = float(value)
        return out

    before = counts()
    _post(http, max_tokens=1)
    http.post("/v1/messages/count_tokens", json=_body())
    http.post("/v1/messages", json=_body(model="nope"))
    after = counts()
    for path, status in (("/v1/messages", "200"), ("/v1/messages/count_tokens", "200"), ("/v1/messages", "404")):
        key = next(k for k in after if f'path="{path}"' in k and f'status="{status}"' in k and 'method="POST"' in k)
        assert after[key] == before.get(key, 0) + 1, (key, before, after)


def test_disconnect_aborts(http, tiny_server):
    def aborted() -> float:
        for line in httpx.get(tiny_server.base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("voltllm:request_success_total{") and 'finished_reason="abort"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = aborted()
    # (greedy: this prompt runs all 900 tokens, so no end of sequence can come before the abort on a loaded host)
    with http.stream("POST", "/v1/messages", json=_body(stream=True, max_tokens=900, temperature=0)) as r:
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break  # the client goes away mid-answer
    deadline = time.monotonic() + 30
    while aborted() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert aborted() == before + 1
    # (the running gauge comes with the engine's next outputs, which may follow the abort's by a step)
    while metrics(tiny_server)["voltllm:num_requests_running"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metrics(tiny_server)["voltllm:num_requests_running"] == 0


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is "
    "false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_thinking")
    path = make_model(str(d), "llama")
    template = d / "template.jinja"
    template.write_text(THINKING_TEMPLATE)
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny",
                      "--chat-template", str(template), "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--api-key", API_KEY, "--disable-log-stats",
                      "--disable-uvicorn-access-log"], free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def keyed(thinking_server):
    with httpx.Client(base_url=thinking_server.base, headers={"x-api-key": API_KEY,
                                                              "anthropic-version": "2023-06-01"}, timeout=120) as c:
        yield c


def test_api_key_headers(thinking_server):
    url = thinking_server.base + "/v1/messages"
    body = _body(max_tokens=1)
    assert httpx.post(url, json=body, headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        _check_error(httpx.post(url, json=body, headers=headers), 401, "authentication_error", "x-api-key")
        _check_error(httpx.post(url + "/count_tokens", json=body, headers=headers), 401, "authentication_error")
    r = httpx.post(thinking_server.base + "/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's body, as before


def test_thinking_blocks_and_template_kwarg(keyed):
    on = {"type": "enabled", "budget_tokens": 1024}
    off = {"type": "disabled"}
    count = {k: keyed.post("/v1/messages/count_tokens", json=_body(thinking=t)).json()["input_tokens"]
             for k, t in (("on", on), ("off", off), ("unset", None))}
    assert count["off"] > count["on"] == count["unset"]  # "<think>\n\n</think>\n\n" against "<think>\n"
    # the prompt opens <think>: the (random) output is all reasoning, cut by max_tokens
    msg = _post(keyed, thinking=on, max_tokens=8)
    assert [b["type"] for b in msg["content"]] == ["thinking"] and msg["stop_reason"] == "max_tokens"
    block = msg["content"][0]
    assert set(block) == {"type", "thinking", "signature"} and block["thinking"] and block["signature"] == ""
    events = _events(keyed, thinking=on, max_tokens=8)
    start = next(d for n, d in events if n == "content_block_start")
    assert start["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert deltas and all(d["type"] == "thinking_delta" for d in deltas)
    assert "".join(d["thinking"] for d in deltas) == block["thinking"]
    # thinking disabled: the template closes the think block, the output is text
    msg = _post(keyed, thinking=off, max_tokens=8)
    assert [b["type"] for b in msg["content"]] == ["text"] and msg["usage"]["input_tokens"] == count["off"]


def test_auto_tool_choice_with_parser(keyed):
    msg = _post(keyed, tools=[WEATHER], tool_choice={"type": "auto"}, thinking={"type": "disabled"}, max_tokens=6)
    assert msg["stop_reason"] == "max_tokens" and [b["type"] for b in msg["content"]] == ["text"]
    msg = _post(keyed, tools=[WEATHER], messages=TOOL_ROUND, max_tokens=3)  # tool_choice unset: auto
    assert msg["usage"]["output_tokens"] == 3
