"""`voltllm serve` through the official openai client (and raw HTTP): chat, completions, streaming,
usage, stop strings, n, seeds, logprobs, concurrency, disconnects, tokenize, metrics."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server_helpers import API_KEY, MODEL_NAMES, metrics, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_health_version_models(server, client):
    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/version").json()["version"]
    ids = [m.id for m in client.models.list().data]
    assert ids == list(MODEL_NAMES)
    assert client.models.retrieve("smol-alias").id == "smol-alias"


def test_chat_greedy_paris_and_usage(server, client):
    r = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0, max_tokens=16, logprobs=True,
                                       top_logprobs=3)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.model == "smol" and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    # usage: the prompt is what /tokenize makes of the same messages; one logprob entry per generated token
    tok = httpx.post(server.base + "/tokenize", json={"messages": FRANCE}).json()
    assert r.usage.prompt_tokens == tok["count"]
    content = choice.logprobs.content
    assert r.usage.completion_tokens == len(content) > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(choice.message.content.strip()[:5])
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob
        # greedy: the chosen token is the most likely one
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-4)


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model="smol", messages=FRANCE, temperature=0, max_completion_tokens=12)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_echo_logprobs(client):
    prompt = "The capital of France is"
    r = client.completions.create(model="smol-alias", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                  logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(prompt) and len(c.text) > len(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.completion_tokens == 5 and c.finish_reason == "length"
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # each position: its own token and the top 2, as OpenAI's and vLLM's (2 entries when it is among them)
    assert all(2 <= len(t) <= 3 and tok in t for tok, t in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert any(len(t) == 3 for t in lp.top_logprobs[1:len(lp.tokens) - 5])  # some prompt token is outside its top 2


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model="smol", prompt="Once upon a time", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_strings(client):
    base = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    # stop at the first occurrence of a piece of the greedy continuation
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    expect = text[:text.index(stop)]
    r = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == expect
    assert r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == expect
    assert streamed[-1].choices[0].finish_reason == "stop"
    # chat honours stop too
    chat = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0, max_tokens=16, stop=["Paris"])
    assert "Paris" not in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"


def test_n2_and_seed_reproducible(client):
    kwargs = dict(model="smol", messages=[{"role": "user", "content": "Tell me a one-line joke."}],
                  temperature=1.0, max_tokens=8, n=2, seed=1234)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens <= 16
    kw = dict(model="smol", prompt="Random words:", max_tokens=8, temperature=1.0, seed=7, n=2,
              extra_body={"ignore_eos": True})
    c = client.completions.create(**kw)
    d = client.completions.create(**kw)
    assert [x.text for x in c.choices] == [x.text for x in d.choices]
    assert c.usage.completion_tokens == 16
    # streamed n=2: each index gets its own text and its own finish
    chunks = list(client.completions.create(stream=True, **kw))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [x.text for x in c.choices]


def test_ignore_eos_and_penalties(client):
    r = client.completions.create(model="smol", prompt="Hi", max_tokens=6, temperature=0, presence_penalty=0.5,
                                  frequency_penalty=0.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.1,
                                                                     "top_k": 5, "min_p": 0.05})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_logit_bias(client, server):
    """OpenAI's logit_bias (string token ids): +100 forces a token at every step in greedy and sampled requests
    alike, -100 bans the greedy choice (the answer changes), and an unbiased request after them is untouched."""
    def post(path, body):
        return httpx.post(server.base + path, json=body, headers=AUTH, timeout=30).json()

    kw = dict(model="smol", prompt="The capital of France is", max_tokens=3, extra_body={"ignore_eos": True})
    plain = client.completions.create(temperature=0, **kw).choices[0].text
    forced = post("/tokenize", {"prompt": " blue", "add_special_tokens": False})["tokens"][-1]
    piece = post("/detokenize", {"tokens": [forced]})["prompt"]
    for temperature in (0, 1.0):
        r = client.completions.create(temperature=temperature, logit_bias={str(forced): 100}, **kw)
        assert r.choices[0].text == piece * 3, (temperature, r.choices[0].text, piece)
    first = post("/tokenize", {"prompt": plain, "add_special_tokens": False})["tokens"][0]
    assert client.completions.create(temperature=0, logit_bias={str(first): -100}, **kw).choices[0].text != plain
    assert client.completions.create(temperature=0, **kw).choices[0].text == plain


def test_sixteen_concurrent_streams(client, aclient):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(16)]
    ref = client.completions.create(model="smol", prompt=prompts, max_tokens=8, temperature=0)
    expected = {c.index: c.text for c in ref.choices}

    async def one(i: int) -> str:
        stream = await aclient.completions.create(model="smol", prompt=prompts[i], max_tokens=8, temperature=0,
                                                  stream=True)
        parts = []
        async for ch in stream:
            if ch.choices:
                parts.append(ch.choices[0].text)
        return "".join(parts)

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    got = asyncio.run(main())
    assert got == [expected[i] for i in range(16)]


def _start_stream_then_drop(server, body: dict, path: str) -> None:
    with httpx.Client(base_url=server.base, headers=AUTH, timeout=60) as h:
        with h.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream


def test_disconnect_mid_stream_frees_request(server):
    body = {"model": "smol", "prompt": "Write a long story about a dragon.", "max_tokens": 1500, "stream": True,
            "ignore_eos": True, "temperature": 0}
    _start_stream_then_drop(server, body, "/v1/completions")
    wait_idle(server, 30)
    chat = {"model": "smol", "messages": FRANCE, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    _start_stream_then_drop(server, chat, "/v1/chat/completions")
    m = wait_idle(server, 30)
    assert m["voltllm:request_success_total"] > 0


def test_disconnect_non_stream_frees_request(server):
    body = {"model": "smol", "prompt": "Write a long story about a dragon.", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=1.5))
    wait_idle(server, 30)


def test_tokenize_detokenize(server):
    r = httpx.post(server.base + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    d = httpx.post(server.base + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"].strip() == "Hello world"


def test_prefix_cache_hit_reported(client):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 12
    client.completions.create(model="smol", prompt=long_prompt, max_tokens=1, temperature=0)
    r = client.completions.create(model="smol", prompt=long_prompt, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    # streamed, the final usage chunk carries them too (as vLLM's with --enable-prompt-tokens-details)
    chunks = list(client.completions.create(model="smol", prompt=long_prompt, max_tokens=1, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16
    messages = [{"role": "user", "content": long_prompt}]
    client.chat.completions.create(model="smol", messages=messages, max_tokens=1, temperature=0)
    chunks = list(client.chat.completions.create(model="smol", messages=messages, max_tokens=1, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16


def test_metrics(server, client):
    client.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0)
    m = metrics(server)
    for name in ("voltllm:request_success_total", "voltllm:prompt_tokens_total", "voltllm:generation_tokens_total",
                 "voltllm:time_to_first_token_seconds_count", "voltllm:inter_token_latency_seconds_count",
                 "voltllm:e2e_request_latency_seconds_count", "voltllm:num_requests_running",
                 "voltllm:num_requests_waiting", "voltllm:kv_cache_usage_perc", "voltllm:prefix_cache_hit_rate",
                 "voltllm:prefix_cache_queries_total", "voltllm:prefix_cache_hits_total", "voltllm:http_requests_total"):
        assert name in m, name
    assert m["voltllm:request_success_total"] >= 1
    assert m["voltllm:generation_tokens_total"] >= 3
    assert m["voltllm:time_to_first_token_seconds_count"] >= 1
    assert 0 <= m["voltllm:prefix_cache_hit_rate"] <= 1
    # vLLM's names for the same series (dashboards built for vLLM)
    assert m["vllm:request_success_total"] == m["voltllm:request_success_total"]
    assert m["vllm:time_to_first_token_seconds_count"] == m["voltllm:time_to_first_token_seconds_count"]


def test_server_still_serves_after_everything(server, client):
    t = time.monotonic()
    r = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0, max_tokens=4)
    assert r.choices[0].message.content and time.monotonic() - t < 60
    wait_idle(server, 30)
