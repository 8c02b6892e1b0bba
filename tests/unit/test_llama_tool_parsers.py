"""The llama3_json and pythonic tool-call parsers (llama_tool_parsers.py) on Llama-like outputs, whole and streamed
(the cumulative text at several step sizes, as serving_chat hands it over): the same calls and content either way, and
a stream never takes back what it sent; then through the chat stream and body (stand-in engine outputs)."""
from __future__ import annotations

import json

import pytest

from chat_streams import chat_pieces

from voltllm.entrypoints.openai.parsers import TOOL_PARSERS
from voltllm.entrypoints.openai.llama_tool_parsers import Llama3JsonToolParser, PythonicToolParser


def _streamed(parser, text: str, step: int):
    sent, calls = "", []
    for end in list(range(1, len(text), step)) + [len(text)]:
        content, got = parser.extract(text[:end], end == len(text))
        assert content.startswith(sent), (text[:end], sent, content)  # never takes back content
        assert got[: len(calls)] == calls, (text[:end], calls, got)  # nor a call
        sent, calls = content, got
    return sent, calls


def _check(parser_cls, text: str, content: str, calls: list[tuple[str, dict]]):
    """Whole and streamed (fresh parsers, and one parser reused across the steps) give content and calls."""
    whole = parser_cls().extract(text, True)
    assert whole[0] == content
    assert [(c["name"], json.loads(c["arguments"])) for c in whole[1]] == calls
    for step in (1, 3, 8):
        assert _streamed(parser_cls(), text, step) == whole, step


WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'


@pytest.mark.parametrize("text, content, calls", [
    # Llama 3.1 / 3.2 / 3.3: the JSON object alone, "parameters" or "arguments"
    (WEATHER, "", [("get_weather", {"city": "Paris", "unit": "c"})]),
    (TIME, "", [("get_time", {"tz": "UTC"})]),
    # <|python_tag|> (kept when skip_special_tokens is off) and an end token after the call are dropped
    ("<|python_tag|>" + WEATHER + "<|eom_id|>", "", [("get_weather", {"city": "Paris", "unit": "c"})]),
    # several calls, separated by ";" and / or whitespace
    (WEATHER + "; " + TIME, "", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "UTC"})]),
    (WEATHER + "\n" + TIME + ";", "", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "UTC"})]),
    # text before the call is content; so is text after it (raw); leading whitespace alone is not
    ("I will check the weather.\n" + WEATHER, "I will check the weather.\n",
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("Sure <|python_tag|>" + WEATHER, "Sure ", [("get_weather", {"city": "Paris", "unit": "c"})]),
    (WEATHER + "\n\nI asked for the weather.", "I asked for the weather.",
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("\n  " + WEATHER, "", [("get_weather", {"city": "Paris", "unit": "c"})]),
    # arguments as a string holding a JSON object, nested values, unicode
    ('{"name": "f", "parameters": "{\\"a\\": 1}"}', "", [("f", {"a": 1})]),
    ('{"name": "f", "parameters": {"q": {"x": [1, -2.5, true, null]}, "s": "東京 \\"q\\""}}', "",
     [("f", {"q": {"x": [1, -2.5, True, None]}, "s": '東京 "q"'})]),
    # braces that are not calls stay content: code, JSON without a name, a JSON answer
    ("function f() { return {a: 1}; }", "function f() { return {a: 1}; }", []),
    ('Here is JSON: {"name": "Alice", "age": 3} and {"x": {"y": 1}}',
     'Here is JSON: {"name": "Alice", "age": 3} and {"x": {"y": 1}}', []),
    ("use {braces} then " + WEATHER, "use {braces} then ", [("get_weather", {"city": "Paris", "unit": "c"})]),
    # the first key: Llama's "name" (or Meta's documented "type"), or the arguments; any other makes it content
    ('{"type": "function", "name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ('{"parameters": {"a": 1}, "name": "f"}', "", [("f", {"a": 1})]),
    ('{"n\\u0061me": "f", "arguments": {}}', "", [("f", {})]),  # (the key as JSON reads it)
    ('{"id": 1, "name": "f", "parameters": {}}', '{"id": 1, "name": "f", "parameters": {}}', []),
    # malformed: all content
    ('{"name": "get_weather", "parameters": {"city": "Paris"', '{"name": "get_weather", "parameters": {"city": "Paris"',
     []),  # cut short by max_tokens
    ('{"name": "f", "parameters": {"a": 1}, }', '{"name": "f", "parameters": {"a": 1}, }', []),
    ('{"name": "f"}', '{"name": "f"}', []),  # no arguments
    ('{"name": 3, "parameters": {}}', '{"name": 3, "parameters": {}}', []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    ("{'name': 'f', 'parameters': {}}", "{'name': 'f', 'parameters': {}}", []),
    # a call, then one that does not parse: that and the rest are content, raw
    (WEATHER + '; {"name": "get_time", "parameters": {oops}}', '{"name": "get_time", "parameters": {oops}}',
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("no tools here", "no tools here", []),
    ("", "", []),
])
def test_llama3_json(text, content, calls):
    _check(Llama3JsonToolParser, text, content, calls)


CALLS = "[get_weather(city='Paris', unit=\"c\"), get_time()]"


@pytest.mark.parametrize("text, content, calls", [
    (CALLS, "", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
    ("[get_weather(city = 'Paris',)]", "", [("get_weather", {"city": "Paris"})]),
    # literal values: numbers (negative too), True / None and JSON's true / null, lists, tuples, dicts
    ("[f(a=-1, b=2.5, c=True, d=None, e=true, g=null, h=[1, (2, 3)], i={'k': {'n': -0.5}}, j='東京')]", "",
     [("f", {"a": -1, "b": 2.5, "c": True, "d": None, "e": True, "g": None, "h": [1, [2, 3]],
             "i": {"k": {"n": -0.5}}, "j": "東京"})]),
    # brackets and quotes inside strings
    ("[search(q='a ] b ) c', r=\"it's [x]\")]", "", [("search", {"q": "a ] b ) c", "r": "it's [x]"})]),
    # Llama 4's markers (kept when skip_special_tokens is off) are dropped
    ("<|python_start|>[get_time()]<|python_end|>", "", [("get_time", {})]),
    # text before the list is content, text after it too
    ("Let me look that up.\n\n" + CALLS, "Let me look that up.\n\n",
     [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
    ("[get_time()]\nDone.", "Done.", [("get_time", {})]),
    # not calls: all content
    ("See [the docs](https://example.com) or [1, 2].", "See [the docs](https://example.com) or [1, 2].", []),
    ("[get_weather('Paris')]", "[get_weather('Paris')]", []),  # positional arguments have no names
    ("[f(a=x)]", "[f(a=x)]", []),  # a variable is not a literal
    ("[f(a=1 + 2)]", "[f(a=1 + 2)]", []),
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[os.system(cmd='ls')]", "[os.system(cmd='ls')]", []),  # a call's name is a plain name
    ("[]", "[]", []),
    ("[f(a=1), 3]", "[f(a=1), 3]", []),
    ("[get_weather(city='Par", "[get_weather(city='Par", []),  # cut short by max_tokens
    ("[f(a=1)) ]", "[f(a=1)) ]", []),
    ("- [ ] item", "- [ ] item", []),
])
def test_pythonic(text, content, calls):
    _check(PythonicToolParser, text, content, calls)


def test_registered_names():
    assert TOOL_PARSERS["llama3_json"] is TOOL_PARSERS["llama4_json"] is Llama3JsonToolParser
    assert TOOL_PARSERS["pythonic"] is TOOL_PARSERS["llama4_pythonic"] is PythonicToolParser


def test_held_back_while_a_call_may_still_come():
    p = Llama3JsonToolParser()
    assert p.extract("Checking. <|python_", False) == ("Checking. ", [])
    assert p.extract('Checking. <|python_tag|>{"name": "get_weather", "param', False) == ("Checking. ", [])
    assert p.extract("Checking. <|python_", True) == ("Checking. <|python_", [])
    # a "{" that cannot become JSON goes out at once
    assert Llama3JsonToolParser().extract("if (x) { return", False) == ("if (x) { return", [])
    py = PythonicToolParser()
    assert py.extract("Okay: [get_weather(city='Pa", False) == ("Okay: ", [])
    assert py.extract("Okay: [get weather", False) == ("Okay: [get weather", [])


def test_a_reused_parser_looks_again_at_text_that_is_not_a_continuation():
    p = Llama3JsonToolParser()
    assert p.extract("abc {", True) == ("abc {", [])
    assert p.extract("abc {x", False) == ("abc {x", [])
    assert p.extract('abc {"name": "f", "parameters": {}}', True)[1] == [{"name": "f", "arguments": "{}"}]


def _chat(parser: str, text: str, step: int):
    return chat_pieces(text, step, parser=parser)


@pytest.mark.parametrize("parser, text, content", [
    ("llama3_json", "Checking.\n" + WEATHER + ";" + TIME, "Checking.\n"),
    ("pythonic", "Checking.\n[get_weather(city='Paris', unit='c'), get_time(tz='UTC')]", "Checking.\n"),
    ("llama3_json", WEATHER + ";" + TIME, None),
])
def test_through_the_chat_stream_and_body(parser, text, content):
    for step in (2, 7):
        chunks, body = _chat(parser, text, step)
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        message = body["choices"][0]["message"]
        assert message["content"] == content
        assert "".join(d.get("content") or "" for d in deltas) == (content or "")
        assert [c["index"] for c in calls] == [0, 1]  # each call once, whole
        for streamed, full in zip(calls, message["tool_calls"]):
            assert streamed["function"] == full["function"] and streamed["id"].startswith("call_")
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
        assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"tz": "UTC"}
        assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parser_cls, text, content, calls", [
    # NaN / Infinity are not JSON: content, streamed or not (Python's json would take them)
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"x": NaN}}', '{"name": "f", "parameters": {"x": NaN}}', []),
    # an end marker cut short by the end of the output is content
    (Llama3JsonToolParser, '{"name": "f", "parameters": {}}<|eom', "<|eom", [("f", {})]),
    # escapes, in JSON strings and Python ones
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"p": "C:\\\\dir \\"x\\" \\u00e9"}}', "",
     [("f", {"p": 'C:\\dir "x" é'})]),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"p": "\\x"}}', '{"name": "f", "parameters": {"p": "\\x"}}',
     []),
    (PythonicToolParser, "[f(p='it\\'s \\\\ ]', q=\"\\\"\")]", "", [("f", {"p": "it's \\ ]", "q": '"'})]),
    # Python names may be non-ASCII
    (PythonicToolParser, "[météo(ville='Paris')]", "", [("météo", {"ville": "Paris"})]),
])
def test_edge_cases(parser_cls, text, content, calls):
    _check(parser_cls, text, content, calls)


def _fed(parser, text: str, step: int):
    """The text fed to parser a few characters at a time, as a stream: its last answer."""
    for end in range(step, len(text), step):
        parser.extract(text[:end], False)
    return parser.extract(text, True)


ROWS = [{"id": i, "title": f"item {i}", "tags": ["a", "b"], "score": i * 0.5, "ok": True, "note": None}
        for i in range(200)]


@pytest.mark.parametrize("parser_cls, text, called", [
    # a long call: its strings, numbers and nested values
    (Llama3JsonToolParser, '{"name": "write", "parameters": {"text": "%s", "rows": %s}}'
     % ("lorem ipsum " * 1000, json.dumps(ROWS)), ["write"]),
    (PythonicToolParser, "[write(text='%s', rows=%s)]" % ("lorem ipsum " * 1000, [[r["id"], r] for r in ROWS]),
     ["write"]),
    # a long JSON answer that starts like a call (held back to its end, then content), pretty-printed
    (Llama3JsonToolParser, "Sure:\n" + json.dumps({"name": "report", "rows": ROWS}, indent=1), []),
    (Llama3JsonToolParser, json.dumps({"result": ROWS}), []),
])
def test_a_long_stream_reads_each_character_about_once(parser_cls, text, called, monkeypatch):
    """The text only grows, so each "{" / "[" is scanned on from where the last token stopped: the characters
    scanned stay within twice the text (not once per token, as a rescan from the "{" on every token would: the
    texts are 12 to 20 kB), and a closed object is decoded once."""
    import voltllm.entrypoints.openai.llama_tool_parsers as parsers

    strict, decodes = parsers._JSON, []

    class CountingDecoder:
        def raw_decode(self, s, idx):
            decodes.append(idx)
            return strict.raw_decode(s, idx)

    monkeypatch.setattr(parsers, "_JSON", CountingDecoder())
    whole = parser_cls().extract(text, True)
    assert [c["name"] for c in whole[1]] == called and (called or whole[0] == text)
    for step in (1, 4):
        decodes.clear()
        p = parser_cls()
        assert _fed(p, text, step) == whole
        assert p.chars_scanned <= 2 * len(text), (step, p.chars_scanned, len(text))
        assert len(decodes) == len(set(decodes))  # (each object decoded once at most)


def test_a_json_answer_streams_at_once():
    """An object whose first key is not a call's goes out as content once that key is complete, not at its end."""
    p = Llama3JsonToolParser()
    assert p.extract('Result: {"res', False) == ("Result: ", [])
    assert p.extract('Result: {"result": [1, ', False) == ('Result: {"result": [1, ', [])
    assert p.extract('Result: {"result": [1, {"name": "x"', False) == ('Result: {"result": [1, ', [])  # (may be one)
    assert p.extract('Result: {"result": [1, {"name": "x"}]}', True) == ('Result: {"result": [1, {"name": "x"}]}', [])


_PIECES = {
    Llama3JsonToolParser: ['{"name": "f", "parameters": {"a": 1}}', '{"name": "g", "arguments": {"s": "x}y{"}}',
                           '{"a": 1}', "{", "}", " ", ";", "text ", "<|python_tag|>", "<|eom_id|>", '"', "\\", "NaN",
                           "\n", "tru", '{"name": "f", "parameters": {"x": [1, {"y": null}]}}',
                           # pieces of keys, numbers and words cut anywhere, a first key that is not a call's
                           '{"', "name", '": ', "12", "e5", "true", ",", ":", "[", "]", '{"type": "function", ',
                           '"parameters": {', '"name": "h"', "\\u00e9", '{"id": 2, '],
    PythonicToolParser: ["[f(a=1)]", "[g(s='x]y'), h()]", "[", "]", "(", ")", "f(", "a=1", ",", " ", "text ", "'", '"',
                         "\\", "<|python_start|>", "<|python_end|>", "[1]", "h()", "[f(a=[1, {'k': None}])]",
                         "get_", "time", "=", "{", "}"],
}


@pytest.mark.parametrize("parser_cls", list(_PIECES))
def test_random_mixtures_stream_as_they_parse_whole(parser_cls):
    """Calls, pieces of calls, prose and markers in random order: every stream (never taking anything back) ends
    with what the whole text gives."""
    import random

    rng = random.Random(0)
    for _ in range(600):
        text = "".join(rng.choice(_PIECES[parser_cls]) for _ in range(rng.randint(1, 10)))
        whole = parser_cls().extract(text, True)
        for step in (1, 4):
            assert _streamed(parser_cls(), text, step) == whole, (text, step)
