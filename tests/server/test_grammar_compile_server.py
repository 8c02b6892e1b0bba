"""Grammar compiles off the engine loop, over HTTP: a `voltllm serve` of a tiny random model whose engine compiles
grammars through a test hook (a sitecustomize.py on the server's PYTHONPATH, wrapping GrammarMatchers._build in
every process): a regex with "slow-compile" in it waits until a file exists, one with "engine-compile-fails" fails in
the engine only (the API process's tokenizer-free check passes it). Other requests stream while a compile is held;
a failed compile is a 400 (streamed: an error event) for that request only."""
from __future__ import annotations

import textwrap

import openai
import pytest

from server_helpers import ServerProc, free_port
from tiny_models import make_model

HOOK = textwrap.dedent('''
    import os
    import time

    if os.environ.get("VOLTLLM_TEST_COMPILE_GATE"):
        from voltllm.structured import matchers

        _build = matchers.GrammarMatchers._build

        def _build_for_test(self, key):
            if "engine-compile-fails" in key[1]:
                raise RuntimeError("test hook: this grammar fails in the engine")
            if "slow-compile" in key[1]:
                while not os.path.exists(os.environ["VOLTLLM_TEST_COMPILE_GATE"]):
                    time.sleep(0.02)
            return _build(self, key)

        matchers.GrammarMatchers._build = _build_for_test
''')
SLOW = r"slow-compile [a-c]{3}"
FAILS = r"engine-compile-fails [a-c]{3}"


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gate") / "open")


@pytest.fixture(scope="module")
def client(tmp_path_factory, gate):
    hook_dir = tmp_path_factory.mktemp("hook")
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    path = make_model(str(tmp_path_factory.mktemp("tiny")), "llama")
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny",
                      "--disable-log-stats", "--disable-uvicorn-access-log"], free_port(),
                     env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(hook_dir), "VOLTLLM_TEST_COMPILE_GATE": gate})
    try:
        srv.wait_healthy(180)
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=60)
    finally:
        srv.stop()


def _complete(client, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.completions.create(model="tiny", prompt="The quick brown fox", **kw)


def test_other_requests_stream_while_a_grammar_compiles(client, gate):
    import threading

    held = {}

    def constrained():
        held["out"] = _complete(client, extra_body={"guided_regex": SLOW})

    t = threading.Thread(target=constrained)
    t.start()
    try:
        # the compile is held (until the gate file exists): plain requests, streamed and not, go through meanwhile
        for _ in range(2):
            plain = _complete(client, max_tokens=12, extra_body={"ignore_eos": True})
            assert plain.usage.completion_tokens == 12
            chunks = list(_complete(client, max_tokens=8, stream=True, extra_body={"ignore_eos": True}))
            assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
        assert t.is_alive() and "out" not in held
    finally:
        open(gate, "w").close()
        t.join(60)
    assert held["out"].choices[0].text.startswith("slow-compile ")
    assert held["out"].choices[0].finish_reason == "stop"


def test_a_grammar_that_fails_in_the_engine_is_a_400_for_that_request(client):
    with pytest.raises(openai.BadRequestError, match="test hook: this grammar fails in the engine"):
        _complete(client, extra_body={"guided_regex": FAILS})
    with pytest.raises(openai.BadRequestError, match="test hook"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       n=2, extra_body={"guided_regex": FAILS})
    # streamed: the status line is out before the engine compiles; the failure is an error event
    with pytest.raises(openai.APIError, match="test hook"):
        list(_complete(client, stream=True, extra_body={"guided_regex": FAILS}))
    # the server goes on, constrained requests included
    assert _complete(client, max_tokens=5, extra_body={"ignore_eos": True}).usage.completion_tokens == 5
    out = _complete(client, extra_body={"guided_regex": r"[a-c]{3}"}).choices[0]
    assert len(out.text) == 3 and set(out.text) <= set("abc")
