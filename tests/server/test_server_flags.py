"""vLLM's server flags on one tiny-model server that turns them all on (--chat-template-content-format openai, ...),
and in-process checks (build_app with a stand-in engine) for the paths that need no model."""
from __future__ import annotations

import ast
import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from otlp_receiver import OtlpReceiver, attributes, otlp_http_available
from server_helpers import ServerProc, free_port
from tiny_models import make_model, make_tokenizer

LOOPING = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
PLAIN = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"


@pytest.fixture(scope="module")
def otlp_receiver():
    """The flag server's OTLP/HTTP collector (None without the OpenTelemetry packages: the server then runs without
    --otlp-traces-endpoint and the tracing test skips)."""
    if not otlp_http_available():
        yield None
        return
    receiver = OtlpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture(scope="module")
def flag_server(tmp_path_factory, otlp_receiver):
    path = make_model(str(tmp_path_factory.mktemp("tiny_flags")), "llama")
    events = tmp_path_factory.mktemp("kv_events")
    tracing = ["--otlp-traces-endpoint", otlp_receiver.endpoint] if otlp_receiver is not None else []
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny", *tracing,
                      "--kv-events-config", f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{events}/pub", '
                                            f'"replay_endpoint": "ipc://{events}/replay"}}',
                      "--disable-log-stats", "--disable-uvicorn-access-log",
                      "--chat-template-content-format", "openai", "--return-tokens-as-token-ids",
                      "--disable-fastapi-docs", "--enable-request-id-headers", "--enable-log-requests",
                      "--max-log-len", "12", "--enable-log-outputs", "--enable-server-load-tracking",
                      "--h11-max-incomplete-event-size", "4096", "--h11-max-header-count", "40"],
                     free_port(), env={"OMP_NUM_THREADS": "1"})
    srv.kv_events_replay = f"ipc://{events}/replay"
    srv.otlp = otlp_receiver
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


def _local_client(tmp_path, http_options=None, **state_kw):
    """build_app over a stand-in engine with a real tokenizer (routes that need no model: /tokenize, ...)."""
    from starlette.testclient import TestClient

    from voltllm.entrypoints.openai.app import HttpOptions, build_app
    from voltllm.entrypoints.openai.serving_common import ServerState

    tok = make_tokenizer(str(tmp_path))
    engine = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), is_healthy=True, dead=None)
    state = ServerState(engine=engine, served_model_names=["m"], max_model_len=256, model_path="m", **state_kw)
    return TestClient(build_app(state, http=http_options or HttpOptions()))


def test_model_cards_in_vllms_shape(tmp_path):
    """/v1/models entries carry vLLM's ModelCard fields, `permission` included (one entry, vLLM's values), the same
    on each call and from /v1/models/{name}; a LoRA adapter's parent is its base and its root its path."""
    lora = SimpleNamespace(lora_path="/adapters/a", base_model_name=None)
    http = _local_client(tmp_path, lora_modules={"a": lora})
    listed = http.get("/v1/models").json()
    assert listed["object"] == "list" and [c["id"] for c in listed["data"]] == ["m", "a"]
    base, adapter = listed["data"]
    assert set(base) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert (base["object"], base["root"], base["parent"], base["max_model_len"]) == ("model", "m", None, 256)
    assert (adapter["root"], adapter["parent"]) == ("/adapters/a", "m")
    (perm,) = base["permission"]
    assert perm["id"].startswith("modelperm-") and perm["created"] == base["created"]
    assert {k: v for k, v in perm.items() if k not in ("id", "created")} == {
        "object": "model_permission", "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
        "group": None, "is_blocking": False}
    assert adapter["permission"][0]["id"] != perm["id"]
    assert http.get("/v1/models").json() == listed and http.get("/v1/models/m").json() == base


def test_auto_content_format_follows_the_template(tmp_path):
    http = _local_client(tmp_path)  # the default: auto
    assert _rendered("", TWO_PARTS, LOOPING, http) == "<x><y><z>"
    assert _rendered("", TWO_PARTS, PLAIN, http) == "x\ny|z|"
    fixed = _local_client(tmp_path, chat_template_content_format="string")
    assert _rendered("", TWO_PARTS, LOOPING, fixed) == "<><><><>"  # (a string's characters have no 'text')


REASONING_TEMPLATE = ("{% for m in messages %}{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}"
                      "</think>{% endif %}{{ m.content }}|{% endfor %}")


def test_history_reasoning_reaches_the_template_as_reasoning_content(tmp_path):
    """An earlier assistant turn's `reasoning` (vLLM's name) or `reasoning_content` (the older one) is the
    template's reasoning_content (Qwen3 / Qwen3.5 templates read that name); `reasoning` wins when both come."""
    http = _local_client(tmp_path, chat_template_content_format="string")
    user = {"role": "user", "content": "q"}
    for turn, shown in [({"reasoning": "r1"}, "<think>r1</think>a|"),
                        ({"reasoning_content": "r2"}, "<think>r2</think>a|"),
                        ({"reasoning": "new", "reasoning_content": "old"}, "<think>new</think>a|"),
                        ({}, "a|")]:
        messages = [user, {"role": "assistant", "content": "a", **turn}, user]
        assert _rendered("", messages, REASONING_TEMPLATE, http) == "q|" + shown + "q|", turn
    r = http.post("/tokenize", json={"messages": [user, {"role": "assistant", "content": "a", "reasoning": 3}],
                                     "chat_template": REASONING_TEMPLATE})
    assert r.status_code == 400 and "messages[1].reasoning must be a string" in r.json()["error"]["message"]


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


def test_fastapi_docs(flag_server, tmp_path):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(flag_server.base + path, timeout=30).status_code == 404, path
    default = _local_client(tmp_path)
    assert default.get("/openapi.json").json()["info"]["title"].startswith("voltllm")
    assert default.get("/docs").status_code == 200 and default.get("/redoc").status_code == 200


def test_request_id_headers(flag_server, tmp_path):
    base = flag_server.base
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(base + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-7"}, timeout=60)
    assert r.headers["x-request-id"] == "trace-7" and r.json()["id"] == "chatcmpl-trace-7"
    r = httpx.post(base + "/v1/chat/completions", json={**chat, "stream": True}, headers={"X-Request-Id": "s-1"},
                   timeout=60)
    assert r.headers["x-request-id"] == "s-1" and {e["id"] for e in _sse(r)} == {"chatcmpl-s-1"}
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                   headers={"X-Request-Id": "c-1"}, timeout=60)
    assert r.headers["x-request-id"] == "c-1" and r.json()["id"] == "cmpl-c-1"
    # none sent: a new one, which the response's id carries; the body's request_id (vLLM's field) comes before it
    r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60)
    made = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made) and r.json()["id"] == f"chatcmpl-{made}"
    r = httpx.post(base + "/v1/chat/completions", json={**chat, "request_id": "body-1"}, timeout=60)
    assert r.json()["id"] == "chatcmpl-body-1"
    # every response carries one, errors too; two requests may share an id
    assert httpx.get(base + "/health", timeout=30).headers["x-request-id"]
    assert httpx.post(base + "/v1/completions", json={"prompt": 1}, timeout=30).headers["x-request-id"]
    same = []
    threads = [threading.Thread(target=lambda: same.append(httpx.post(
        base + "/v1/chat/completions", json={**chat, "max_tokens": 8, "ignore_eos": True},
        headers={"X-Request-Id": "dup"}, timeout=60))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [x.status_code for x in same] == [200, 200] and {x.json()["id"] for x in same} == {"chatcmpl-dup"}
    assert "x-request-id" not in _local_client(tmp_path).get("/version").headers  # off by default


def _log_lines(server, pattern: str) -> list[re.Match]:
    return [m for line in server.log_text().splitlines() if (m := re.search(pattern, line))]


def test_request_log_with_prompts_and_outputs(flag_server):
    """--enable-log-requests with --max-log-len 12 and --enable-log-outputs: the prompt and each choice's text,
    cut to 12 characters, streamed or not."""
    base = flag_server.base
    body = {"model": "tiny", "prompt": "The quick brown fox jumps", "max_tokens": 6, "ignore_eos": True, "n": 2}
    texts = [c["text"] for c in httpx.post(base + "/v1/completions", json=body, headers={"X-Request-Id": "log-1"},
                                           timeout=60).json()["choices"]]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "ignore_eos": True,
            "stream": True}
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in _sse(httpx.post(
        base + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "log-2"}, timeout=60)) if e["choices"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(_log_lines(flag_server, r"Generated response chatcmpl-log-2")) < 1:
        time.sleep(0.1)
    [req] = _log_lines(flag_server, r"request (cmpl-log-1-\w+): .*prompt: (.*)$")
    assert ast.literal_eval(req.group(2)) == "The quick br"
    [chat_req] = _log_lines(flag_server, r"request chatcmpl-log-2-\w+: .*stream=True, beam search=False, prompt: (.*)$")
    assert ast.literal_eval(chat_req.group(1)) == "<|im_start|>"
    outs = _log_lines(flag_server, r"Generated response cmpl-log-1-\w+ \(choice (\d)\): output: (.*), 6 tokens, "
                                   r"finish_reason: length")
    assert sorted((int(m.group(1)), ast.literal_eval(m.group(2))) for m in outs) == [(i, t[:12])
                                                                                     for i, t in enumerate(texts)]
    [out] = _log_lines(flag_server, r"Generated response chatcmpl-log-2-\w+ \(choice 0\): output: (.*), 6 tokens")
    assert ast.literal_eval(out.group(1)) == streamed[:12]
    # --enable-log-deltas (on by default): the streamed answer's chunks, each cut to 12 characters; none for log-1
    deltas = [ast.literal_eval(m.group(1)) for m in _log_lines(
        flag_server, r"Generated response chatcmpl-log-2-\w+ \(choice 0, streaming delta\): output: (.*)$")]
    assert deltas and streamed.startswith(deltas[0])
    assert not _log_lines(flag_server, r"Generated response cmpl-log-1-\w+ \(choice \d, streaming delta\)")


def test_server_load(flag_server, tmp_path):
    base = flag_server.base

    def load() -> int:
        return httpx.get(base + "/load", timeout=30).json()["server_load"]

    assert load() == 0
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)  # the stream runs
        seen = load()
        for _ in lines:  # (read to the end)
            pass
    assert seen == 1 and load() == 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # (kept: a dropped iterator closes the response)
        next(lines)
        assert load() == 1
    deadline = time.monotonic() + 10  # the client left: counted until the server has seen it go
    while load() != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load() == 0
    httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert load() == 0
    assert _local_client(tmp_path).get("/load").json() == {"server_load": 0}  # not tracked: vLLM's 0


def _serve_args(argv):
    import argparse

    from voltllm.cli import dashed_flags
    from voltllm.entrypoints.openai.cli_serve import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"), help="serve")
    return parser.parse_args(dashed_flags(["serve", *argv]))


@pytest.mark.parametrize("argv, match", [(["--max-log-len", "-1"], "--max-log-len must be >= 0"),
                                         (["--enable-log-outputs"], "add --enable-log-requests")])
def test_refused_log_flags(argv, match):
    from voltllm.config import ConfigError
    from voltllm.entrypoints.openai.cli_serve import check_server_flags

    with pytest.raises(ConfigError, match=match):
        check_server_flags(_serve_args(argv))
    check_server_flags(_serve_args(["--enable-log-requests", "--enable-log-outputs", "--max-log-len", "0"]))



def test_tokenize_messages_take_add_special_tokens(tmp_path):
    """vLLM's: the messages form takes add_special_tokens too, default false (the template wrote the special
    tokens); the prompt form defaults to true. A stand-in BOS (id 7) shows which way each call encoded."""
    from starlette.testclient import TestClient

    from voltllm.entrypoints.openai.app import build_app
    from voltllm.entrypoints.openai.serving_common import ServerState

    tok = make_tokenizer(str(tmp_path))
    plain = tok.encode
    tok.encode = lambda text, add_special_tokens=True, **kw: ([7] if add_special_tokens else []) + plain(
        text, add_special_tokens=False, **kw)
    engine = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), is_healthy=True, dead=None)
    state = ServerState(engine=engine, served_model_names=["m"], max_model_len=256, model_path="m")
    http = TestClient(build_app(state))
    msgs = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages[0].content }}"}
    assert http.post("/tokenize", json=msgs).json()["tokens"][0] != 7
    assert http.post("/tokenize", json={**msgs, "add_special_tokens": True}).json()["tokens"][0] == 7
    assert http.post("/tokenize", json={"prompt": "hi"}).json()["tokens"][0] == 7
    assert http.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["tokens"][0] != 7


def test_h11_limits(flag_server):
    """--h11-max-incomplete-event-size 4096: a request head still incomplete past 4 KiB is refused by the HTTP parser
    (sent in two writes, so its first part arrives alone), a small one is served; --h11-max-header-count 40: a request
    with more header fields is a 431 in the OpenAI error shape."""
    import socket
    from urllib.parse import urlparse

    base = flag_server.base
    url = urlparse(base)

    def two_writes(pad: int) -> bytes:
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * pad)
            time.sleep(0.3)
            sock.sendall(b"\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        return reply.split(b"\r\n", 1)[0]

    assert b" 200 " in two_writes(1000)
    status = two_writes(6000)
    assert b" 200 " not in status and (b" 400 " in status or b" 413 " in status or b" 431 " in status), status
    many = httpx.get(base + "/v1/models", headers={f"x-h{i}": "1" for i in range(50)}, timeout=30)
    assert many.status_code == 431
    assert "header fields, more than this server's 40" in many.json()["error"]["message"]
    assert httpx.get(base + "/v1/models", headers={f"x-h{i}": "1" for i in range(20)}, timeout=30).status_code == 200


def test_kv_events_from_the_server(flag_server):
    """--kv-events-config on `voltllm serve`: the engine process publishes the blocks a request's prompt filled (its
    tokens, block by block, parents chained); read back through the replay socket (no slow-joiner race)."""
    import zmq

    from kv_event_clients import DECODE, replay
    from voltllm.cache.kv_events import BlockStored

    ids = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41]  # two full blocks of 4 (+ 2 tokens)
    r = httpx.post(flag_server.base + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    ctx = zmq.Context()
    try:
        batches = [DECODE(payload) for _, payload in replay(ctx, flag_server.kv_events_replay)]
    finally:
        ctx.term()
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    runs = [e for e in stored if e.token_ids[:8] == ids[:8]]
    assert runs and runs[0].block_size == 4 and runs[0].medium == "GPU" and len(runs[0].block_hashes) >= 2
    assert all(b.data_parallel_rank == 0 for b in batches)


def test_otlp_spans_from_the_server(flag_server):
    """--otlp-traces-endpoint on `voltllm serve`: each finished request's llm_request span reaches the collector
    (OTLP/HTTP, sent by the batch processor within its 1 s schedule), in the caller's trace when the request carried a
    traceparent, with the request's parameters and the response's token counts."""
    receiver = flag_server.otlp
    if receiver is None:
        pytest.skip("needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http (the test extra)")
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=one"}
    before = time.time_ns()
    chat = httpx.post(flag_server.base + "/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "top_p": 0.9, "n": 2})
    assert chat.status_code == 200, chat.text
    plain = httpx.post(flag_server.base + "/v1/completions", headers={"X-Request-Id": "otlp-untraced"}, timeout=60,
                       json={"model": "tiny", "prompt": "a b c", "max_tokens": 2})
    assert plain.status_code == 200, plain.text
    after = time.time_ns()

    ((resource, span),) = receiver.wait_for(lambda s: s.trace_id.hex() == trace_id)
    assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
    assert span.parent_span_id.hex() == parent_id and span.trace_state == "vendor=one"
    assert attributes(resource)["service.name"] == "voltllm"
    attrs = attributes(span)
    usage = chat.json()["usage"]
    # (the engine's id: the response's, with a suffix as the server chose the id: --enable-request-id-headers)
    assert attrs["gen_ai.request.id"].startswith(chat.json()["id"]) and attrs["gen_ai.response.model"] == "tiny"
    assert (attrs["gen_ai.usage.prompt_tokens"], attrs["gen_ai.usage.completion_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert (attrs["gen_ai.request.n"], attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"],
            attrs["gen_ai.request.top_p"]) == (2, 3, 0.0, 0.9)
    assert before <= span.start_time_unix_nano <= span.end_time_unix_nano <= after
    e2e = attrs["gen_ai.latency.e2e"]
    assert abs(e2e - (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9) < 1e-3
    for name in ("time_in_queue", "time_to_first_token", "time_in_model_prefill", "time_in_model_decode",
                 "time_in_model_inference"):
        assert 0.0 <= attrs[f"gen_ai.latency.{name}"] <= e2e, name

    # a request without trace headers starts a trace of its own
    ((_, root),) = receiver.wait_for(lambda s: attributes(s)["gen_ai.request.id"].startswith("cmpl-otlp-untraced"))
    assert root.parent_span_id == b"" and root.trace_id.hex() != trace_id
    assert attributes(root)["gen_ai.usage.completion_tokens"] == plain.json()["usage"]["completion_tokens"]
