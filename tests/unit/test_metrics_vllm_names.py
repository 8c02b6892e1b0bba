"""GET /metrics writes every metric vLLM also has a second time under vLLM's name (entrypoints/openai/metrics.py
VLLM_NAMES): same labels and values, so dashboards built for a vLLM server read a voltllm one."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from voltllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from voltllm.engine.types import SchedulerStats
from voltllm.entrypoints.openai.metrics import VLLM_NAMES, ServerMetrics, one_two_five_buckets

LAB = (("engine", "0"), ("model_name", "smol"))


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _metrics(stats: SchedulerStats = SchedulerStats(), max_model_len: int = 1000) -> ServerMetrics:
    return ServerMetrics("smol", lambda: stats, lambda: True, lambda: 4, max_model_len=max_model_len)


def _finished(prompt: int, lengths: list[int], metrics: RequestMetrics) -> RequestOutput:
    outs = [CompletionOutput(i, "", list(range(n)), finish_reason="stop") for i, n in enumerate(lengths)]
    return RequestOutput("r", None, list(range(prompt)), outs, True, metrics=metrics)


def test_vllm_names_mirror_voltllm_ones():
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
                           prefix_cache_hits=40, num_preemptions=1,
                           extra={"spec_draft_tokens": 12, "spec_accepted_tokens": 5, "spec_drafts": 6,
                                  "spec_accepted_per_pos": [4, 1]})
    m = _metrics(stats)
    m.on_first_token(0.02)
    m.on_tokens(0.005, 3)
    m.on_finished(_finished(7, [4], RequestMetrics(10.0, 10.02, 10.035, 10.4, 10.001, 10.015, 10.03)), "stop", 0.4)
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
    assert got[("vllm:num_requests_running", LAB)] == 3
    assert got[("vllm:gpu_cache_usage_perc", LAB)] == 0.25
    assert got[("vllm:request_success_total", (("engine", "0"), ("finished_reason", "stop"),
                                               ("model_name", "smol")))] == 1
    assert got[("vllm:generation_tokens_total", LAB)] == 4
    assert got[("vllm:spec_decode_num_accepted_tokens_total", LAB)] == 5
    assert got[("vllm:spec_decode_num_drafts_total", LAB)] == 6
    assert got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", LAB + (("position", "1"),))] == 1
    assert not any(n.startswith("vllm:http_requests") or n.startswith("vllm:num_requests_active") for n in names)


def test_one_two_five_buckets_stop_at_the_limit():
    assert one_two_five_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert one_two_five_buckets(4096)[-3:] == [500, 1000, 2000]
    assert one_two_five_buckets(0) == []


def test_request_histograms_as_vllm_defines_them():
    """Token counts per request and per choice, vLLM's phase split (queue / prefill / decode / inference from the
    engine's timestamps) and the per-request mean time per output token, with vLLM's buckets."""
    m = _metrics(max_model_len=300)
    for _ in range(3):
        m.on_tokens(0.03, 1)  # time_per_output_token_seconds: vLLM's older name of the inter-token latency
    # arrival 100.0, first token seen 100.5, e2e 2.5 s; engine: scheduled 100.25, tokens 100.45 .. 102.35
    metrics = RequestMetrics(100.0, 100.5, 102.4, 102.5, 100.25, 100.45, 102.35)
    m.on_finished(_finished(37, [5, 9], metrics), "stop", 2.5)
    got = _samples(m.render().decode())

    def hist(name: str) -> tuple[float, float]:
        return got[(f"vllm:{name}_count", LAB)], got[(f"vllm:{name}_sum", LAB)]

    assert hist("request_prompt_tokens") == (1, 37)
    assert hist("request_generation_tokens") == (2, 14)  # one sample per choice
    assert hist("request_max_num_generation_tokens") == (1, 9)
    for name, seconds in (("queue", 0.25), ("prefill", 0.2), ("decode", 1.9), ("inference", 2.1)):
        count, total = hist(f"request_{name}_time_seconds")
        assert count == 1 and abs(total - seconds) < 1e-9, name
    count, total = hist("request_time_per_output_token_seconds")
    assert count == 1 and abs(total - (2.5 - 0.5) / 8) < 1e-9  # (e2e - TTFT) / (longest choice - 1)
    assert hist("time_per_output_token_seconds") == (3, 0.09)
    # vLLM's buckets: 1-2-5 token counts up to max_model_len, request latencies to 7680 s, TPOT from 10 ms
    les = {n: sorted(float(dict(lab)["le"]) for (name, lab) in got if name == f"vllm:{n}_bucket")
           for n in ("request_prompt_tokens", "request_queue_time_seconds", "time_per_output_token_seconds")}
    assert les["request_prompt_tokens"][:-1] == [1, 2, 5, 10, 20, 50, 100, 200]
    assert les["request_queue_time_seconds"][0] == 0.3 and les["request_queue_time_seconds"][-2] == 7680
    assert les["time_per_output_token_seconds"][0] == 0.01 and les["time_per_output_token_seconds"][-2] == 80


def test_phases_not_reached_are_not_observed():
    """A request aborted while waiting was never scheduled: no queue, prefill or decode sample (vLLM has none)."""
    m = _metrics()
    m.on_finished(_finished(5, [0], RequestMetrics(1.0)), "abort", 0.7)
    got = _samples(m.render().decode())
    for name in ("queue", "prefill", "decode", "inference"):
        assert got[(f"vllm:request_{name}_time_seconds_count", LAB)] == 0
    assert got[("vllm:request_time_per_output_token_seconds_count", LAB)] == 0
    assert got[("vllm:request_prompt_tokens_count", LAB)] == 1
    assert got[("vllm:e2e_request_latency_seconds_count", LAB)] == 1


def test_step_tokens_request_params_and_cache_config():
    """vLLM's iteration_tokens_total (tokens of each engine step), request_params_n / request_params_max_tokens and
    cache_config_info families, under both names."""
    from types import SimpleNamespace

    cache = SimpleNamespace(block_size=16, kv_cache_dtype="auto", enable_prefix_caching=True,
                            gpu_memory_utilization=0.9, num_gpu_blocks_override=None)
    m = ServerMetrics("smol", lambda: SchedulerStats(num_blocks=321), lambda: True, lambda: 0, max_model_len=1000,
                      cache_config=cache)
    m.on_iteration_tokens([64, 1, 300])
    m.on_request_params(2, 100)
    got = _samples(m.render().decode())
    for prefix in ("voltllm:", "vllm:"):
        assert got[(prefix + "iteration_tokens_total_count", LAB)] == 3
        assert got[(prefix + "iteration_tokens_total_sum", LAB)] == 365
        assert got[(prefix + "iteration_tokens_total_bucket", (*LAB[:1], ("le", "64.0"), *LAB[1:]))] == 2
        assert got[(prefix + "request_params_n_sum", LAB)] == 2
        assert got[(prefix + "request_params_max_tokens_sum", LAB)] == 100
        info = [(labels, v) for (name, labels), v in got.items() if name == prefix + "cache_config_info"]
        assert len(info) == 1 and info[0][1] == 1.0
        assert dict(info[0][0]) == {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
                                    "gpu_memory_utilization": "0.9", "num_gpu_blocks": "321",
                                    "num_gpu_blocks_override": "None", "kv_offloading_size": "None",
                                    "kv_offloading_backend": "None", "engine": "0"}

    offloading = SimpleNamespace(**vars(cache), kv_offloading_size=4.0, kv_offloading_backend="native")
    m = ServerMetrics("smol", lambda: SchedulerStats(num_blocks=321), lambda: True, lambda: 0, max_model_len=1000,
                      cache_config=offloading)
    info = [labels for (name, labels), _ in _samples(m.render().decode()).items() if name == "vllm:cache_config_info"]
    assert dict(info[0])["kv_offloading_size"] == "4.0" and dict(info[0])["kv_offloading_backend"] == "native"


def test_the_scheduler_hands_each_steps_tokens_over_once(tmp_path):
    from tiny_models import make_model
    from voltllm import LLM, SamplingParams

    llm = LLM(make_model(str(tmp_path / "m"), "llama"), block_size=4)
    llm.engine.stats()  # (what start-up scheduled)
    llm.generate(["a b c d e f"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    steps = llm.engine.stats().iteration_tokens
    assert steps[0] > 1 and steps[1:] == [1, 1, 1]  # the prompt's step, then one token per decode step
    assert llm.engine.stats().iteration_tokens == []
