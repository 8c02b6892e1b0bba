"""tool_choice "required" and a named function over HTTP with the openai client, on the tiny random model that
test_structured_outputs_server.py serves too (conftest.py `tiny_server`, started once): its output is garbage
unless constrained, so every call's arguments parsing and following its function's schema is the check. Streamed
and not, n > 1, and the 400s. The server runs without --enable-auto-tool-choice / --tool-call-parser: forced tool
choices need neither."""
from __future__ import annotations

import json

import openai
import pytest

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "current weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 3}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
COUNT = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: any JSON object
TOOLS = [WEATHER, COUNT]


def _check_args(name: str, arguments: str) -> dict:
    """arguments parse and follow the function's schema (checked by hand)."""
    args = json.loads(arguments)
    assert isinstance(args, dict), arguments
    if name == "get_weather":
        assert set(args) == {"city", "unit"}, args
        assert isinstance(args["city"], str) and len(args["city"]) <= 3 and args["unit"] in ("c", "f"), args
    elif name == "count":
        assert set(args) == {"n", "ok"}, args
        assert type(args["n"]) is int and 0 <= args["n"] <= 9 and isinstance(args["ok"], bool), args
    else:
        raise AssertionError(f"not a tool: {name!r}")
    return args


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat(client, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0)
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **kw)


_ANSWERS: dict[str, object] = {}


def _answer(client, **kw):
    """A non-streamed answer, asked once per module: the streaming test compares its deltas with the answers the
    other tests got (this 2-core machine decodes a constrained request at only ~20 tokens/s)."""
    key = json.dumps(kw, sort_keys=True)
    if key not in _ANSWERS:
        _ANSWERS[key] = _chat(client, **kw)
    return _ANSWERS[key]


NAMED = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
REQUIRED = {"tool_choice": "required", "n": 2, "temperature": 1.0, "seed": 1}  # 2 calls in one choice, both tools


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_named_function(client):
    out = _answer(client, **NAMED)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    _check_args("get_weather", call.function.arguments)
    sampled = _chat(client, tool_choice=_named("count"), n=2, temperature=1.0, seed=3)
    assert len(sampled.choices) == 2
    ids = set()
    for c in sampled.choices:
        [call] = c.message.tool_calls
        assert call.function.name == "count" and c.finish_reason == "tool_calls"
        _check_args("count", call.function.arguments)
        ids.add(call.id)
    assert len(ids) == 2  # a fresh id per call


def test_named_function_without_parameters_is_any_object(client):
    bias = {"4": 2.0, "95": 2.0}  # (as for json_object: a random model may otherwise write one key for ever)
    out = _chat(client, tools=[PING, WEATHER], tool_choice=_named("ping"), logit_bias=bias)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "ping" and isinstance(json.loads(call.function.arguments), dict)


def test_required(client):
    seen, counts = set(), []
    for out in (_answer(client, **REQUIRED), _chat(client, tool_choice="required", n=2, seed=5, temperature=1.0,
                                                    parallel_tool_calls=False)):
        counts.append([len(c.message.tool_calls or []) for c in out.choices])
        for c in out.choices:
            calls = _calls(c.message)
            assert calls and c.finish_reason == "tool_calls" and not c.message.content, c
            for name, arguments in calls:
                _check_args(name, arguments)
                seen.add(name)
            assert len({tc.id for tc in c.message.tool_calls}) == len(calls)
    assert seen == {"get_weather", "count"}  # both tools are reachable
    assert max(counts[0]) > 1 and counts[1] == [1, 1], counts  # parallel_tool_calls false: one call each


def _streamed(client, **kw) -> tuple[list[list[tuple[str, str]]], list[str], int]:
    """Each choice's calls as the deltas build them, its finish reason, and the number of tool-call deltas; checks
    the delta shapes."""
    calls: dict[int, list[list]] = {}
    finish: dict[int, str] = {}
    deltas = 0
    for chunk in _chat(client, stream=True, **kw):
        for ch in chunk.choices:
            assert not ch.delta.content
            for d in ch.delta.tool_calls or []:
                deltas += 1
                mine = calls.setdefault(ch.index, [])
                if d.index == len(mine):  # a new call: id, type and name come with it, once
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name
                    mine.append([d.function.name, d.function.arguments or ""])
                else:
                    assert d.index == len(mine) - 1 and d.id is None and not d.function.name, d
                    mine[d.index][1] += d.function.arguments
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    n = kw.get("n", 1)
    return [[tuple(c) for c in calls.get(i, [])] for i in range(n)], [finish.get(i) for i in range(n)], deltas


def test_streamed_named_and_required_add_up_to_the_full_answer(client):
    for kw in (NAMED, REQUIRED):
        full = _answer(client, **kw)
        calls, finish, deltas = _streamed(client, **kw)
        assert calls == [_calls(c.message) for c in full.choices], (calls, full)
        assert finish == ["tool_calls"] * len(full.choices)
        assert deltas > 3 * sum(map(len, calls))  # the arguments arrive piece by piece, not in one go
        for choice_calls in calls:
            for name, arguments in choice_calls:
                _check_args(name, arguments)


def test_none_ignores_the_tools(client):
    c = _chat(client, tool_choice="none", max_tokens=8).choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason == "length"


def _bad(call) -> dict:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    return exc.value.response.json()["error"]


def test_refused(client):
    body = _bad(lambda: _chat(client, tool_choice=_named("nope")))
    assert body["param"] == "tool_choice" and "nope" in body["message"], body
    body = _bad(lambda: _chat(client, tool_choice="required", response_format={"type": "json_object"}))
    assert body["param"] == "tool_choice" and "response_format" in body["message"], body
    body = _bad(lambda: _chat(client, tool_choice=_named("count"), extra_body={"guided_regex": "a+"}))
    assert body["param"] == "tool_choice", body
    body = _bad(lambda: _chat(client, tools=openai.NOT_GIVEN, tool_choice="required"))
    assert body["param"] == "tool_choice" and "tools" in body["message"], body
    body = _bad(lambda: _chat(client, tools=[{"type": "function", "function": {"description": "no name"}}],
                              tool_choice="required"))
    assert body["param"] == "tools", body
    # "auto" still needs a parser, which this server has none of
    assert _bad(lambda: _chat(client, tool_choice="auto"))["param"] == "tool_choice"
    assert _chat(client, tool_choice=_named("count")).choices[0].message.tool_calls  # and it still serves
