"""tool_choice "required" / a named function without a server: the JSON schema built from the tools, the request
checks (400s), and reading the calls back out of the constrained output, whole and streamed."""
from __future__ import annotations

import json

import pytest

from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.forced_calls import forced_calls, required_calls
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest
from voltllm.entrypoints.openai.tool_choice import forced_tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: any JSON object
NODE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
    "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}}}}}}}
MSG = [{"role": "user", "content": "hi"}]


def _error(call) -> OpenAIError:
    with pytest.raises(OpenAIError) as exc:
        call()
    assert exc.value.status == 400
    return exc.value


def test_named_function_schema_is_its_parameters():
    forced = forced_tool_choice([WEATHER, PING], {"type": "function", "function": {"name": "get_weather"}}, True)
    assert (forced.mode, forced.name, forced.schema) == ("named", "get_weather", WEATHER["function"]["parameters"])
    assert forced_tool_choice([WEATHER, PING], {"type": "function", "function": {"name": "ping"}}, True).schema == {
        "type": "object"}
    for choice in (None, "none", "auto"):
        assert forced_tool_choice([WEATHER], choice, True) is None


def test_required_schema_is_an_array_of_calls():
    forced = forced_tool_choice([WEATHER, NODE], "required", True)
    s = forced.schema
    assert s["type"] == "array" and s["minItems"] == 1 and "maxItems" not in s
    names = [branch["properties"]["name"]["const"] for branch in s["items"]["anyOf"]]
    assert names == ["get_weather", "tree"]
    assert s["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    # the tree tool's $defs moved to the root, where its "#/$defs/node" now points; the tool is left as it was
    assert s["$defs"] == {"node": {"type": "object", "properties": {"v": {"type": "integer"}}}}
    assert "$defs" not in s["items"]["anyOf"][1]["properties"]["parameters"] and "$defs" in NODE["function"][
        "parameters"]
    assert forced_tool_choice([WEATHER], "required", False).schema["maxItems"] == 1  # parallel_tool_calls false
    forced.params()  # compiles


def test_forcing_choices_refused():
    e = _error(lambda: forced_tool_choice([WEATHER], {"type": "function", "function": {"name": "nope"}}, True))
    assert e.param == "tool_choice" and "nope" in e.message and "get_weather" in e.message
    assert _error(lambda: forced_tool_choice(None, "required", True)).param == "tool_choice"
    assert _error(lambda: forced_tool_choice([], {"type": "function", "function": {"name": "f"}}, True)).param == \
        "tool_choice"
    assert _error(lambda: forced_tool_choice([WEATHER], {"type": "function"}, True)).param == "tool_choice"
    assert _error(lambda: forced_tool_choice([{"type": "function"}], "required", True)).param == "tools"
    assert _error(lambda: forced_tool_choice([WEATHER, WEATHER], "required", True)).param == "tools"
    bad = {"type": "function", "function": {"name": "b", "parameters": {"type": "nope"}}}
    assert _error(lambda: forced_tool_choice([bad], "required", True).params()).param == "tools"


def test_forced_choice_is_the_one_constraint_of_a_request():
    named = {"type": "function", "function": {"name": "get_weather"}}
    req = ChatCompletionRequest(messages=MSG, tools=[WEATHER], tool_choice=named)
    req.check()
    assert json.loads(req.constraint().key[1]) == WEATHER["function"]["parameters"]
    assert req.sampling_params(10, None).structured_outputs.key == req.constraint().key
    for extra in ({"response_format": {"type": "json_object"}}, {"guided_regex": "a+"},
                  {"structured_outputs": {"choice": ["a"]}}):
        req = ChatCompletionRequest(messages=MSG, tools=[WEATHER], tool_choice="required", **extra)
        e = _error(req.check)
        assert e.param == "tool_choice" and "cannot be combined" in e.message
    # "none" leaves the tools out of it, and another constraint is fine then
    req = ChatCompletionRequest(messages=MSG, tools=[WEATHER], tool_choice="none", guided_regex="a+")
    req.check()
    assert req.constraint().kind == "regex"


def _grown(text: str, read) -> list[dict]:
    """The calls of text read at every length: names never change, arguments only grow, no call goes away."""
    prev: list[dict] = []
    for i in range(len(text) + 1):
        calls = read(text[:i], i == len(text))
        assert len(calls) >= len(prev), text[:i]
        for a, b in zip(prev, calls):
            assert a["name"] == b["name"] and b["arguments"].startswith(a["arguments"]), (a, b)
        prev = calls
    return prev


def test_required_calls_read_back_whole_and_growing():
    text = ('[{"name": "get_weather", "parameters": {"city": "P\\"}]a", "n": [1, {"x": 2}]}}, '
            '{"name": "ping", "parameters": {}}]')
    calls = required_calls(text)
    assert [c["name"] for c in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'P"}]a', "n": [1, {"x": 2}]}
    assert calls[1]["arguments"] == "{}"
    forced = forced_tool_choice([WEATHER, PING], "required", True)
    assert _grown(text, lambda t, done: forced_calls(forced, t, done)) == calls
    # cut short (max_tokens): the calls as far as they got
    assert required_calls(text[:60]) == [{"name": "get_weather", "arguments": text[39:60]}]
    assert required_calls('{"name": "x"}') == [] and required_calls("[") == []


def test_named_call_is_the_whole_output():
    forced = forced_tool_choice([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, True)
    assert forced_calls(forced, "", False) == []
    assert forced_calls(forced, "", True) == [{"name": "get_weather", "arguments": ""}]
    text = '{"city": "Oslo"}'
    assert _grown(text, lambda t, done: forced_calls(forced, t, done)) == [{"name": "get_weather", "arguments": text}]


def test_call_deltas_send_a_call_once_then_its_new_arguments():
    from voltllm.entrypoints.openai.serving_chat import _call_deltas

    def call(i, args):
        return {"id": f"call_{i}", "type": "function", "function": {"name": f"f{i}", "arguments": args}}

    sent: list[int] = []
    assert _call_deltas([], sent) == []
    assert _call_deltas([call(0, '{"a"')], sent) == [{"index": 0, **call(0, '{"a"')}]
    assert _call_deltas([call(0, '{"a"')], sent) == []  # nothing new
    assert _call_deltas([call(0, '{"a": 1}'), call(1, "{}")], sent) == [
        {"index": 0, "function": {"arguments": ": 1}"}}, {"index": 1, **call(1, "{}")}]
    assert sent == [8, 2]
