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
                      "--chat-template-content-format", "openai"],
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
