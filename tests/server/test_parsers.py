"""Reasoning (qwen3) and tool-call (hermes, qwen3_coder) parsers, streamed and not (no server needed)."""
from __future__ import annotations

import json

import pytest

from chat_streams import chat_pieces

from voltllm.entrypoints.openai.parsers import (REASONING_PARSERS, HermesToolParser, Qwen3CoderToolParser,
                                                ReasoningParser)


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


QWEN35_PROMPT = "<|im_start|>assistant\n<think>\n"
CALL_IN_THINKING = ("I need the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>")


def test_qwen3_reasoning_ends_at_a_tool_call_opened_inside_it():
    """Qwen3.5 may open "<tool_call><function=..." before "</think>": as vLLM's qwen3 parser, the call ends the
    reasoning and is content (for the tool parser), streamed or not; the reasoning holds back a partial tag."""
    p = REASONING_PARSERS["qwen3"](QWEN35_PROMPT)
    call = CALL_IN_THINKING[CALL_IN_THINKING.index("<tool_call>"):]
    assert p.split(CALL_IN_THINKING, True, streaming=False) == ("I need the weather.\n", call)
    assert _streamed_reasoning(p, CALL_IN_THINKING) == ("I need the weather.\n", call)
    for partial in ("I need the weather.\n<tool_ca", "I need the weather.\n<tool_call>\n", "I need the weather.\n"
                    "<tool_call>\n<func", "I need the weather.\n<tool_call>\n<function"):
        assert p.split(partial, False, streaming=True) == ("I need the weather.\n", ""), partial
    # after the call, a "</think>" is content too: the first of the two ends the reasoning
    assert p.split("a<tool_call><function=f></function></tool_call></think>b", True, False)[0] == "a"
    # the tag alone (no "<function" after it) is only talk about it: the reasoning goes on
    talk = "Maybe a <tool_call> block? No.</think>Done."
    assert p.split(talk, True, streaming=False) == ("Maybe a <tool_call> block? No.", "Done.")
    assert _streamed_reasoning(p, talk) == ("Maybe a <tool_call> block? No.", "Done.")
    assert p.split("hmm <tool_call>", True, streaming=False) == ("hmm <tool_call>", "")  # cut short
    # deepseek_r1 keeps "</think>" as the only end
    assert REASONING_PARSERS["deepseek_r1"](QWEN35_PROMPT).split(CALL_IN_THINKING, True, False) == \
        (CALL_IN_THINKING, "")


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


def _streamed_tools(parser, text: str, step: int = 3, seen: list = None):
    """The content and calls a stream ends with; seen: each new state of the calls' arguments."""
    sent, calls = "", []
    for cum, done in _stream_pieces(text, step):
        content, got = parser.extract(cum, done)
        assert content.startswith(sent)  # never takes back what was sent
        assert len(got) >= len(calls)
        for was, now in zip(calls, got):  # a call sent keeps its name; its arguments only grow
            assert was["name"] == now["name"] and now["arguments"].startswith(was["arguments"]), (was, now)
        if seen is not None and [c["arguments"] for c in got] != (seen[-1] if seen else None):
            seen.append([c["arguments"] for c in got])
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


WRITE_TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"}}}}}]
WRITE_CALL = ("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/app.py\n</parameter>\n<parameter=content>\n"
              "import os\nprint(os.getcwd())\n</parameter>\n<parameter=mode>\n644\n</parameter>\n</function>\n"
              "</tool_call>")


def test_qwen3_coder_streams_the_name_then_each_parameter():
    """As vLLM's qwen3_coder: the call goes out once "<function=NAME>" is complete, its arguments "{" and then each
    parameter once it is complete, the "}" at "</function>"; the pieces add up to the non-streamed arguments."""
    p = Qwen3CoderToolParser(WRITE_TOOLS)
    text = "Writing it." + WRITE_CALL + WRITE_CALL.replace("src/app.py", "b.txt")
    content, calls = p.extract(text, True)
    assert content == "Writing it." and [c["name"] for c in calls] == ["write_file", "write_file"]
    assert json.loads(calls[0]["arguments"]) == {"path": "src/app.py", "content": "import os\nprint(os.getcwd())",
                                                 "mode": 644}
    for step in (1, 5):
        seen: list = []
        assert _streamed_tools(p, text, step, seen) == (content, calls)
        first = [s[0] for s in seen if s]
        assert first[0] == "{"  # the name goes before any argument is complete
        assert first[1:4] == ['{"path": "src/app.py"',
                              '{"path": "src/app.py", "content": "import os\\nprint(os.getcwd())"',
                              '{"path": "src/app.py", "content": "import os\\nprint(os.getcwd())", "mode": 644'], first
        assert first[4] == calls[0]["arguments"]
    # still open: the name as soon as it is complete, nothing before
    assert p.extract("<tool_call>\n<function=write_fi", False) == ("", [])
    assert p.extract("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a", False) == \
        ("", [{"name": "write_file", "arguments": "{"}])
    # a parameter without its "</parameter>" is complete when the next one opens
    assert p.extract("<tool_call><function=write_file><parameter=path>a.py<parameter=con", False)[1] == \
        [{"name": "write_file", "arguments": '{"path": "a.py"'}]


# (the broken block has no name string: a block whose name was read is a call, its arguments streamed as written;
# tests/unit/test_hermes_streaming.py)
VALID_THEN_BROKEN = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                     '<tool_call>\n{name: "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                     '{"name": "get_time", "arguments": {}}\n</tool_call>')
BROKEN_AT = VALID_THEN_BROKEN.index('<tool_call>\n{name: "get_time"')


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


def _chat_pieces(text: str, step: int, tools: list, parser: str = "hermes", reasoning: str = None,
                 prompt: str = "prompt"):
    return chat_pieces(text, step, tools, parser, reasoning, prompt)


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
        firsts = [c for c in calls if "id" in c]  # (a call's first delta; its arguments follow in pieces)
        assert [c["function"]["name"] for c in firsts] == [c["function"]["name"] for c in message["tool_calls"]] \
            == ["get_weather"]
        assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
        assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"] == "tool_calls"


def test_qwen3_coder_call_written_in_the_thinking_through_the_chat_stream():
    """Qwen3.5's call inside its thinking comes back as tool_calls, streamed (arguments growing per parameter) and
    not, with the same reasoning, calls and finish reason."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    text = CALL_IN_THINKING.replace("</function>", "<parameter=days>\n3\n</parameter>\n</function>")
    for step in (1, 7):
        chunks, body = _chat_pieces(text, step, tools, "qwen3_coder", "qwen3", QWEN35_PROMPT)
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        message = body["choices"][0]["message"]
        assert message["reasoning"] == "".join(d.get("reasoning") or "" for d in deltas) == "I need the weather.\n"
        assert message["content"] is None and "".join(d.get("content") or "" for d in deltas) == ""
        pieces = [c for d in deltas for c in d.get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["function"]["arguments"] == "{"
        assert [p["function"]["arguments"] for p in pieces[1:]] == ['"city": "Paris"', ', "days": 3', "}"]
        assert "".join(p["function"]["arguments"] for p in pieces) == message["tool_calls"][0]["function"]["arguments"]
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
        assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"] == "tool_calls"
