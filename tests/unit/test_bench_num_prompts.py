"""`voltllm bench --scenario concurrency --num-prompts N`: N random requests per run with at most C in flight, the next
sent when one ends (vLLM's bench serve with --max-concurrency), in process and against a server."""
from __future__ import annotations

import json

import pytest

from voltllm.bench.inprocess import make_plans, make_run_input, make_workload
from voltllm.bench.metrics import RunResult, format_table, table_rows
from voltllm.bench.workloads import FixedSource
from voltllm.config import ConfigError

from bench_runs import run_tiny_bench, sse_body


def test_plans_and_refusals():
    plan = make_plans("concurrency", [2, 4], 16, 8, num_prompts=10)
    assert [(p.concurrency, p.num_prompts) for p in plan] == [(2, 10), (4, 10)]
    assert plan[1].workload() == {"num_prompts": 10, "max_concurrency": 4}
    assert make_plans("concurrency", [4], 16, 8)[0].workload() is None  # (one batch, unchanged)
    every = make_plans("all", [4], num_prompts=8)  # (only the concurrency plan streams)
    assert [(p.scenario, p.num_prompts) for p in every] == [("decode", None), ("concurrency", 8), ("prefill", None)]
    with pytest.raises(ValueError, match="not of --scenario decode"):
        make_plans("decode", None, num_prompts=8)
    with pytest.raises(ValueError, match="--num-prompts 3 is below --concurrency 4"):
        make_plans("concurrency", [1, 4], num_prompts=3)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_the_stream_is_the_batch_draw_of_n(ratio):
    plan = make_plans("concurrency", [3], 20, 6, range_ratio=ratio, num_prompts=7)[0]
    source = make_run_input(plan, 100, 5, 1)
    assert isinstance(source, FixedSource) and source.total == 7
    reqs = []
    while (r := source.next()) is not None:
        reqs.append(r)
    batch = make_workload(plan, 100, _run_seed(plan, 5, 1), 7)
    assert [r.prompt for r in reqs] == batch.prompts and [r.output_len for r in reqs] == batch.output_lens
    assert [r.index for r in reqs] == list(range(7)) and source.exhausted
    assert (len({len(r.prompt) for r in reqs}) > 1) == bool(ratio)


def _run_seed(plan, seed, run_index):
    from voltllm.bench.inprocess import prompt_seed

    return prompt_seed(seed, plan, run_index)


def test_table_names_the_stream():
    from voltllm.bench.metrics import RequestTiming

    reqs = [RequestTiming(8, 3, 0.0, 0.1, 0.3, token_times=[0.1, 0.2, 0.3])]
    runs = [RunResult("concurrency", 2, run, 8, 3, 0.0, 0.5, reqs, workload={"num_prompts": 5, "max_concurrency": 2})
            for run in ("cold", "warm1")]
    rows = table_rows(runs)
    assert all(r["workload"] == {"num_prompts": 5, "max_concurrency": 2} for r in rows)
    assert "concurrency 8/3 n=5" in format_table(rows)
    assert "cache_hits_source" not in runs[0].to_json()  # (the prefix-cache scenarios' key)


def test_in_process_keeps_at_most_c_in_flight(tmp_path):
    res = run_tiny_bench(tmp_path, "stream", "--scenario", "concurrency", "--max-concurrency", "2", "--num-prompts",
                         "5", "--input-len", "8", "--output-len", "3")
    runs = res["metrics"]["runs"]
    assert [r["run"] for r in runs] == ["cold", "warm1"]
    for run in runs:
        reqs = sorted(run["requests"], key=lambda r: r["arrival"])
        assert len(reqs) == 5 and all(r["output_tokens"] == 3 and r["prompt_tokens"] == 8 for r in reqs)
        assert run["workload"] == {"num_prompts": 5, "max_concurrency": 2} and run["concurrency"] == 2
        # the first two go together; each later one is sent after one more has ended
        assert reqs[1]["arrival"] - reqs[0]["arrival"] < 0.05
        for i in range(2, 5):
            ended = sum(r["last_token"] <= reqs[i]["arrival"] for r in reqs[:i])
            assert ended >= i - 1, (i, reqs)
        m = run["metrics"]
        assert m["output_tok_s"] == pytest.approx(15 / run["wall_s"])
        assert m["request_throughput"] == pytest.approx(5 / run["wall_s"])
        assert m["total_tok_s"] == pytest.approx((15 + 5 * 8) / run["wall_s"])
    table = {r["metric"]: r for r in res["metrics"]["table"]}
    assert list(table) == ["output_tok_s", "request_throughput", "total_tok_s", "ttft_ms", "tpot_ms", "ttft_p99_ms",
                           "tpot_p99_ms", "itl_p99_ms"]  # (no common decode window: N > C)
    warm = [r for r in runs if r["run"] == "warm1"][0]["requests"]
    assert table["ttft_p99_ms"]["median"] == pytest.approx(max(r["ttft_ms"] for r in warm))  # (5 requests: the max)
    assert table["output_tok_s"]["workload"]["num_prompts"] == 5
    assert res["metrics"]["output_tok_s"]["2"] == table["output_tok_s"]["median"]
    assert res["config"]["num_prompts"] == 5


def test_vllm_bench_serve_spelling(tmp_path):
    """vLLM's `bench serve --dataset-name random --random-input-len I --random-output-len O --max-concurrency C
    --num-prompts N --ignore-eos` runs the concurrency scenario as its own flags would."""
    from voltllm.bench.cli import resolve_scenario

    res = run_tiny_bench(tmp_path, "vllm", "--dataset-name", "random", "--random-input-len", "6", "--random-output-len",
                         "2", "--max-concurrency", "2", "--num-prompts", "3", "--ignore-eos", "--save-result",
                         "--result-filename", "vllm.json")
    run = res["metrics"]["runs"][1]
    assert run["scenario"] == "concurrency" and run["workload"] == {"num_prompts": 3, "max_concurrency": 2}
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in run["requests"]] == [(6, 2)] * 3
    assert resolve_scenario("prefix", "prefix_repetition") == "prefix"
    assert resolve_scenario(None, "random-mm") == "random-mm" and resolve_scenario(None, None) == "decode"
    with pytest.raises(ConfigError, match="--dataset-name random is --scenario concurrency, not --scenario prefill"):
        run_tiny_bench(tmp_path, "x", "--dataset-name", "random", "--scenario", "prefill")
    with pytest.raises(ConfigError, match="name different files"):
        run_tiny_bench(tmp_path, "x", "--result-filename", "y.json")
    from voltllm.bench.cli import result_name

    assert result_name(None, "run.json") == "run" and result_name("a", None) == "a" and result_name(None, None) is None
    with pytest.raises(ConfigError, match="a file name"):
        result_name(None, "dir/run.json")


def test_cli_refusals(tmp_path):
    with pytest.raises(ConfigError, match="--num-prompts does not apply to --scenario multi-turn"):
        run_tiny_bench(tmp_path, "x", "--scenario", "multi-turn", "--num-prompts", "4")
    with pytest.raises(ValueError, match="drop --random-range-ratio, --request-rate and --num-prompts"):
        run_tiny_bench(tmp_path, "x", "--scenario", "concurrency", "--concurrency", "2", "--num-prompts", "4",
                       "--baseline", "hf")
    with pytest.raises(ValueError, match="not of --scenario prefill"):
        run_tiny_bench(tmp_path, "x", "--scenario", "prefill", "--num-prompts", "4")


@pytest.mark.parametrize("rate", [float("inf"), 10.0])
def test_client_sends_n_with_c_workers(rate):
    import time

    httpx = pytest.importorskip("httpx")
    from voltllm.bench.client import ClientRunner

    prompts, sent = [], []

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/metrics":
            return httpx.Response(404)
        body = json.loads(request.content)
        prompts.append(body["prompt"])
        sent.append(time.monotonic())
        n = body["max_tokens"]
        chunks = [{"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]}
                  for i in range(n)]
        chunks += [{"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}},
                   b"[DONE]"]
        return httpx.Response(200, content=sse_body(chunks), headers={"content-type": "text/event-stream"})

    plan = make_plans("concurrency", [2], 6, 2, num_prompts=5, request_rate=rate)[0]
    runner = ClientRunner("http://test", transport=httpx.MockTransport(handler))
    try:
        work = make_run_input(plan, 50, 0, 1)
        run = runner(plan, "warm1", work)
    finally:
        runner.close()
    assert sorted(map(tuple, prompts)) == sorted(tuple(r.prompt) for r in work.requests)
    if rate != float("inf"):  # each sent no earlier than its arrival time (after the first)
        due = {tuple(r.prompt): r.not_before for r in work.requests}
        for p, t in zip(prompts, sent):
            assert t - sent[0] >= due[tuple(p)] - 0.04  # (the first send's own delay after the start)
    assert len(run.requests) == 5 and run.workload == {"num_prompts": 5, "max_concurrency": 2}
    assert run.side == "client" and run.metrics()["output_tok_s"] > 0


def test_latency_percentiles_as_vllm_names_them():
    """--percentile-metrics / --metric-percentiles: the table's rows <metric>_p<q>_ms, nearest rank over the requests
    (ttft, tpot, e2el) or over every gap between a request's tokens (itl)."""
    from voltllm.bench.metrics import RequestTiming, percentile_names

    reqs = [RequestTiming(8, 3, 0.0, 0.1 * (i + 1), 0.1 * (i + 1) + 0.02 * (i + 1), token_times=[
        0.1 * (i + 1), 0.1 * (i + 1) + 0.01 * (i + 1), 0.1 * (i + 1) + 0.02 * (i + 1)]) for i in range(10)]
    run = RunResult("concurrency", 10, "warm1", 8, 3, 0.0, 1.5, reqs)
    assert run.metric("ttft_p50_ms") == pytest.approx(500.0) and run.metric("ttft_p99_ms") == pytest.approx(1000.0)
    assert run.metric("tpot_p90_ms") == pytest.approx(90.0)  # (0.02 * (i + 1) / 2 tokens)
    assert run.metric("e2el_p100_ms") == pytest.approx(1200.0)
    assert run.metric("itl_p50_ms") == pytest.approx(50.0) and run.metric("itl_p99_ms") == run.metrics()["itl_p99_ms"]
    assert run.metric("ttft_p99.9_ms") == pytest.approx(1000.0) and run.metric("nothing_p5_ms") is None
    assert percentile_names(["ttft", "e2el"], [50.0, 99.9]) == ("ttft_p50_ms", "ttft_p99.9_ms", "e2el_p50_ms",
                                                                 "e2el_p99.9_ms")
    rows = table_rows([run], (("e2el",), (50.0, 90.0)))
    assert [r["metric"] for r in rows] == ["output_tok_s", "request_throughput", "total_tok_s", "ttft_ms", "tpot_ms",
                                           "e2el_p50_ms", "e2el_p90_ms"]  # (staggered requests: no common window)


def test_percentile_flags(tmp_path):
    res = run_tiny_bench(tmp_path, "pct", "--scenario", "concurrency", "--concurrency", "2", "--input-len", "6",
                         "--output-len", "3", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9")
    names = [r["metric"] for r in res["metrics"]["table"]]
    assert [n for n in names if n.endswith("_ms")] == ["ttft_ms", "tpot_ms", "ttft_p50_ms", "ttft_p99.9_ms",
                                                       "e2el_p50_ms", "e2el_p99.9_ms"]
    assert res["config"]["percentile_metrics"] == ["ttft", "e2el"] and res["config"]["metric_percentiles"] == [50, 99.9]
    for bad in (["--percentile-metrics", "ttft,latency"], ["--metric-percentiles", "0"],
                ["--metric-percentiles", "101"], ["--metric-percentiles", "x"]):
        with pytest.raises(SystemExit):
            run_tiny_bench(tmp_path, "x", "--scenario", "concurrency", *bad)


def test_request_rate_under_the_concurrency_cap(tmp_path):
    """--request-rate with --num-prompts: each request is sent at its arrival time or, when C are in flight, as soon
    as one ends (vLLM's bench serve with both flags); TTFT counts from the send."""
    plan = make_plans("concurrency", [2], 6, 2, request_rate=20.0, num_prompts=5)[0]
    source = make_run_input(plan, 100, 0, 1)
    offsets = [r.not_before for r in source.requests]
    assert offsets[0] == 0.0 and all(b > a for a, b in zip(offsets, offsets[1:]))
    assert offsets == make_workload(plan, 100, _run_seed(plan, 0, 1), 5).arrivals
    res = run_tiny_bench(tmp_path, "rate", "--scenario", "concurrency", "--concurrency", "2", "--num-prompts", "5",
                         "--request-rate", "20", "--input-len", "6", "--output-len", "2")
    for run in res["metrics"]["runs"]:
        reqs = sorted(run["requests"], key=lambda r: r["arrival"])
        start = min(r["arrival"] for r in reqs)
        want = make_workload(plan, 512, _run_seed(plan, 0, 0 if run["run"] == "cold" else 1), 5).arrivals
        for r, due in zip(reqs, want):
            assert r["arrival"] - start >= due - 0.02, (r, due)  # never before its time (less the first add's delay)
        for i in range(2, 5):  # never more than 2 in flight
            assert sum(q["last_token"] <= reqs[i]["arrival"] for q in reqs[:i]) >= i - 1
        assert run["request_rate"] == 20.0 and run["workload"]["num_prompts"] == 5
    assert "@20/s n=5" in format_table(res["metrics"]["table"])
