"""vLLM's newer frontend flags and request fields on a real server (a tiny random llama on the CPU): GET
/tokenizer_info, --stream-interval and a request's stream_interval, --max-logprobs -1 (the whole vocabulary),
--exclude-tools-when-tool-choice-none, --disable-access-log-for-endpoints, the speech routes refused by name, the
Responses API's request_id / service_tier, chat's return_prompt_text and null keys, vLLM's context-length words,
--enable-mfu-metrics' counters, --kv-cache-metrics' histograms, and --uds (a Unix domain socket)."""
from __future__ import annotations

import json
import os
import tempfile
import time

import httpx
import pytest

from server_helpers import ServerProc, free_port, wait_gone
from tiny_models import make_model

NAME = "tiny-flags"
# a request template that shows whether the template got tools
TOOLS_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                  "{% if tools %}{% for t in tools %} tool {{ t['function']['name'] }} with its schema{% endfor %}"
                  "{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def flags_server(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("tiny_flags")), "llama")
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", NAME,
                      "--disable-log-stats", "--enable-tokenizer-info-endpoint",
                      "--exclude-tools-when-tool-choice-none",
                      "--max-logprobs", "-1", "--stream-interval", "3",
                      "--disable-access-log-for-endpoints", "/health,/metrics", "--enable-mfu-metrics",
                      "--kv-cache-metrics", "--kv-cache-metrics-sample", "1"], free_port(),
                     env={"OMP_NUM_THREADS": "1"})
    srv.model_path = path
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


def _post(srv, route, body):
    return httpx.post(srv.base + route, json={"model": NAME, **body}, timeout=120)


def test_tokenizer_info_and_the_speech_routes(flags_server):
    info = httpx.get(flags_server.base + "/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] and "im_start" in info["chat_template"] and "eos_token" in info
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/realtime"):
        r = httpx.post(flags_server.base + path, json={}, timeout=30)
        assert r.status_code == 404 and "is not built in voltllm" in r.json()["error"]["message"], r.text
    assert "text models" in httpx.get(flags_server.base + "/v1/realtime", timeout=30).json()["error"]["message"]


def _token_counts(srv, **extra) -> list[int]:
    """Tokens in each streamed completion chunk that carries any."""
    body = {"prompt": "hello there", "max_tokens": 10, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True, **extra}
    counts = []
    with httpx.stream("POST", srv.base + "/v1/completions", json={"model": NAME, **body},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if ids:
                    counts.append(len(ids))
    return counts


def test_stream_interval_batches_tokens_per_chunk(flags_server):
    for asked, least in ((None, 3), (1, 3), (5, 5)):  # (a request can only ask for larger chunks)
        counts = _token_counts(flags_server, **({} if asked is None else {"stream_interval": asked}))
        assert sum(counts) == 10 and all(n >= least for n in counts[1:-1]), (asked, counts)
        assert len(counts) <= 2 + 9 // least, (asked, counts)


def test_whole_vocabulary_logprobs_with_max_logprobs_minus_one(flags_server):
    with open(os.path.join(flags_server.model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    r = _post(flags_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1, "logprobs": True, "top_logprobs": -1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == vocab


def test_tools_leave_the_prompt_under_tool_choice_none(flags_server):
    def prompt_tokens(**extra):
        r = _post(flags_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 1, "chat_template": TOOLS_TEMPLATE,
                                                         "return_prompt_text": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"], r.json()["prompt_text"]

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    with_tools = prompt_tokens(tools=TOOLS, tool_choice="required")
    assert with_tools[0] > plain[0] and "tool lookup" in with_tools[1]


def test_chat_answers_carry_vllms_null_keys_and_context_words(flags_server):
    body = _post(flags_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2}).json()
    assert body["service_tier"] is None and body["system_fingerprint"] is None and "prompt_text" not in body
    r = _post(flags_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 5000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert err["message"].startswith("This model's maximum context length is 1024 tokens. However, you requested")


def test_responses_request_id_and_service_tier(flags_server):
    r = _post(flags_server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "request_id": "resp_mine",
                                              "service_tier": "flex", "reasoning": {"effort": "low"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["id"], body["service_tier"], body["reasoning"]) == ("resp_mine", "flex", {"effort": "low"})
    assert httpx.get(flags_server.base + "/v1/responses/resp_mine", timeout=30).json()["id"] == "resp_mine"
    assert _post(flags_server, "/v1/responses", {"input": "hi", "max_output_tokens": 1}).json()["service_tier"] == \
        "auto"


def test_access_log_leaves_out_the_listed_endpoints(flags_server):
    for path in ("/health", "/metrics", "/v1/models"):
        assert httpx.get(flags_server.base + path, timeout=30).status_code == 200
    deadline = time.monotonic() + 10
    while '"GET /v1/models' not in flags_server.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = flags_server.log_text()
    assert '"GET /v1/models' in log and '"GET /health' not in log and '"GET /metrics' not in log


def test_serves_on_a_unix_domain_socket(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("tiny_uds")), "llama")
    where = tempfile.mkdtemp(prefix="voltllm-uds-")
    sock, log_file, log_config = (os.path.join(where, name) for name in ("api.sock", "server.log", "logging.json"))
    with open(log_config, "w") as f:  # (--log-config-file: every log line into a file of its own)
        json.dump({"version": 1, "disable_existing_loggers": False,
                   "handlers": {"file": {"class": "logging.FileHandler", "filename": log_file}},
                   "root": {"handlers": ["file"], "level": "INFO"}}, f)
    srv = ServerProc([path, "--device", "cpu", "--served-model-name", NAME, "--disable-log-stats", "--uds", sock,
                      "--log-config-file", log_config], free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://voltllm", timeout=60)
        deadline = time.monotonic() + 180
        while True:
            assert srv.proc.poll() is None, srv.log_text()[-3000:]
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, srv.log_text()[-3000:]
                time.sleep(0.5)
        srv.descendants = []
        r = client.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        # ("serving ... at unix:" is said once the server reports started, which it may do after a first answer)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and f"unix:{sock}" not in srv.log_text():
            time.sleep(0.1)
        assert f"unix:{sock}" in srv.log_text()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and '"POST /v1/completions' not in open(log_file).read():
            time.sleep(0.2)
        assert '"POST /v1/completions' in open(log_file).read()  # (uvicorn's access line, through the config)
        with pytest.raises(httpx.HTTPError):  # nothing on the TCP port
            httpx.get(srv.base + "/health", timeout=3)
    finally:
        srv.stop()
        assert not wait_gone(srv.descendants, 5)


def test_mfu_counters_grow_with_the_work(flags_server):
    """--enable-mfu-metrics: vLLM's estimated FLOPs / bytes per GPU counters, under both prefixes, grow with a
    request's work."""
    def counters():
        text = httpx.get(flags_server.base + "/metrics", timeout=30).text
        got = {}
        for line in text.splitlines():
            for prefix in ("vllm:", "voltllm:"):
                for key in ("flops", "read_bytes", "write_bytes"):
                    if line.startswith(f"{prefix}estimated_{key}_per_gpu_total{{"):
                        got[prefix + key] = float(line.rsplit(" ", 1)[1])
        return got

    before = counters()
    assert len(before) == 6
    r = _post(flags_server, "/v1/completions", {"prompt": "hello there", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    after = counters()
    assert all(after[k] > before[k] for k in before)
    assert after["vllm:flops"] == after["voltllm:flops"]


def test_kv_block_residency_histograms(flags_server):
    """--kv-cache-metrics --kv-cache-metrics-sample 1: every block's lifetime is observed when its request ends, and
    the same prompt again observes reuse gaps; under both prefixes."""
    def counts():
        text = httpx.get(flags_server.base + "/metrics", timeout=30).text
        got = {}
        for line in text.splitlines():
            for prefix in ("vllm:", "voltllm:"):
                for key in ("lifetime", "reuse_gap"):
                    if line.startswith(f"{prefix}kv_block_{key}_seconds_count{{"):
                        got[prefix + key] = float(line.rsplit(" ", 1)[1])
        return got

    before = counts()
    body = {"prompt": "the same words, long enough to fill a few blocks of four tokens", "max_tokens": 2}
    for _ in range(2):
        assert _post(flags_server, "/v1/completions", body).status_code == 200
    deadline = time.monotonic() + 30
    while True:  # (the last request's blocks go with the engine's next stats)
        after = counts()
        if after.get("vllm:reuse_gap", 0) > before.get("vllm:reuse_gap", 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after["vllm:lifetime"] > before.get("vllm:lifetime", 0) and after["vllm:reuse_gap"] > 0
    assert after["vllm:lifetime"] == after["voltllm:lifetime"]
