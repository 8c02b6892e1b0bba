"""The hermes tool parser streams each call's arguments as they are written (hermes_reader.py): fed the cumulative
text at every step size and every split point, a call's arguments only grow, each state is a prefix of the finished
arguments, and the finished arguments are json.dumps(json.loads(...)) of what the model wrote, the same streamed or
not; then through the chat stream (stand-in engine outputs): the name first, argument deltas that add up."""
from __future__ import annotations

import json
import time

import pytest

from chat_streams import chat_pieces

from voltllm.entrypoints.openai.hermes_reader import HermesCallReader
from voltllm.entrypoints.openai.parsers import HermesToolParser

# bodies of valid calls: nested containers, strings holding braces, tags, escapes, unicode and surrogate pairs,
# numbers json.dumps rewrites, literals, string arguments, "parameters", other keys, odd whitespace
VALID_BODIES = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}',
    '\n{"name": "write", "arguments": {"path": "a}b.py", "text": "x = {1: [2]}\\n</tool_call> <tool_call>\\"}"}}\n',
    '{"name":"f","arguments":{"a":{"b":{"c":[1,[2,[3,{}]],[]]}},"d":[]}}',
    '{ "name" : "f" , "arguments" : { "s" : "tab\\there\\u00e9\\ud83d\\ude00 \\u4e2d\\/\\b\\f\\r" } }',
    '{"name": "f", "arguments": {"n": [0, -0, 1.50, 1e2, -2.5E-3, 12345678901234567890, 1E400, -1e400]}}',
    '{"name": "f", "arguments": {"t": true, "f": false, "z": null, "nan": NaN, "inf": Infinity, "ninf": -Infinity}}',
    '{"name": "f", "arguments": "{\\"city\\": \\"Paris\\"}"}',
    '{"name": "f", "parameters": {"q": "x"}}',
    '{"name": "f", "id": {"skip": ["me", 1]}, "arguments": {"k": "v"}, "extra": [true]}',
    '{"name": "f", "arguments": {"lone": "\\ud83d x", "low": "\\ude00", "pair": "\\uD83D\\uDE00"}}',
    '{"name": "f", "arguments": {}}',
    '{"name": "f"}',
    '{"arguments": {"first": 1}, "name": "late_name"}',
    '{"name": "f", "arguments": {"raw": "line one\nline\ttwo"}}',  # raw control characters: json.loads strict=False
    '{"name": "f", "arguments": {"ü": "日本語 ∑", "e": ""}}',
    '{"name": "f", "arguments": [1, "two"]}',
    '{"name": "f", "arguments": 42}',
]


def _expected(body: str) -> dict:
    obj = json.loads(body, strict=False)
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


def _check_stream(text: str, cuts, content: str, calls: list[dict]) -> list[list[str]]:
    """Feeds one parser text[:cut] for each cut, then the whole text finished: content and calls only grow, every
    call's arguments stay prefixes of its final ones, the end equals (content, calls). Returns the arguments seen."""
    p = HermesToolParser()
    sent_content, sent = "", []
    seen = []
    for cut in list(cuts) + [None]:
        done = cut is None
        got_content, got = p.extract(text if done else text[:cut], done)
        assert got_content.startswith(sent_content), (cut, sent_content, got_content)
        assert len(got) >= len(sent), (cut, sent, got)
        for was, now in zip(sent, got):
            assert was["name"] == now["name"] and now["arguments"].startswith(was["arguments"]), (cut, was, now)
        for k, now in enumerate(got):
            assert now["name"] == calls[k]["name"] and calls[k]["arguments"].startswith(now["arguments"]), (cut, now)
        sent_content, sent = got_content, got
        seen.append([c["arguments"] for c in got])
    assert (sent_content, sent) == (content, calls)
    return seen


@pytest.mark.parametrize("body", VALID_BODIES)
def test_valid_calls_stream_to_what_json_loads_reads(body):
    text = f"Let me see.<tool_call>{body}</tool_call>"
    want = _expected(body)
    whole = HermesToolParser().extract(text, True)
    assert whole == ("Let me see.", [want])
    _check_stream(text, range(1, len(text)), *whole)  # token by token (a character each)
    for cut in range(1, len(text)):  # every split point: one piece, then the rest
        _check_stream(text, [cut], *whole)
    for step in (2, 3, 7):
        _check_stream(text, range(step, len(text), step), *whole)


def test_the_name_goes_first_then_the_arguments_as_written():
    """As vLLM's: the call once its whole name string is known (arguments ""), then text of the arguments as it is
    generated; a number waits for its end, an escape until complete, a high surrogate for its pair."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\u00e9\\ud83d\\ude00", "days": 12}}'
    p = HermesToolParser()

    def args_at(prefix: str):
        return [c["arguments"] for c in p.extract(prefix, False)[1]]
    assert args_at('<tool_call>\n{"name": "get_wea') == []  # (the name is not known yet)
    assert args_at('<tool_call>\n{"name": "get_weather"') == [""]
    assert args_at('<tool_call>\n{"name": "get_weather", "arguments": {"ci') == ['{"ci']
    assert args_at(text[:text.index("\\u00e9") + 4]) == ['{"city": "Par']
    assert args_at(text[:text.index("\\ud83d") + 6]) == ['{"city": "Paré']  # (the pair may follow)
    assert args_at(text[:text.index("12") + 1]) == ['{"city": "Paré😀", "days": ']  # (more digits may follow)
    assert args_at(text[:text.index("12") + 2]) == ['{"city": "Paré😀", "days": ']
    assert args_at(text[:text.index("12") + 3]) == ['{"city": "Paré😀", "days": 12}']


def test_several_calls_text_before_and_split_tags():
    text = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    whole = HermesToolParser().extract(text, True)
    assert whole[0] == "I will check both.\n"
    assert whole[1] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        {"name": "get_time", "arguments": '{"tz": "CET"}'}]
    for cut in range(1, len(text)):
        _check_stream(text, [cut], *whole)
    _check_stream(text, range(1, len(text)), *whole)
    # a tag split across tokens holds the content back, then opens the call
    p = HermesToolParser()
    assert p.extract("I will check both.\n<tool_", False) == ("I will check both.\n", [])
    assert p.extract("I will check both.\n<tool_call>", False) == ("I will check both.\n", [])


@pytest.mark.parametrize("text, content, calls", [
    # the outer object misses its brace (the arguments ended): a clean call
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "", [{"name": "f", "arguments": '{"a": 1}'}]),
    # arguments that stop being JSON: the re-serialized part, then the rest of the block as written
    ('<tool_call>{"name": "f", "arguments": {"a": 1, "b": tru}}</tool_call>after',
     "", [{"name": "f", "arguments": '{"a": 1, "b": tru}}'}]),
    ('<tool_call>{"name": "f", "arguments": {"a": "bad \\x escape"}}\n</tool_call>',
     "", [{"name": "f", "arguments": '{"a": "bad \\x escape"}}'}]),
    # cut short (max_tokens) inside the arguments: as far as they got, the unfinished token raw
    ('<tool_call>{"name": "f", "arguments": {"a": "hel', "", [{"name": "f", "arguments": '{"a": "hel'}]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1.50', "", [{"name": "f", "arguments": '{"a": 1.50'}]),
    ('<tool_call>{"name": "f", "arguments": {"a": "x\\u00', "", [{"name": "f", "arguments": '{"a": "x\\u00'}]),
    # the name complete, no arguments yet: none
    ('<tool_call>{"name": "f", ', "", [{"name": "f", "arguments": "{}"}]),
    # no end tag: the call ends with its object (what follows in the block is dropped, as text between blocks)
    ('<tool_call>{"name": "f", "arguments": {"a": 1}} and more', "", [{"name": "f", "arguments": '{"a": 1}'}]),
    # no name string: the block and all after it are content, raw (the rule before streaming)
    ('Hi <tool_call>{"name": get_time}</tool_call><tool_call>{"name": "f"}</tool_call>',
     'Hi <tool_call>{"name": get_time}</tool_call><tool_call>{"name": "f"}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>[1]</tool_call>',
     '<tool_call>[1]</tool_call>', [{"name": "f", "arguments": "{}"}]),
    ('<tool_call>{"name": "get_ti', '<tool_call>{"name": "get_ti', []),
])
def test_malformed_calls_streamed_and_whole_agree(text, content, calls):
    whole = HermesToolParser().extract(text, True)
    assert whole == (content, calls)
    _check_stream(text, range(1, len(text)), *whole)
    for cut in range(1, len(text)):
        _check_stream(text, [cut], *whole)


def test_a_long_argument_streams_in_linear_time():
    """Each token reads on where the last stopped: a 40k-character argument, one character per step."""
    body = '{"name": "write", "arguments": {"text": "' + "some code();\\n" * 3000 + '"}}'
    text = "<tool_call>" + body + "</tool_call>"
    p = HermesToolParser()
    t0 = time.perf_counter()
    for cut in range(1, len(text), 1):
        p.extract(text[:cut], False)
    _, [call] = p.extract(text, True)
    assert call == _expected(body)
    assert time.perf_counter() - t0 < 4  # (0.7 s on the dev machine; re-joining the arguments each step took 5.6)


def test_reader_stops_at_the_end_of_the_object():
    r = HermesCallReader()
    body = '{"name": "f", "arguments": {"a": "</tool_call>"}}  </tool_call>{"name": "g"}'
    r.read(body, 0)
    assert r.state == "closed" and body[:r.pos].endswith("}}") and r.name == "f"
    assert r.arguments() == '{"a": "</tool_call>"}'


# -- through the chat stream ----------------------------------------------------------------------------------------
def _chat(text: str, step: int, reasoning: str = None, prompt: str = "<|im_start|>assistant\n"):
    return chat_pieces(text, step, reasoning=reasoning, prompt=prompt)


CHAT_TEXT = ('<think>\nThe user wants {"weather"} </tool_call> and the time.\n</think>\n\nChecking both.'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 3, 10])
def test_chat_stream_sends_the_name_then_argument_deltas(step):
    chunks, body = _chat(CHAT_TEXT, step, reasoning="qwen3")
    message = body["choices"][0]["message"]
    assert message["reasoning"] == 'The user wants {"weather"} </tool_call> and the time.\n'
    assert message["content"] == "Checking both."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": [1, 2]}'
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking both."
    pieces = [c for d in deltas for c in d.get("tool_calls", [])]
    for k, call in enumerate(message["tool_calls"]):
        mine = [p for p in pieces if p["index"] == k]
        first = mine[0]
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"]["name"] == call["function"]["name"]
        if step == 1:
            assert first["function"]["arguments"] == ""  # the name alone, once complete
            assert len(mine) > 5  # the arguments in many pieces
        assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in mine[1:])
        assert "".join(p["function"]["arguments"] for p in mine) == call["function"]["arguments"]
    # the calls in order: every piece of call 0 before call 1's
    assert [p["index"] for p in pieces] == sorted(p["index"] for p in pieces)
    assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_stream_of_a_malformed_call_ends_as_the_body_says():
    text = 'Hmm.<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    for step in (1, 4):
        chunks, body = _chat(text, step)
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        pieces = [c for d in deltas for c in d.get("tool_calls", [])]
        [call] = body["choices"][0]["message"]["tool_calls"]
        assert call["function"]["arguments"] == '{"city": Paris}}'
        assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
        assert "".join(d.get("content") or "" for d in deltas) == body["choices"][0]["message"]["content"] == "Hmm."
