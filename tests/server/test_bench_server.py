"""`voltllm bench --base-url` against a real server (the shared tiny CPU server): the multi-turn scenario resends the
server's own answers, and the hit rate comes from the server's /metrics counters."""
from __future__ import annotations

import json


def test_multi_turn_bench_against_a_server(tiny_server, tmp_path):
    from voltllm.bench.cli import main

    out = tmp_path / "results"
    assert main(["--base-url", tiny_server.base, "--server-model", "tiny", "--prompt-vocab", "300", "--scenario",
                 "multi-turn", "--multi-turn-num-conversations", "2", "--multi-turn-num-turns", "3",
                 "--multi-turn-input-len", "12", "--multi-turn-output-len", "4", "--concurrency", "2", "--num-warm",
                 "1", "--no-limits", "--output-dir", str(out), "--name", "mt", "--commit", "abc"]) == 0
    with open(out / "mt.json") as f:
        res = json.load(f)
    assert res["config"]["client_side_times"] and res["config"]["workload"]["num_turns"] == 3
    for run in res["metrics"]["runs"]:
        assert run["cache_hits_source"] == "metrics"  # (this server has no --enable-prompt-tokens-details)
        assert [(r["turn"], r["prompt_tokens"]) for r in run["requests"]] == [(1, 12)] * 2 + [(2, 28)] * 2 + [
            (3, 44)] * 2
        # turns 2 and 3 find their history (block size 4): (12 + 3) // 4 * 4 and (28 + 3) // 4 * 4 tokens
        assert run["metrics"]["prefix_cache_hit_tokens"] == 2 * (12 + 28)
    metrics = {r["metric"] for r in res["metrics"]["table"]}
    assert {"ttft_ms_turn1", "ttft_ms_turn3", "prefix_cache_hit_rate"} <= metrics
    assert "external_prefix_cache_hit_rate" not in metrics  # (no CPU tier on this server)
