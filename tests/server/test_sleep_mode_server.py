"""vLLM's sleep-mode routes (--enable-sleep-mode): POST /sleep?level=N, POST /wake_up[?tags=...], GET /is_sleeping.
Greedy completions after wake-up are the ones before sleep (levels 1 and 2, whole and tag by tag); a sleep aborts the
request in flight (503 request_aborted) and leaves no KV block in use; a sleeping server answers requests 503; bad
levels / tags / modes are 400s; the routes are behind --api-key; without the flag they are 404s. The same server runs
vLLM's other development routes, POST /start_profile and /stop_profile (--profiler-config): the engine's trace of the
requests between them lands in the directory; out-of-turn calls are 400s; without the flag, 404s."""
from __future__ import annotations

import gzip
import json
import threading
import time

import httpx
import pytest

from server_helpers import API_KEY, ServerProc, free_port, metrics, wait_idle
from tiny_models import make_model

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def sleepy_server(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("sleepy")), "qwen3")
    traces = tmp_path_factory.mktemp("traces")
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False})
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny", "--api-key",
                      API_KEY, "--enable-sleep-mode", "--profiler-config", profiler, "--disable-log-stats",
                      "--disable-uvicorn-access-log"], free_port(), env={"OMP_NUM_THREADS": "1"})
    srv.traces = traces
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


def _post(srv, path, **params):
    return httpx.post(srv.base + path, params=params, headers=AUTH, timeout=120)


def _sleeping(srv) -> bool:
    r = httpx.get(srv.base + "/is_sleeping", timeout=10)
    assert r.status_code == 200
    return r.json()["is_sleeping"]


def _complete(srv, max_tokens=8):
    return httpx.post(srv.base + "/v1/completions", headers=AUTH, timeout=120,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})


def _tokens(srv) -> str:
    r = _complete(srv)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_sleep_and_wake_keep_the_outputs(sleepy_server):
    srv = sleepy_server
    before = _tokens(srv)
    assert _sleeping(srv) is False
    for level in ("1", "2"):
        assert _post(srv, "/sleep", level=level).status_code == 200
        assert _sleeping(srv) is True
        r = _complete(srv)
        assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"], r.text
        assert _post(srv, "/wake_up").status_code == 200
        assert _sleeping(srv) is False
        assert _tokens(srv) == before
    # tag by tag (vLLM's repeated ?tags=)
    assert _post(srv, "/sleep", level="2").status_code == 200
    assert _post(srv, "/wake_up", tags="weights").status_code == 200
    assert _sleeping(srv) is True and _complete(srv).status_code == 503
    assert _post(srv, "/wake_up", tags=["kv_cache"]).status_code == 200
    assert _sleeping(srv) is False and _tokens(srv) == before


def test_sleep_aborts_the_request_in_flight(sleepy_server):
    srv = sleepy_server
    result = {}

    def long_request():
        result["response"] = _complete(srv, max_tokens=900)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while metrics(srv)["voltllm:num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _post(srv, "/sleep", level="1").status_code == 200
    t.join(60)
    r = result["response"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "request_aborted", r.text
    assert "put to sleep" in r.json()["error"]["message"]
    m = metrics(srv)
    assert m["voltllm:kv_cache_usage_perc"] == 0 and m["voltllm:num_requests_running"] == 0
    assert _post(srv, "/wake_up").status_code == 200
    wait_idle(srv)
    assert _tokens(srv)


def test_bad_input_and_the_api_key(sleepy_server):
    srv = sleepy_server
    for params, param in (({"level": "3"}, "level"), ({"level": "x"}, "level"), ({"mode": "wait"}, "mode")):
        r = _post(srv, "/sleep", **params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _post(srv, "/wake_up", tags="bogus")
    assert r.status_code == 400 and "unknown wake_up tag 'bogus'" in r.json()["error"]["message"]
    assert httpx.post(srv.base + "/sleep", timeout=10).status_code == 401
    assert httpx.post(srv.base + "/wake_up", timeout=10).status_code == 401
    assert _sleeping(srv) is False


def test_routes_are_404_without_the_flag(tiny_server):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        r = httpx.request(method, tiny_server.base + path, timeout=10)
        assert r.status_code == 404 and "--enable-sleep-mode" in r.json()["error"]["message"], r.text


def test_profile_routes_write_the_engines_trace(sleepy_server):
    srv = sleepy_server
    assert _post(srv, "/stop_profile").status_code == 400  # (not running)
    assert httpx.post(srv.base + "/start_profile", timeout=10).status_code == 401
    assert _post(srv, "/start_profile").status_code == 200
    r = _post(srv, "/start_profile")
    assert r.status_code == 400 and "already running" in r.json()["error"]["message"], r.text
    _tokens(srv)
    assert _post(srv, "/stop_profile").status_code == 200
    traces = sorted(srv.traces.glob("voltllm-engine0-*.pt.trace.json.gz"))
    assert len(traces) == 1 and len(list(srv.traces.glob("voltllm-engine0-*-totals.txt"))) == 1
    with gzip.open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the engine's forward ran in it
    r = _post(srv, "/stop_profile")
    assert r.status_code == 400 and "not running" in r.json()["error"]["message"], r.text


def test_profile_routes_are_404_without_the_flag(tiny_server):
    for path in ("/start_profile", "/stop_profile"):
        r = httpx.post(tiny_server.base + path, timeout=10)
        assert r.status_code == 404 and "--profiler-config" in r.json()["error"]["message"], r.text
