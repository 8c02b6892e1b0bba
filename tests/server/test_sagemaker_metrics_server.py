"""SageMaker's routes (GET / POST /ping, POST /invocations, as vLLM's) and vLLM's per-request histograms on
GET /metrics, against the shared server (API key on)."""
from __future__ import annotations

import httpx

from server_helpers import API_KEY, metrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_ping_answers_as_health_without_the_key(server):
    assert httpx.get(server.base + "/ping", timeout=10).status_code == 200
    assert httpx.post(server.base + "/ping", timeout=10).status_code == 200


def test_invocations_dispatches_by_the_body(server):
    url = server.base + "/invocations"
    body = {"model": "smol", "max_tokens": 2, "temperature": 0}
    assert httpx.post(url, json={**body, "prompt": "Hi"}, timeout=10).status_code == 401  # guarded as /v1/*
    r = httpx.post(url, json={**body, "prompt": "Hi"}, headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = httpx.post(url, json={**body, "messages": [{"role": "user", "content": "Hi"}]}, headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = httpx.post(url, json=body, headers=AUTH, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_invocation"
    assert "messages" in err["message"] and "prompt" in err["message"]
    r = httpx.post(url, content=b"{not json", headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_metrics_have_vllms_request_histograms(server, client):
    before = metrics(server)
    client.completions.create(model="smol", prompt="Hello there", max_tokens=4, temperature=0, extra_body={
        "ignore_eos": True})
    m = metrics(server)

    def grew(name: str) -> float:
        return m[name] - before.get(name, 0.0)

    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_time_per_output_token_seconds"):
        assert grew(f"vllm:{name}_count") == 1, name
        assert m[f"vllm:{name}_sum"] == m[f"voltllm:{name}_sum"], name
    assert grew("vllm:request_generation_tokens_sum") == 4
    assert grew("vllm:request_max_num_generation_tokens_sum") == 4
    assert grew("vllm:request_prompt_tokens_sum") >= 2
    assert grew("vllm:time_per_output_token_seconds_count") == 3  # one per token after the first
    e2e = grew("vllm:e2e_request_latency_seconds_sum")
    queue, prefill, decode = (grew(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert decode > 0 and 0 <= queue + prefill + decode <= e2e
    text = httpx.get(server.base + "/metrics", timeout=10).text
    assert 'vllm:request_queue_time_seconds_count{engine="0",model_name="smol"}' in text
