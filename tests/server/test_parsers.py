"""Reasoning (qwen3) and tool-call (hermes, qwen3_coder) parsers, streamed and not (no server needed)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from voltllm.entrypoints.openai.parsers import HermesToolParser, Qwen3CoderToolParser, ReasoningParser


def _stream_pieces(text: str, step: int = 3):
    for i in range(1, len(text) + 1, step):
        yield text[:i], False
    yield text, True


def _streamed_reasoning(parser: ReasoningParser, text: str) -> tuple[str, str]:
    sent_r, sent_c = "", ""
    for cum, done in _stream_pieces(text):
        r, c = parser.split(cum, done, streaming=True)
        r = r or ""
        assert r.startswith(sent_r) and c.startswith(sent_c), (cum, r, c)  # never takes back what was sent
        sent_r, sent_c = r, c
    return sent_r, sent_c


def test_qwen3_reasoning_split():
    text = "<think>\nLet me think. 2+2=4.\n</think>\n\nThe answer is 4."
    p = ReasoningParser("<|im_start|>assistant\n")
    assert p.split(text, True, streaming=False) == ("Let me think. 2+2=4.\n", "The answer is 4.")
    assert _streamed_reasoning(p, text) == ("Let me think. 2+2=4.\n", "The answer is 4.")


def test_qwen3_reasoning_opened_by_template_and_absent():
    p = ReasoningParser("<|im_start|>assistant\n<think>\n")
    assert p.split("hmm</think>ok", True, streaming=False) == ("hmm", "ok")
    assert _streamed_reasoning(p, "hmm</think>ok") == ("hmm", "ok")
    plain = ReasoningParser("<|im_start|>assistant\n")
    assert plain.split("Just an answer.", True, streaming=False) == (None, "Just an answer.")
    assert _streamed_reasoning(plain, "Just an answer.") == ("", "Just an answer.")
    # reasoning cut short by max_tokens: all of it is reasoning
    assert plain.split("<think>still going", True, streaming=False) == ("still going", "")


def test_reasoning_split_on_the_delimiters_reasoning_config_names():
    """--reasoning-config's strings are the engine's delimiters (budgets, grammars after the reasoning): the chat
    parser splits on the same ones, streamed or not."""
    p = ReasoningParser("<|im_start|>assistant\n", "[THINK]", "[/THINK]")
    text = "[THINK]plan it[/THINK]The plan."
    assert p.split(text, True, streaming=False) == ("plan it", "The plan.")
    assert _streamed_reasoning(p, text) == ("plan it", "The plan.")
    assert p.split("<think>x</think>y", True, streaming=False) == (None, "<think>x</think>y")
    opened = ReasoningParser("<|im_start|>assistant\n[THINK]", "[THINK]", "[/THINK]")
    assert opened.split("hmm[/THINK]ok", True, streaming=False) == ("hmm", "ok")


def _streamed_tools(parser, text: str, step: int = 3):
    sent, calls = "", []
    for cum, done in _stream_pieces(text, step):
        content, got = parser.extract(cum, done)
        assert content.startswith(sent)  # never takes back what was sent
        assert got[: len(calls)] == calls
        sent, calls = content, got
    return sent, calls


def test_hermes_tool_calls():
    text = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    p = HermesToolParser()
    content, calls = p.extract(text, True)
    assert content == "I will check.\n"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert _streamed_tools(p, text) == (content, calls)
    # not a tool call: all content
    assert p.extract("no tools here", True) == ("no tools here", [])
    # a block that does not parse is content, raw
    assert p.extract("<tool_call>{broken</tool_call>", True) == ("<tool_call>{broken</tool_call>", [])


def test_qwen3_coder_tool_calls_with_schema_types():
    tools = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"},
        "breakfast": {"type": "boolean"}, "extras": {"type": "array"}}}}}]
    text = ("<tool_call>\n<function=book>\n<parameter=city>\nNew York\n</parameter>\n<parameter=nights>\n3\n"
            "</parameter>\n<parameter=budget>\n99.5\n</parameter>\n<parameter=breakfast>\ntrue\n</parameter>\n"
            "<parameter=extras>\n[\"spa\"]\n</parameter>\n</function>\n</tool_call>")
    p = Qwen3CoderToolParser(tools)
    content, calls = p.extract(text, True)
    assert content == "" and calls[0]["name"] == "book"
    assert json.loads(calls[0]["arguments"]) == {"city": "New York", "nights": 3, "budget": 99.5, "breakfast": True,
                                                 "extras": ["spa"]}
    assert _streamed_tools(p, text) == (content, calls)


VALID_THEN_BROKEN = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_time", "arguments": {oops}\n</tool_call>\n<tool_call>\n'
                     '{"name": "get_time", "arguments": {}}\n</tool_call>')
BROKEN_AT = VALID_THEN_BROKEN.index("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {oops}")


@pytest.mark.parametrize("text, calls, content", [
    # a valid call, then a block that does not parse: the call stands, the rest is content (raw, the later valid
    # block too)
    (VALID_THEN_BROKEN, ["get_weather"], "Checking." + VALID_THEN_BROKEN[BROKEN_AT:]),
    # the broken block first: no calls, all content
    (VALID_THEN_BROKEN[BROKEN_AT:], [], VALID_THEN_BROKEN[BROKEN_AT:]),
    # a last block cut short (max_tokens) that does not parse
    (VALID_THEN_BROKEN[:BROKEN_AT] + '<tool_call>\n{"name": "get_ti', ["get_weather"],
     "Checking." + '<tool_call>\n{"name": "get_ti'),
])
def test_hermes_rule_for_blocks_that_do_not_parse(text, calls, content):
    """Streamed (at several step sizes) and whole, the same calls and content."""
    p = HermesToolParser()
    whole = p.extract(text, True)
    assert [c["name"] for c in whole[1]] == calls and whole[0] == content
    for step in (1, 4, 11):
        assert _streamed_tools(p, text, step) == whole


def _chat_pieces(text: str, step: int, tools: list):
    """The SSE chunks and the JSON body serving_chat makes of a model's text (stand-in engine outputs)."""
    import asyncio

    from voltllm.engine.outputs import CompletionOutput, RequestOutput
    from voltllm.entrypoints.openai.protocol import ChatCompletionRequest
    from voltllm.entrypoints.openai.serving_chat import ChatPlan, _full_response, _stream
    from voltllm.entrypoints.openai.serving_common import ServerState

    outs = []
    for end in list(range(step, len(text), step)) + [len(text)]:
        c = CompletionOutput(0, text[:end], list(range(end)), finish_reason="stop" if end == len(text) else None)
        outs.append(RequestOutput("chatcmpl-1", None, [1, 2], [c], end == len(text)))

    class Stream:
        async def __aiter__(self):
            for o in outs:
                yield o

        def close(self):
            pass

    state = ServerState(engine=SimpleNamespace(tokenizer=None), served_model_names=["m"], max_model_len=64,
                        model_path="m", tool_call_parser="hermes", enable_auto_tool_choice=True)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, stream=True)
    plan = ChatPlan("chatcmpl-1", "m", 1, "prompt", True, None, 1, None)

    async def go():
        return [e async for e in _stream(state, req, plan, [Stream()])]
    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(go())]
    return chunks, _full_response(state, req, plan, outs[-1])


def test_hermes_rule_through_the_chat_stream():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "get_time")]
    for step in (2, 9):
        chunks, body = _chat_pieces(VALID_THEN_BROKEN, step, tools)
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        content = "".join(d.get("content") or "" for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        message = body["choices"][0]["message"]
        assert content == message["content"] == "Checking." + VALID_THEN_BROKEN[BROKEN_AT:]
        assert [c["function"]["name"] for c in calls] == [c["function"]["name"] for c in message["tool_calls"]] \
            == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"] == "tool_calls"
