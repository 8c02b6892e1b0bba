"""GET /metrics writes every metric vLLM also has a second time under vLLM's name (entrypoints/openai/metrics.py
VLLM_NAMES): same labels and values, so dashboards built for a vLLM server read a voltllm one."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from voltllm.engine.types import SchedulerStats
from voltllm.entrypoints.openai.metrics import VLLM_NAMES, ServerMetrics


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_vllm_names_mirror_voltllm_ones():
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
                           prefix_cache_hits=40, num_preemptions=1,
                           extra={"spec_draft_tokens": 12, "spec_accepted_tokens": 5})
    m = ServerMetrics("smol", lambda: stats, lambda: True, lambda: 4)
    m.on_first_token(0.02)
    m.on_tokens(0.005, 3)
    m.on_finished(None, "stop", 0.4)
    m.on_http("POST", "/v1/completions", 200)
    got = _samples(m.render().decode())
    names = {name for name, _ in got}
    mirrored = 0
    for (name, labels), value in got.items():
        if not name.startswith("voltllm:"):
            continue
        family = next((f for f in VLLM_NAMES if name.startswith(f) and name[len(f):] in
                       ("", "_total", "_created", "_bucket", "_count", "_sum")), None)
        if family is None:  # voltllm's own additions: no vLLM name
            assert not any(n.startswith("vllm:" + name[len("voltllm:"):]) for n in names), name
            continue
        for alias in VLLM_NAMES[family]:
            twin = alias + name[len(family):]
            if not twin.endswith("_created"):
                assert got[(twin, labels)] == value, (name, twin)
        mirrored += 1
    assert mirrored > 20  # counters, gauges and every histogram bucket
    assert got[("vllm:num_requests_running", (("model_name", "smol"),))] == 3
    assert got[("vllm:gpu_cache_usage_perc", (("model_name", "smol"),))] == 0.25
    assert got[("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "smol")))] == 1
    assert got[("vllm:generation_tokens_total", (("model_name", "smol"),))] == 4
    assert got[("vllm:spec_decode_num_accepted_tokens_total", (("model_name", "smol"),))] == 5
    assert not any(n.startswith("vllm:http_requests") or n.startswith("vllm:num_requests_active") for n in names)
