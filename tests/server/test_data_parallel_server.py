"""`voltllm serve -dp 2` on the CPU: two engine processes behind one API server. Requests spread over both and give
one engine's greedy answers, a conversation's next turn goes where its beginning is cached, /metrics labels each
engine, a stream closed early frees its engine's blocks, one
engine's death stops the server (exit 1) and nothing is left behind."""
from __future__ import annotations

import asyncio
import json
import re
import signal

import httpx
import openai
import pytest

from server_helpers import ServerProc, descendants_of, free_port, wait_gone, wait_idle
from tiny_models import make_model

PROMPTS = [f"The quick brown fox {i}" for i in range(8)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_dp")), "llama")


def _engine_samples(text: str, name: str) -> dict[str, float]:
    """engine label -> value of one family of /metrics, summed over its other labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            out[engine] = out.get(engine, 0.0) + float(line.rpartition(" ")[2])
    return out


def test_serve_dp2_spreads_requests_and_stops_without_orphans(tiny_path):
    from voltllm import LLM, SamplingParams

    want = [o.outputs[0].text for o in LLM(tiny_path, block_size=4).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=6))]
    srv = ServerProc([tiny_path, "--device", "cpu", "-dp", "2", "--block-size", "4", "--served-model-name", "tiny",
                      "--disable-log-stats"], free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        pids = descendants_of(srv.proc.pid)

        async def together() -> list[str]:
            c = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=120)
            outs = await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
                                          for p in PROMPTS))
            return [o.choices[0].text for o in outs]

        assert asyncio.run(together()) == want  # each request's answer whichever engine served it
        text = httpx.get(srv.base + "/metrics", timeout=10).text
        done = _engine_samples(text, "voltllm:request_success_total")
        assert set(done) == {"0", "1"} and sum(done.values()) == len(PROMPTS), done
        # the least busy engine takes each, so both get a share; how even depends on timing (under a loaded CI an
        # engine can hold its first request while the other serves the rest one by one: 7 / 1 was seen)
        assert min(done.values()) >= 1, done
        assert set(_engine_samples(text, "vllm:kv_cache_usage_perc")) == {"0", "1"}
        assert _engine_samples(text, "voltllm:engine_alive") == {"0": 1.0, "1": 1.0}
        steps = _engine_samples(text, "vllm:iteration_tokens_total_count")
        assert set(steps) == {"0", "1"} and min(steps.values()) >= 6, steps  # each engine's prompt and decode steps
        assert sum(_engine_samples(text, "vllm:request_params_n_count").values()) == len(PROMPTS)
        assert set(_engine_samples(text, "vllm:cache_config_info")) == {"0", "1"}
        report = httpx.get(srv.base + "/v1/acceleration", timeout=30).json()
        assert [e["engine"] for e in report["engines"]] == [0, 1] and report["ok"] is True

        # a conversation's next turn goes to the engine that served the last one: its prompt's beginning is cached
        # there (in turn, it would go to the other, idle engine and miss)
        turn = "System: be brief. User: " + "what is the weather like at sea today? " * 12
        hits = _engine_samples(httpx.get(srv.base + "/metrics", timeout=10).text, "voltllm:prefix_cache_hits_total")
        for prompt in (turn, turn + " Assistant: calm. User: and tomorrow?"):
            r = httpx.post(srv.base + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
        after = _engine_samples(httpx.get(srv.base + "/metrics", timeout=10).text, "voltllm:prefix_cache_hits_total")
        gained = sorted(after[e] - hits.get(e, 0.0) for e in after)
        assert gained[0] == 0 and gained[1] > 100, (hits, after)

        # a stream closed after its first chunk is aborted on its engine: every engine ends idle, no block held
        with httpx.stream("POST", srv.base + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 500, "stream": True,
                                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                    break
        wait_idle(srv)

        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log_text()[-3000:]
        assert not wait_gone(pids, 10), "orphan processes after SIGTERM"
    finally:
        srv.stop()


def test_one_engine_dying_stops_the_server(tiny_path):
    srv = ServerProc([tiny_path, "--device", "cpu", "-dp", "2", "--block-size", "4", "--disable-log-stats"],
                     free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        pids = descendants_of(srv.proc.pid)
        engines = [p for p in pids if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(engines) == 2, pids
        engines.sort()
        import os

        os.kill(engines[1], signal.SIGKILL)
        assert srv.proc.wait(30) == 1, srv.log_text()[-3000:]
        assert "data-parallel engine" in srv.log_text()
        assert not wait_gone(pids, 10), "orphan processes after an engine died"
    finally:
        srv.stop()


def test_runtime_lora_adapters_reach_every_engine(tiny_path, tmp_path):
    """/v1/load_lora_adapter under -dp 2: requests naming the adapter run with it on whichever engine takes them (the
    same greedy tokens on both), and after /v1/unload_lora_adapter its name is a 404 and both engines end idle."""
    from lora_adapters import make_adapter

    lora = make_adapter(str(tmp_path / "lora"), tiny_path, rank=8, alpha=16)
    srv = ServerProc([tiny_path, "--device", "cpu", "-dp", "2", "--block-size", "4", "--served-model-name", "tiny",
                      "--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating", "--disable-log-stats"],
                     free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        r = httpx.post(srv.base + "/v1/load_lora_adapter", json={"lora_name": "ad", "lora_path": lora}, timeout=60)
        assert r.status_code == 200, r.text

        async def together(model: str) -> list[str]:
            c = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=120)
            outs = await asyncio.gather(*(c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6,
                                                               temperature=0) for _ in range(4)))
            return [o.choices[0].text for o in outs]

        with_adapter = asyncio.run(together("ad"))
        assert len(set(with_adapter)) == 1  # both engines ran it with the adapter's weights
        assert with_adapter[0] != asyncio.run(together("tiny"))[0]
        done = _engine_samples(httpx.get(srv.base + "/metrics", timeout=10).text, "voltllm:request_success_total")
        assert min(done.values()) >= 2, done  # (both engines served some)
        r = httpx.post(srv.base + "/v1/unload_lora_adapter", json={"lora_name": "ad"}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(srv.base + "/v1/completions", json={"model": "ad", "prompt": "x", "max_tokens": 1}, timeout=60)
        assert r.status_code == 404, r.text
        wait_idle(srv)
    finally:
        srv.stop()
