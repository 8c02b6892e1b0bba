"""vLLM's request parameters on the tiny server: truncate_prompt_tokens and truncation_side, return_token_ids
(streamed and not), a stop token's text with skip_special_tokens false, stream_options.continuous_usage_stats,
allowed_token_ids and bad_words (and their 400s)."""
from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.usefixtures("tiny_server")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _post(server, path, body):
    r = httpx.post(server.base + path, json={"model": "tiny", "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path, body):
    chunks = []
    with httpx.stream("POST", server.base + path, json={"model": "tiny", "temperature": 0, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_truncate_prompt_tokens(tiny_server):
    got = _post(tiny_server, "/v1/completions", {"prompt": list(range(10, 30)), "max_tokens": 1,
                                                 "truncate_prompt_tokens": 5, "return_token_ids": True})
    assert got["choices"][0]["prompt_token_ids"] == list(range(25, 30)) and got["usage"]["prompt_tokens"] == 5
    full = _post(tiny_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})["usage"]["prompt_tokens"]
    cut = _post(tiny_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "truncate_prompt_tokens": 3})
    assert full > 3 and cut["usage"]["prompt_tokens"] == 3
    whole = _post(tiny_server, "/v1/chat/completions",
                  {"messages": CHAT, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert whole["usage"]["prompt_tokens"] == full
    r = httpx.post(tiny_server.base + "/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                               "truncate_prompt_tokens": 10 ** 6}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_truncation_side(tiny_server):
    """vLLM's truncation_side on completions and chat: right keeps the prompt's first k tokens; another value is a
    400 naming the field."""
    got = _post(tiny_server, "/v1/completions", {"prompt": list(range(10, 30)), "max_tokens": 1, "return_token_ids":
                                                 True, "truncate_prompt_tokens": 5, "truncation_side": "right"})
    assert got["choices"][0]["prompt_token_ids"] == list(range(10, 15)) and got["usage"]["prompt_tokens"] == 5
    body = {"messages": CHAT, "max_tokens": 1, "return_token_ids": True}
    full = _post(tiny_server, "/v1/chat/completions", body)["prompt_token_ids"]
    for side, kept in (("right", full[:3]), ("left", full[-3:])):
        cut = _post(tiny_server, "/v1/chat/completions", {**body, "truncate_prompt_tokens": 3, "truncation_side": side})
        assert cut["prompt_token_ids"] == kept, side
    for path, extra in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = httpx.post(tiny_server.base + path, json={"model": "tiny", "truncate_prompt_tokens": 2,
                                                      "truncation_side": "middle", **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side", r.text


def test_return_token_ids(tiny_server):
    body = {"messages": CHAT, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    got = _post(tiny_server, "/v1/chat/completions", body)
    ids = got["choices"][0]["token_ids"]
    assert len(ids) == 4 and len(got["prompt_token_ids"]) == got["usage"]["prompt_tokens"]
    chunks = _stream(tiny_server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == got["prompt_token_ids"]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids
    plain = _post(tiny_server, "/v1/chat/completions", {**body, "return_token_ids": None})
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    cbody = {"prompt": "The capital of France", "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    cgot = _post(tiny_server, "/v1/completions", cbody)["choices"][0]
    assert len(cgot["token_ids"]) == 4 and cgot["prompt_token_ids"]
    cchunks = _stream(tiny_server, "/v1/completions", cbody)
    assert cchunks[0]["choices"][0]["prompt_token_ids"] == cgot["prompt_token_ids"]
    assert [t for c in cchunks for ch in c["choices"] for t in ch["token_ids"]] == cgot["token_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_is_not_in_the_text(tiny_server, stream):
    base = {"prompt": "The capital of France", "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    ids = _post(tiny_server, "/v1/completions", base)["choices"][0]["token_ids"]
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    stop = {**base, "stop_token_ids": [ids[k]], "skip_special_tokens": False}

    def run(path, body):
        if not stream:
            c = _post(tiny_server, path, body)["choices"][0]
            return (c["text"] if "text" in c else c["message"]["content"]), c["token_ids"]
        chunks = _stream(tiny_server, path, body)
        texts = [ch.get("text", ch.get("delta", {}).get("content")) or "" for c in chunks for ch in c["choices"]]
        return "".join(texts), [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]

    text, got_ids = run("/v1/completions", stop)
    with_stop, _ = run("/v1/completions", {**stop, "include_stop_str_in_output": True})
    piece = httpx.post(tiny_server.base + "/detokenize", json={"tokens": [ids[k]]}).json()["prompt"]
    assert got_ids == ids[:k + 1]  # the stop token's id stays
    assert piece and text + piece == with_stop  # the stop token's text only with include_stop_str_in_output
    # chat, stopping on EOS: "<|im_end|>" is not in the content
    eos = {"messages": CHAT, "max_tokens": 3, "stop_token_ids": [], "skip_special_tokens": False,
           "return_token_ids": True, "logit_bias": {str(_eos_id(tiny_server)): 100}}
    content, chat_ids = run("/v1/chat/completions", eos)
    assert chat_ids == [_eos_id(tiny_server)] and content == ""


def _eos_id(server):
    return httpx.post(server.base + "/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False}
                      ).json()["tokens"][0]


def test_continuous_usage_stats(tiny_server):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _stream(tiny_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "ignore_eos": True,
                                                           "stream_options": opts})
    final = chunks[-1]["usage"]
    assert chunks[0]["usage"] == {"prompt_tokens": final["prompt_tokens"], "completion_tokens": 0,
                                  "total_tokens": final["prompt_tokens"]}
    chunks = _stream(tiny_server, "/v1/completions", {"prompt": "Hello", "n": 2, "max_tokens": 3, "ignore_eos": True,
                                                      "temperature": 1.0, "seed": 1, "return_token_ids": True,
                                                      "stream_options": opts})
    sent = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        sent[ch["index"]] += len(ch["token_ids"])
        assert c["usage"]["completion_tokens"] == sent[ch["index"]]  # that choice's tokens so far, as vLLM's
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def _tokens(server, text):
    return httpx.post(server.base + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_allowed_token_ids_steer_greedy_output(tiny_server):
    base = {"prompt": "The capital of France", "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    ids = _post(tiny_server, "/v1/completions", base)["choices"][0]["token_ids"]
    other = next(t for t in range(40, 400) if t not in ids)
    got = _post(tiny_server, "/v1/completions", {**base, "allowed_token_ids": [other]})["choices"][0]
    assert got["token_ids"] == [other] * 4
    pair = sorted({ids[0], other})
    chat = _post(tiny_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "ignore_eos": True,
                                                       "return_token_ids": True, "allowed_token_ids": pair})
    assert set(chat["choices"][0]["token_ids"]) <= set(pair)
    # null allows every token, as before
    same = _post(tiny_server, "/v1/completions", {**base, "allowed_token_ids": None})["choices"][0]
    assert same["token_ids"] == ids


def test_bad_words_avoided_in_greedy_output(tiny_server):
    base = {"prompt": "The capital of France", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    ids = _post(tiny_server, "/v1/completions", base)["choices"][0]["token_ids"]
    for t in ids:  # a generated token that is a one-token bad word as written or after a space (vLLM's two forms)
        word = httpx.post(tiny_server.base + "/detokenize", json={"tokens": [t]}).json()["prompt"].lstrip()
        plain = _tokens(tiny_server, word) if word else []
        if len(plain) == 1 and t in (plain[0], *_tokens(tiny_server, " " + word)):
            break
    else:
        pytest.skip("no generated token round-trips through the tokenizer")
    chat = {"messages": CHAT, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    for path, body in (("/v1/completions", base), ("/v1/chat/completions", chat)):
        before = _post(tiny_server, path, body)["choices"][0]["token_ids"]
        got = _post(tiny_server, path, {**body, "bad_words": [word]})["choices"][0]["token_ids"]
        assert t not in got
        if t in before:  # the same tokens up to where the word came, then another
            j = before.index(t)
            assert got[:j] == before[:j]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields,param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, 10 ** 7]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["   "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
])
def test_bad_restrictions_are_400s(tiny_server, path, fields, param):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    r = httpx.post(tiny_server.base + path, json={"model": "tiny", "max_tokens": 2, **body, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
