"""Reasoning (qwen3) and tool-call (hermes, qwen3_coder) parsers, streamed and not (no server needed)."""
from __future__ import annotations

import json

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


def _streamed_tools(parser, text: str):
    sent, calls = "", []
    for cum, done in _stream_pieces(text):
        content, got, ok = parser.extract(cum, done)
        assert content.startswith(sent)
        assert got[: len(calls)] == calls
        sent, calls = content, got
    return sent, calls


def test_hermes_tool_calls():
    text = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    p = HermesToolParser()
    content, calls, ok = p.extract(text, True)
    assert ok and content == "I will check.\n"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert _streamed_tools(p, text) == (content, calls)
    # not a tool call: all content
    assert p.extract("no tools here", True) == ("no tools here", [], True)
    # a broken block is reported so the caller can show the raw text
    assert p.extract("<tool_call>{broken</tool_call>", True)[2] is False


def test_qwen3_coder_tool_calls_with_schema_types():
    tools = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"},
        "breakfast": {"type": "boolean"}, "extras": {"type": "array"}}}}}]
    text = ("<tool_call>\n<function=book>\n<parameter=city>\nNew York\n</parameter>\n<parameter=nights>\n3\n"
            "</parameter>\n<parameter=budget>\n99.5\n</parameter>\n<parameter=breakfast>\ntrue\n</parameter>\n"
            "<parameter=extras>\n[\"spa\"]\n</parameter>\n</function>\n</tool_call>")
    p = Qwen3CoderToolParser(tools)
    content, calls, ok = p.extract(text, True)
    assert ok and content == "" and calls[0]["name"] == "book"
    assert json.loads(calls[0]["arguments"]) == {"city": "New York", "nights": 3, "budget": 99.5, "breakfast": True,
                                                 "extras": ["spa"]}
    assert _streamed_tools(p, text) == (content, calls)
