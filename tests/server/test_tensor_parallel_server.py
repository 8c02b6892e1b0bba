"""`voltllm serve -tp 2` on the CPU: the engine process (daemonic) starts its worker, serves tp=1's greedy answer,
and SIGTERM leaves no process behind (API, engine and worker)."""
from __future__ import annotations

import signal

import httpx

from server_helpers import ServerProc, descendants_of, free_port, wait_gone
from tiny_models import make_model


def test_serve_tp2_answers_and_stops_without_orphans(tmp_path):
    from voltllm import LLM, SamplingParams

    path = make_model(str(tmp_path / "m"), "llama")
    prompt = "The quick brown fox"
    expected = LLM(path, block_size=4).generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    srv = ServerProc([path, "--device", "cpu", "-tp", "2", "--block-size", "4", "--disable-log-stats"], free_port())
    try:
        srv.wait_healthy(180)
        r = httpx.post(srv.base + "/v1/completions", timeout=60,
                       json={"model": path, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected.outputs[0].text
        pids = descendants_of(srv.proc.pid)
        assert len(pids) >= 2, pids  # the engine process and its tensor-parallel worker
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log_text()[-3000:]
        assert not wait_gone(pids, 10), "orphan processes after SIGTERM"
    finally:
        srv.stop()
