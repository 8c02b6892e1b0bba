"""`use_beam_search` on the tiny server's /v1/completions and /v1/chat/completions: the n best beams as choices, the
same as a plain beam search over transformers' logprobs of the served model; streamed (the answer at the end); the
400s; and a client that goes away mid-search leaves no request, KV block or search behind."""
from __future__ import annotations

import json
import math
import time

import httpx
import pytest
import torch

from beam_reference import Reference
from server_helpers import metrics, wait_idle

pytestmark = pytest.mark.usefixtures("tiny_server")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(tiny_server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_server.model_path, dtype=torch.float32).eval()
    return Reference(model), AutoTokenizer.from_pretrained(tiny_server.model_path)


def _post(server, path, body, status=200):
    r = httpx.post(server.base + path, json={"model": "tiny", "use_beam_search": True, **body}, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def _stream(server, path, body):
    chunks, done = [], False
    with httpx.stream("POST", server.base + path, json={"model": "tiny", "use_beam_search": True, "stream": True,
                                                        **body}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert done
    return chunks


def _expected(reference, prompt_ids, n, max_tokens):
    ref, tok = reference
    best = ref.search(prompt_ids, n, max_tokens, {tok.eos_token_id})
    out = []
    for tokens, cum in best:
        ids = tokens[len(prompt_ids):]
        stopped = ids[-1] == tok.eos_token_id
        out.append((ids[:-1] if stopped else ids, cum, "stop" if stopped else "length"))
    return out


def test_completions_answer_the_best_beams(tiny_server, reference):
    _, tok = reference
    prompts = ["The quick brown fox", "def add(a, b):"]
    got = _post(tiny_server, "/v1/completions", {"prompt": prompts, "n": 3, "max_tokens": 5, "temperature": 0,
                                                 "logprobs": 2, "return_token_ids": True})
    assert [c["index"] for c in got["choices"]] == list(range(6))
    total = 0
    for p, prompt in enumerate(prompts):
        want = _expected(reference, tok.encode(prompt), 3, 5)
        for i, (ids, cum, finish) in enumerate(want):
            c = got["choices"][p * 3 + i]
            assert c["prompt_token_ids"] == tok.encode(prompt)
            assert c["token_ids"] == ids and c["finish_reason"] == finish and c["text"] == tok.decode(ids)
            lps = c["logprobs"]
            assert len(lps["tokens"]) == len(ids) and all(1 <= len(t) <= 3 for t in lps["top_logprobs"])
            assert math.fsum(lps["token_logprobs"]) == pytest.approx(cum, abs=1e-3)
            total += len(ids)
    assert got["usage"]["completion_tokens"] == total


def test_chat_answers_the_best_beams(tiny_server, reference):
    _, tok = reference
    got = _post(tiny_server, "/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 6, "temperature": 0,
                                                      "logprobs": True, "top_logprobs": 2, "return_token_ids": True})
    want = _expected(reference, got["prompt_token_ids"], 2, 6)
    for c, (ids, cum, finish) in zip(got["choices"], want):
        assert c["token_ids"] == ids and c["finish_reason"] == finish
        assert c["message"]["content"] == tok.decode(ids)
        content = c["logprobs"]["content"]
        assert len(content) == len(ids) and all(len(e["top_logprobs"]) == 2 for e in content)
        assert math.fsum(e["logprob"] for e in content) == pytest.approx(cum, abs=1e-3)
    assert [c["index"] for c in got["choices"]] == [0, 1]


def test_length_penalty_reaches_the_search(tiny_server, reference):
    _, tok = reference
    for lp in (0.0, 2.0):
        got = _post(tiny_server, "/v1/completions", {"prompt": "Hello world", "n": 2, "max_tokens": 3,
                                                     "temperature": 0, "length_penalty": lp, "return_token_ids": True})
        ref, _ = reference
        best = ref.search(tok.encode("Hello world"), 2, 3, {tok.eos_token_id}, lp)
        assert [c["token_ids"] for c in got["choices"]] == [t[len(tok.encode("Hello world")):] for t, _ in best]


def test_streamed_answers_come_whole_at_the_end(tiny_server):
    body = {"messages": CHAT, "n": 2, "max_tokens": 5, "temperature": 0}
    whole = _post(tiny_server, "/v1/chat/completions", body)
    chunks = _stream(tiny_server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    for i in range(2):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content") or "" for c in mine) == whole["choices"][i]["message"]["content"]
        assert mine[-1]["finish_reason"] == whole["choices"][i]["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]
    cbody = {"prompt": "The quick brown fox", "n": 2, "max_tokens": 4, "temperature": 0}
    cwhole = _post(tiny_server, "/v1/completions", cbody)
    cchunks = _stream(tiny_server, "/v1/completions", cbody)
    assert sorted((ch["choices"][0]["index"], ch["choices"][0]["text"], ch["choices"][0]["finish_reason"])
                  for ch in cchunks) == [(c["index"], c["text"], c["finish_reason"]) for c in cwhole["choices"]]


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"stop": ["x"]}, "stop"),
    ("/v1/completions", {"seed": 3}, "seed"),
    ("/v1/completions", {"n": 11}, "n"),  # 2 x n logprobs per step: more than --max-logprobs (20)
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"early_stopping": True}, "early_stopping"),
    ("/v1/chat/completions", {"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
])
def test_refusals(tiny_server, path, extra, param):
    body = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": CHAT}
    got = _post(tiny_server, path, {**body, "n": 2, **extra}, status=400)
    assert got["error"]["param"] == param, got


def _aborted(server) -> float:
    total = 0.0
    for line in httpx.get(server.base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("voltllm:request_success_total{") and 'finished_reason="abort"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _assert_stays_idle(server):
    """Idle now, and no search left behind starting further steps."""
    wait_idle(server, 30)
    done = metrics(server)["voltllm:request_success_total"]
    time.sleep(1.0)
    m = wait_idle(server, 1)
    assert m["voltllm:request_success_total"] == done


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_mid_search_leaves_nothing(tiny_server, stream):
    body = {"model": "tiny", "use_beam_search": True, "prompt": "Write a story.", "n": 4, "max_tokens": 900,
            "ignore_eos": True, "temperature": 0, "stream": stream}
    before = _aborted(tiny_server)
    with pytest.raises(httpx.ReadTimeout):  # the answer comes at the end: the client gives up before
        with httpx.stream("POST", tiny_server.base + "/v1/completions", json=body,
                          timeout=httpx.Timeout(60, read=1.5)) as r:
            for _ in r.iter_lines():
                pass
    _assert_stays_idle(tiny_server)
    assert _aborted(tiny_server) > before  # the step in flight was aborted in the engine
