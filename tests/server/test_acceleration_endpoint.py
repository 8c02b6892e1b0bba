"""GET /v1/acceleration and /v1/sm70/acceleration on the shared (keyed, CPU) server."""
from __future__ import annotations

import uuid

import httpx

from server_helpers import API_KEY, MODEL_NAMES

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _report(server, path="/v1/acceleration") -> dict:
    r = httpx.get(server.base + path, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_acceleration_report(server):
    body = _report(server)
    assert body["object"] == "acceleration_report" and body["source"] == "engine"
    assert body["platform"]["route"] == "cpu" and body["configuration"]["device"] == "cpu"
    for name in ("attention_prefill", "attention_decode", "kv_codec", "linear", "sampler", "cuda_graphs",
                 "compile_cache", "fused_elementwise"):
        route = body["routes"][name]
        assert route["enabled"] is False and route["expected"] is False and route["reason"]
        assert route["calls"] is not None
    assert body["ok"] is True and body["expected"].startswith("nothing")


def test_counters_move_with_requests(server):
    before = _report(server)["routes"]
    r = httpx.post(server.base + "/v1/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL_NAMES[0], "max_tokens": 4, "temperature": 0,
                         # unique and several tokens long: a real prefill step, not a prefix-cache hit
                         "prompt": f"Acceleration report probe {uuid.uuid4().hex}: count the routes.",
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = _report(server, "/v1/sm70/acceleration")["routes"]  # same body at the seed system's path
    for name in ("attention_prefill", "attention_decode", "linear", "sampler"):
        assert after[name]["calls"]["total"] > before[name]["calls"]["total"], name


def test_acceleration_needs_the_api_key(server):
    for path in ("/v1/acceleration", "/v1/sm70/acceleration"):
        r = httpx.get(server.base + path, timeout=10)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
