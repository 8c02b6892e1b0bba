"""The request field `priority` (vLLM's) over HTTP: under --scheduling-policy fcfs (the tiny server) anything but 0 is a
400 naming it, as vLLM answers; a server started with --scheduling-policy priority takes it on completions, chat
completions and Responses, and serves a waiting request with a higher priority (lower value) first."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from server_helpers import ServerProc, free_port, metrics
from tiny_models import make_model

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
ROUTES = [("/v1/completions", {"prompt": "The capital of France", "max_tokens": 2}),
          ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
          ("/v1/responses", {"input": "What is the capital of France?", "max_output_tokens": 2}),
          # a beam search's steps are requests at its priority (the same check)
          ("/v1/completions", {"prompt": "The capital of France", "max_tokens": 2, "use_beam_search": True, "n": 2})]


def _post(server, path, body, timeout=120):
    return httpx.post(server.base + path, json={"model": "tiny", "temperature": 0, **body}, timeout=timeout)


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory):
    """One sequence at a time, so the waiting queue's order is what the clients see; a long context, so that a
    long request holds the sequence for seconds."""
    path = make_model(str(tmp_path_factory.mktemp("tiny_priority")), "llama", max_position_embeddings=8192)
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny",
                      "--scheduling-policy", "priority", "--max-num-seqs", "1", "--disable-uvicorn-access-log"],
                     free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("path,body", ROUTES)
def test_fcfs_refuses_a_priority(tiny_server, path, body):
    r = _post(tiny_server, path, {**body, "priority": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and err["message"].startswith("Got priority 3 but Priority scheduling is not "
                                                                    "enabled")
    assert _post(tiny_server, path, {**body, "priority": 0}).status_code == 200


@pytest.mark.parametrize("path,body", ROUTES)
def test_priority_server_takes_it(priority_server, path, body):
    for value in (-5, 0, 7, None):
        r = _post(priority_server, path, {**body, "priority": value})
        assert r.status_code == 200, r.text
    r = _post(priority_server, path, {**body, "priority": "high"})
    assert r.status_code == 400 and "priority" in r.text


def test_a_waiting_request_with_a_higher_priority_goes_first(priority_server):
    """A long request holds the one sequence; a priority-5 and then a priority-(-1) request wait behind it; once it
    is aborted, the later one (-1) runs first."""
    finished: dict[str, float] = {}

    def send(name, priority):
        # (64 tokens: with one sequence, the second finishes 64 steps after the first, a gap no client thread's
        # jitter on a loaded host can reverse)
        r = _post(priority_server, "/v1/completions",
                  {"prompt": "Hello", "max_tokens": 64, "ignore_eos": True, "priority": priority})
        assert r.status_code == 200, r.text
        finished[name] = time.monotonic()

    with httpx.stream("POST", priority_server.base + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": "Hi", "max_tokens": 8000, "ignore_eos": True, "stream": True,
                            "priority": 0}) as long:
        lines = long.iter_lines()  # (kept: a dropped generator would close the response)
        next(lines)  # running
        threads = [threading.Thread(target=send, args=("low", 5))]
        threads[0].start()
        _wait_waiting(priority_server, 1)
        threads.append(threading.Thread(target=send, args=("high", -1)))
        threads[1].start()
        _wait_waiting(priority_server, 2)
    # leaving the stream disconnects it: the long request is aborted and its sequence freed
    for t in threads:
        t.join(60)
    assert finished.keys() == {"low", "high"} and finished["high"] < finished["low"]


def _wait_waiting(server, n, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics(server).get("voltllm:num_requests_waiting") == n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests never waited: {metrics(server)}")
