"""`voltllm bench --scenario prefix / multi-turn`: the request sets (bench/workloads.py), their metrics, and end to end
on a tiny random model on the CPU (hit rates, later turns' hits, the CPU tier's hits)."""
from __future__ import annotations

import json

import pytest

from voltllm.bench.inprocess import Plan, make_plans, make_run_input
from voltllm.bench.metrics import RequestTiming, RunResult, cache_scenario_metrics, table_rows
from voltllm.bench.workloads import ConversationSource, MultiTurn, PrefixRepetition, PrefixRepetitionSource
from voltllm.config import ConfigError

from bench_runs import run_tiny_bench, sse_body


def _drain(source, answer=lambda req: [7] * req.output_len) -> list:
    """Every request of a source, one at a time (each answered before the next is asked for)."""
    out = []
    while (req := source.next()) is not None:
        out.append(req)
        source.done(req, answer(req))
    assert source.exhausted
    return out


# -- the request sets -------------------------------------------------------------------------------------------------
def test_prefix_repetition_shares_each_prefix_and_is_seeded():
    spec = PrefixRepetition(prefix_len=12, suffix_len=5, num_prefixes=3, output_len=4, num_prompts=9)
    reqs = _drain(PrefixRepetitionSource(spec, 1000, seed=1))
    assert [r.index for r in reqs] == list(range(9))
    assert all(len(r.prompt) == 17 and r.output_len == 4 and r.turn is None for r in reqs)
    by_group = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r.prompt)
    assert sorted(by_group) == [0, 1, 2] and all(len(v) == 3 for v in by_group.values())
    for prompts in by_group.values():  # one prefix per group, a fresh suffix per request
        assert len({tuple(p[:12]) for p in prompts}) == 1 and len({tuple(p[12:]) for p in prompts}) == 3
    assert len({tuple(v[0][:12]) for v in by_group.values()}) == 3
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled, as vLLM's
    again = _drain(PrefixRepetitionSource(spec, 1000, seed=1))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    other = _drain(PrefixRepetitionSource(spec, 1000, seed=2))
    assert not {tuple(r.prompt[:12]) for r in other} & {tuple(r.prompt[:12]) for r in reqs}


def test_prefixes_are_fresh_per_run_unless_reused():
    def prefixes(spec, run_index):
        plan = make_plans("prefix", [2], spec=spec)[0]
        return {tuple(r.prompt[:8]) for r in _drain(make_run_input(plan, 1000, 0, run_index))}

    fresh = PrefixRepetition(prefix_len=8, suffix_len=4, num_prefixes=2, output_len=2, num_prompts=4)
    assert not prefixes(fresh, 0) & prefixes(fresh, 1)
    reused = PrefixRepetition(8, 4, 2, 2, 4, reuse_prefixes=True)
    assert prefixes(reused, 0) == prefixes(reused, 1) == prefixes(reused, 2)
    plan = make_plans("prefix", [2], spec=reused)[0]
    cold, warm = (_drain(make_run_input(plan, 1000, 0, i)) for i in (0, 1))
    assert {tuple(r.prompt[8:]) for r in cold}.isdisjoint(tuple(r.prompt[8:]) for r in warm)  # suffixes stay fresh


def test_conversation_history_grows_by_answer_and_user_turn():
    spec = MultiTurn(num_conversations=3, num_turns=4, input_len=5, output_len=2)
    src = ConversationSource(spec, 1000, seed=3)
    answers = {}

    def answer(req):
        answers[req.index] = [900 + req.index, 950 + req.index]
        return answers[req.index]

    reqs = _drain(src, answer)
    assert len(reqs) == 12
    # round robin: every conversation's turn k before any turn k + 1
    assert [(r.group, r.turn) for r in reqs] == [(c, k) for k in range(1, 5) for c in range(3)]
    for r in reqs:
        assert len(r.prompt) == r.turn * 5 + (r.turn - 1) * 2
    for prev, nxt in zip(reqs, reqs[3:]):  # the same conversation's next turn
        assert nxt.group == prev.group and nxt.prompt[:len(prev.prompt) + 2] == prev.prompt + answers[prev.index]
        assert nxt.prompt[len(prev.prompt) + 2:] == src.user_turns[prev.group][prev.turn]
    assert [r.prompt for r in _drain(ConversationSource(spec, 1000, seed=3), answer)] == [r.prompt for r in reqs]
    assert reqs[0].prompt != _drain(ConversationSource(spec, 1000, seed=4))[0].prompt
    assert spec.max_request_len == 4 * (5 + 2)


def test_a_conversation_waits_for_its_answer():
    src = ConversationSource(MultiTurn(num_conversations=1, num_turns=2, input_len=3, output_len=2), 100, seed=0)
    first = src.next()
    assert src.next() is None and not src.exhausted  # turn 2 needs turn 1's answer
    with pytest.raises(RuntimeError, match="1 token ids, not the forced 2"):
        src.done(first, [5])
    src.done(first, [5, 6])
    second = src.next()
    assert second.turn == 2 and second.prompt[:5] == first.prompt + [5, 6] and src.exhausted


def test_plans_of_the_cache_scenarios_and_their_refusals():
    spec = PrefixRepetition(prefix_len=8, suffix_len=4, num_prefixes=2, output_len=3, num_prompts=6)
    assert make_plans("prefix", [1, 4], spec=spec) == [Plan("prefix", 1, 12, 3, spec=spec),
                                                        Plan("prefix", 4, 12, 3, spec=spec)]
    assert [p.concurrency for p in make_plans("multi-turn", None)] == [4]
    assert [p.concurrency for p in make_plans("concurrency", None)] == [1, 4, 16, 64]  # (unchanged default)
    with pytest.raises(ConfigError, match="--input-len / --output-len .* --prefix-repetition-prefix-len"):
        make_plans("prefix", [1], input_len=10, spec=spec)
    with pytest.raises(ConfigError, match="--multi-turn-input-len"):
        make_plans("multi-turn", [1], output_len=10)
    with pytest.raises(ConfigError, match="--request-rate shape --scenario concurrency"):
        make_plans("prefix", [1], request_rate=2.0, spec=spec)
    with pytest.raises(ConfigError, match="--num-prompts 5 must be a multiple of --prefix-repetition-num-prefixes 2"):
        make_plans("prefix", [1], spec=PrefixRepetition(8, 4, 2, 3, 5))
    with pytest.raises(ConfigError, match="--multi-turn-num-turns must be >= 1"):
        make_plans("multi-turn", [1], spec=MultiTurn(num_turns=0))


# -- metrics ----------------------------------------------------------------------------------------------------------
def _req(i, prompt, cached, ttft, turn=None, out=4):
    return RequestTiming(prompt_tokens=prompt, output_tokens=out, arrival=float(i), first_token=i + ttft,
                         last_token=i + ttft + 0.3, scheduled=i + ttft / 2, cached_tokens=cached, index=i, group=0,
                         turn=turn)


def test_cache_metrics_hit_rate_ttft_percentiles_and_turns():
    reqs = [_req(0, 40, 0, 0.5, 1), _req(1, 40, 0, 0.3, 1), _req(2, 90, 40, 0.1, 2), _req(3, 90, 80, 0.2, 2),
            _req(4, 140, 96, 0.4, 3)]
    run = RunResult("multi-turn", 2, "warm1", 10, 4, 0.0, 5.0, reqs, workload={"num_turns": 3})
    m = cache_scenario_metrics(run)
    assert m["prefix_cache_hit_rate"] == pytest.approx(216 / 400) and m["prefix_cache_hit_tokens"] == 216
    assert m["ttft_ms"] == pytest.approx(300) and m["ttft_p90_ms"] == pytest.approx(500)
    assert m["ttft_ms_turn1"] == pytest.approx(400) and m["ttft_ms_turn2"] == pytest.approx(150)
    assert m["ttft_ms_turn3"] == pytest.approx(400) and m["output_tok_s"] == pytest.approx(20 / 5)
    # computed tokens over the prefill times (scheduled -> first token)
    assert m["prefill_tok_s"] == pytest.approx((400 - 216) / (1.5 / 2))
    assert m["external_prefix_cache_hit_rate"] is None and "concurrent_decode_tok_s" not in m
    rows = table_rows([run, RunResult("multi-turn", 2, "cold", 10, 4, 0.0, 5.0, reqs, workload={"num_turns": 3})])
    assert [r["metric"] for r in rows] == ["ttft_ms", "ttft_ms_turn1", "ttft_ms_turn2", "ttft_ms_turn3",
                                           "output_tok_s", "prefix_cache_hit_rate"]
    assert rows[0]["workload"] == {"num_turns": 3}
    # hits known only as a server's counters: the rate from them, no per-request computed tokens
    run.cache_hits_source, run.cache_hit_tokens, run.external_cache_hit_tokens = "metrics", 100, 60
    m = cache_scenario_metrics(run)
    assert m["prefix_cache_hit_rate"] == pytest.approx(0.25) and m["prefill_tok_s"] is None
    assert m["external_prefix_cache_hit_rate"] == pytest.approx(0.15)
    run.cache_hits_source = "none"
    assert cache_scenario_metrics(run)["prefix_cache_hit_rate"] is None
    assert "workload" in run.to_json() and "index" in run.to_json()["requests"][0]
    one = RequestTiming(10, 2, 0.0, 0.1, 0.4, token_times=[0.1, 0.4])
    plain = RunResult("concurrency", 1, "cold", 10, 4, 0.0, 1.0, [one])
    assert "workload" not in plain.to_json() and "turn" not in plain.to_json()["requests"][0]  # (unchanged)


# -- end to end, in process, tiny random model on the CPU --------------------------------------------------------------
PREFIX_FLAGS = ("--scenario", "prefix", "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len",
                "8", "--prefix-repetition-num-prefixes", "2", "--num-prompts", "6", "--prefix-repetition-output-len",
                "2", "--concurrency", "1", "--block-size", "16")


@pytest.mark.parametrize("reuse", [False, True])
def test_prefix_scenario_hits_each_prefix_after_its_first_request(tmp_path, reuse):
    res = run_tiny_bench(tmp_path, "prefix", *PREFIX_FLAGS, *(["--prefix-repetition-reuse-prefixes"] if reuse else []))
    assert res["config"]["workload"] == {"prefix_len": 32, "suffix_len": 8, "num_prefixes": 2, "output_len": 2,
                                         "num_prompts": 6, "reuse_prefixes": reuse}
    runs = res["metrics"]["runs"]
    assert [r["run"] for r in runs] == ["cold", "warm1"]
    for run in runs:
        reqs = run["requests"]
        assert [r["index"] for r in reqs] == list(range(6)) and all(r["prompt_tokens"] == 40 for r in reqs)
        seen = set()
        for r in reqs:  # one at a time: a prefix's first request computes it, the later ones hit all of it
            first = r["group"] not in seen and not (reuse and run["run"] == "warm1")
            assert r["cached_tokens"] == (0 if first else 32), (run["run"], r)
            seen.add(r["group"])
        want = (6 if reuse and run["run"] == "warm1" else 4) * 32 / 240  # L / (L + S) of the requests that hit
        assert run["metrics"]["prefix_cache_hit_rate"] == pytest.approx(want)
        assert run["workload"]["num_prompts"] == 6 and run["cache_hits_source"] == "requests"
    table = {r["metric"]: r for r in res["metrics"]["table"]}
    assert set(table) == {"ttft_ms", "ttft_p90_ms", "output_tok_s", "prefill_tok_s", "prefix_cache_hit_rate"}
    assert table["prefill_tok_s"]["median"] > 0 and table["output_tok_s"]["median"] > 0
    assert res["metrics"]["prefix"]["1"]["prefix_cache_hit_rate"] == table["prefix_cache_hit_rate"]["median"]
    assert res["metrics"]["pure_decode_tok_s"] is None  # (the other scenarios' keys stay, empty)


def _conversation_hits(res: dict) -> dict:
    return {(r["group"], r["turn"]): (r["prompt_tokens"], r["cached_tokens"]) for r in res["metrics"]["runs"][1][
        "requests"]}


MULTI_TURN_FLAGS = ("--scenario", "multi-turn", "--multi-turn-num-conversations", "4", "--multi-turn-num-turns", "3",
                    "--multi-turn-input-len", "16", "--multi-turn-output-len", "4", "--concurrency", "1",
                    "--block-size", "4", "--max-model-len", "64")


def test_multi_turn_later_turns_hit_their_history(tmp_path):
    res = run_tiny_bench(tmp_path, "mt", *MULTI_TURN_FLAGS)
    hits = _conversation_hits(res)
    for (c, turn), (prompt, cached) in hits.items():
        assert prompt == turn * 16 + (turn - 1) * 4
        if turn == 1:
            assert cached == 0
        else:  # the previous turn's prompt and its answer but the last token (never fed back), in whole blocks
            prev = hits[(c, turn - 1)][0]
            assert cached == (prev + 4 - 1) // 4 * 4
    table = [r["metric"] for r in res["metrics"]["table"]]
    assert table == ["ttft_ms", "ttft_ms_turn1", "ttft_ms_turn2", "ttft_ms_turn3", "output_tok_s",
                     "prefix_cache_hit_rate"]
    assert res["metrics"]["multi_turn"]["1"]["prefix_cache_hit_rate"] > 0.4


def test_multi_turn_history_evicted_from_a_tiny_pool_comes_back_from_the_cpu_tier(tmp_path):
    """16 GPU blocks of 4 tokens: the other 3 conversations' turns evict a conversation's history before its next
    turn. Without a CPU tier the later turns then (nearly all) miss; with --kv-offloading-size they hit it there."""
    tiny_pool = (*MULTI_TURN_FLAGS, "--num-gpu-blocks-override", "16")
    without = run_tiny_bench(tmp_path, "gpu-only", *tiny_pool)
    assert without["metrics"]["multi_turn"]["1"]["prefix_cache_hit_rate"] < 0.05  # (a stray block may survive)
    assert "external_prefix_cache_hit_rate" not in {r["metric"] for r in without["metrics"]["table"]}
    res = run_tiny_bench(tmp_path, "cpu-tier", *tiny_pool, "--kv-offloading-size", "0.001")
    run = res["metrics"]["runs"][1]["metrics"]
    assert run["external_prefix_cache_hit_tokens"] > 0
    assert run["external_prefix_cache_hit_tokens"] <= run["prefix_cache_hit_tokens"]
    assert all(cached > 0 for (_, turn), (_, cached) in _conversation_hits(res).items() if turn > 1)
    assert res["metrics"]["multi_turn"]["1"]["external_prefix_cache_hit_rate"] > 0.3


def test_cache_scenario_refusals(tmp_path):
    with pytest.raises(ConfigError, match="--baseline .* and --profile"):
        run_tiny_bench(tmp_path, "x", *PREFIX_FLAGS, "--baseline", "hf")
    with pytest.raises(ConfigError, match="--prefix-repetition-prefix-len shape the requests of --scenario prefix, "
                                          "not --scenario decode"):
        run_tiny_bench(tmp_path, "x", "--scenario", "decode", "--prefix-repetition-prefix-len", "8")
    with pytest.raises(ConfigError, match="--multi-turn-num-turns shape the requests of --scenario multi-turn"):
        run_tiny_bench(tmp_path, "x", *PREFIX_FLAGS, "--multi-turn-num-turns", "2")
    with pytest.raises(ConfigError, match="needs 80 tokens .* more than --max-model-len 64"):
        run_tiny_bench(tmp_path, "x", *MULTI_TURN_FLAGS[:5], "4", *MULTI_TURN_FLAGS[6:])


# -- against a server (mock transport) --------------------------------------------------------------------------------
def _mock_server(httpx, usage_cached: bool):
    """A streaming /v1/completions that answers ids 100 + i (with token_ids when asked) and a /metrics whose hit
    counters grow by half of each prompt (GPU pool, as vLLM names them) and 3 tokens (CPU tier)."""
    state = {"bodies": [], "hits": 0.0, "ext": 0.0}

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/metrics":
            text = ("# TYPE vllm:prefix_cache_hits_total counter\n"
                    f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {state["hits"]}\n'
                    f'vllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} {state["ext"]}\n'
                    f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} 1e6\n')
            return httpx.Response(200, text=text)
        body = json.loads(request.content)
        state["bodies"].append(body)
        state["hits"] += len(body["prompt"]) // 2
        state["ext"] += 3
        n = body["max_tokens"]
        chunks = []
        for i in range(n):
            c = {"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}],
                 "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": i + 1}}
            if body.get("return_token_ids"):
                c["choices"][0]["token_ids"] = [100 + i]
            chunks.append(c)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        if usage_cached and len(body["prompt"]) > 10:  # (vLLM leaves a count of 0 out)
            usage["prompt_tokens_details"] = {"cached_tokens": 8}
        chunks += [{"choices": [], "usage": usage}, b"[DONE]"]
        return httpx.Response(200, content=sse_body(chunks), headers={"content-type": "text/event-stream"})

    return handler, state


@pytest.mark.parametrize("usage_cached", [False, True])
def test_client_runs_conversations_with_the_servers_answers(usage_cached):
    httpx = pytest.importorskip("httpx")
    from voltllm.bench.client import ClientRunner

    handler, state = _mock_server(httpx, usage_cached)
    spec = MultiTurn(num_conversations=3, num_turns=2, input_len=6, output_len=3)
    plan = make_plans("multi-turn", [2], spec=spec)[0]
    runner = ClientRunner("http://test", transport=httpx.MockTransport(handler))
    try:
        run = runner(plan, "warm1", make_run_input(plan, 50, 0, 1))
    finally:
        runner.close()
    bodies = state["bodies"]
    assert len(bodies) == 6 and all(b["return_token_ids"] and b["max_tokens"] == b["min_tokens"] == 3 for b in bodies)
    firsts = {tuple(b["prompt"]) for b in bodies if len(b["prompt"]) == 6}
    seconds = [b["prompt"] for b in bodies if len(b["prompt"]) == 15]
    assert len(firsts) == 3 and len(seconds) == 3
    for p in seconds:  # the history: turn 1's prompt, the server's answer, a new user turn
        assert tuple(p[:6]) in firsts and p[6:9] == [100, 101, 102]
    assert [(r.turn, r.prompt_tokens) for r in run.requests] == [(1, 6)] * 3 + [(2, 15)] * 3
    m = run.metrics()
    assert run.side == "client" and run.workload == spec.describe() and m["ttft_ms_turn2"] > 0
    assert m["external_prefix_cache_hit_tokens"] == 18  # the CPU tier's counter grew 3 per request
    if usage_cached:  # each request's own count
        assert run.cache_hits_source == "requests" and m["prefix_cache_hit_tokens"] == 3 * 8
        assert m["prefill_tok_s"] > 0
    else:  # the counters' growth: half of every prompt (GPU) + the CPU tier's
        assert run.cache_hits_source == "metrics" and m["prefix_cache_hit_tokens"] == 3 * 3 + 3 * 7 + 18
        assert m["prefix_cache_hit_rate"] == pytest.approx(48 / 63) and m["prefill_tok_s"] is None


def test_client_without_metrics_leaves_the_hit_rate_unknown():
    httpx = pytest.importorskip("httpx")
    from voltllm.bench.client import ClientRunner

    handler, _ = _mock_server(httpx, False)

    def no_metrics(request):
        return httpx.Response(404) if request.url.path == "/metrics" else handler(request)

    plan = make_plans("prefix", [3], spec=PrefixRepetition(8, 4, 2, 2, 4))[0]
    runner = ClientRunner("http://test", transport=httpx.MockTransport(no_metrics))
    try:
        run = runner(plan, "cold", make_run_input(plan, 50, 0, 0))
    finally:
        runner.close()
    m = run.metrics()
    assert len(run.requests) == 4 and run.cache_hits_source == "none"
    assert m["prefix_cache_hit_rate"] is None and m["external_prefix_cache_hit_rate"] is None and m["ttft_ms"] > 0


def test_a_turns_sampling_seed_does_not_depend_on_which_answer_came_first():
    """Sampled conversations against a server repeat with fixed seeds: a turn's seed is its conversation's and turn's,
    whatever order the answers of the turns before it came back in."""
    spec = MultiTurn(num_conversations=3, num_turns=2, input_len=4, output_len=1)
    seeds = []
    for order in ([0, 1, 2], [2, 1, 0]):
        src = ConversationSource(spec, 100, seed=0)
        firsts = [src.next() for _ in range(3)]
        for i in order:
            src.done(firsts[i], [7])
        seeds.append({(r.group, r.turn): r.seed for r in firsts + [src.next() for _ in range(3)]})
    assert seeds[0] == seeds[1] and len(set(seeds[0].values())) == 6


def test_counters_without_labels_and_a_failing_server():
    """A /metrics sample without labels is read; a request the server refuses ends the run with its error (not an
    ExceptionGroup of every client's)."""
    httpx = pytest.importorskip("httpx")
    from voltllm.bench.client import ClientRunner, parse_counters

    names = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
    text = 'vllm:prefix_cache_hits_total 42.0\nvllm:prefix_cache_hits_total{engine="1"} 8\nweird_line\n'
    assert parse_counters(text, names) == {"vllm:prefix_cache_hits_total": 50.0}
    handler, _ = _mock_server(httpx, False)

    def refusing(request):
        if request.url.path == "/v1/completions":
            return httpx.Response(400, json={"error": {"message": "too long"}})
        return handler(request)

    plan = make_plans("prefix", [2], spec=PrefixRepetition(8, 4, 2, 2, 4))[0]
    runner = ClientRunner("http://test", transport=httpx.MockTransport(refusing))
    try:
        with pytest.raises(RuntimeError, match="400"):
            runner(plan, "cold", make_run_input(plan, 50, 0, 0))
    finally:
        runner.close()
