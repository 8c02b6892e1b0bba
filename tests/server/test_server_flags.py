"""vLLM's server flags on one tiny-model server that turns them all on (--chat-template-content-format openai, ...),
and in-process checks (build_app with a stand-in engine) for the paths that need no model."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from server_helpers import ServerProc, free_port
from tiny_models import make_model, make_tokenizer

LOOPING = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
PLAIN = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"


@pytest.fixture(scope="module")
def flag_server(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("tiny_flags")), "llama")
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny",
                      "--disable-log-stats", "--disable-uvicorn-access-log",
                      "--chat-template-content-format", "openai", "--return-tokens-as-token-ids"],
                     free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


def _rendered(base: str, messages: list, template: str, http=httpx) -> str:
    """The prompt a chat template makes of the messages (/tokenize, then /detokenize)."""
    kw = {"timeout": 30} if http is httpx else {}  # (a TestClient takes no timeout)
    r = http.post(base + "/tokenize", json={"messages": messages, "chat_template": template,
                                            "add_generation_prompt": False}, **kw)
    assert r.status_code == 200, r.text
    return http.post(base + "/detokenize", json={"tokens": r.json()["tokens"]}, **kw).json()["prompt"]


TWO_PARTS = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
             {"role": "assistant", "content": "z"}]


def test_openai_content_format_passes_parts(flag_server):
    base = flag_server.base
    assert _rendered(base, TWO_PARTS, LOOPING) == "<x><y><z>"
    # a template that prints content as it is shows the list of parts
    assert _rendered(base, [{"role": "user", "content": "hi"}], PLAIN) == "[{'type': 'text', 'text': 'hi'}]|"
    r = httpx.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": TWO_PARTS, "max_tokens": 2,
                                                       "chat_template": LOOPING}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0


def _local_client(tmp_path, **state_kw):
    """build_app over a stand-in engine with a real tokenizer (routes that need no model: /tokenize, ...)."""
    from starlette.testclient import TestClient

    from voltllm.entrypoints.openai.app import build_app
    from voltllm.entrypoints.openai.serving_common import ServerState

    tok = make_tokenizer(str(tmp_path))
    engine = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), is_healthy=True, dead=None)
    state = ServerState(engine=engine, served_model_names=["m"], max_model_len=256, model_path="m", **state_kw)
    return TestClient(build_app(state))


def test_auto_content_format_follows_the_template(tmp_path):
    http = _local_client(tmp_path)  # the default: auto
    assert _rendered("", TWO_PARTS, LOOPING, http) == "<x><y><z>"
    assert _rendered("", TWO_PARTS, PLAIN, http) == "x\ny|z|"
    fixed = _local_client(tmp_path, chat_template_content_format="string")
    assert _rendered("", TWO_PARTS, LOOPING, fixed) == "<><><><>"  # (a string's characters have no 'text')


def _sse(r: httpx.Response) -> list[dict]:
    import json

    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens]


def test_return_tokens_as_token_ids(flag_server):
    """--return-tokens-as-token-ids: every logprob token (chosen, top, echoed prompt) is "token_id:N" with the id
    that decodes to the token a request with return_tokens_as_token_ids=false reports; streamed the same."""
    base = flag_server.base
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "echo": True, "ignore_eos": True}
    got = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    text = httpx.post(base + "/v1/completions", json={**body, "return_tokens_as_token_ids": False},
                      timeout=60).json()["choices"][0]["logprobs"]
    ids = _ids(got["tokens"])
    decoded = [httpx.post(base + "/detokenize", json={"tokens": [t]}, timeout=30).json()["prompt"] for t in ids]
    assert decoded == text["tokens"] and got["token_logprobs"] == text["token_logprobs"]
    assert all(_ids(list(top)) for top in got["top_logprobs"][1:])  # (the first prompt token has none)
    offsets = [0]
    for tok in got["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert got["text_offset"] == offsets  # counted over the strings shown, as vLLM
    streamed = _sse(httpx.post(base + "/v1/completions", json={**body, "stream": True}, timeout=60))
    assert [t for c in streamed for t in c["choices"][0]["logprobs"]["tokens"]] == got["tokens"]

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    content = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["logprobs"][
        "content"]
    ids = _ids([c["token"] for c in content])
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)
    assert all(_ids([t["token"] for t in c["top_logprobs"]]) for c in content)
    plain = httpx.post(base + "/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": False},
                       timeout=60).json()["choices"][0]["logprobs"]["content"]
    assert not any(c["token"].startswith("token_id:") for c in plain)
    streamed = _sse(httpx.post(base + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60))
    lps = [c for e in streamed for ch in e["choices"] if ch.get("logprobs") for c in ch["logprobs"]["content"]]
    assert _ids([c["token"] for c in lps]) == ids
