"""Shutdown: SIGTERM stops `voltllm serve` promptly with no orphan process; if the API process is killed
outright, its engine process exits by itself, and the sockets' directory is gone (removed once connected).
Each test starts its own server (a tiny random llama: quick to start), so the file needs no place in the run
order and leaves the shared server alone."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from server_helpers import ServerProc, descendants_of, free_port, wait_gone
from tiny_models import make_model


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("tiny")), "llama")


def test_sigterm_exits_cleanly_without_orphans(tiny_model_path):
    srv = ServerProc([tiny_model_path, "--device", "cpu", "--disable-log-stats"], free_port(),
                     env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        pids = descendants_of(srv.proc.pid)
        assert pids, "the engine process should be a child of the API process"
        t = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(30)
        took = time.monotonic() - t
        assert rc == 0, srv.log_text()[-3000:]
        assert took < 10, f"SIGTERM took {took:.1f} s"
        assert not wait_gone(pids, 5), "orphan processes after SIGTERM"
        assert "stopped" in srv.log_text()
    finally:
        srv.stop()


def test_engine_exits_when_api_process_is_killed(tiny_model_path, tmp_path):
    srv = ServerProc([tiny_model_path, "--device", "cpu", "--disable-log-stats"], free_port(),
                     env={"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    try:
        srv.wait_healthy(300)
        # the engine's sockets are connected: their directory is gone already, so a kill leaves nothing in /tmp
        assert not list(tmp_path.glob("voltllm-ipc-*")), sorted(p.name for p in tmp_path.iterdir())
        assert httpx.get(srv.base + "/v1/models", timeout=10).status_code == 200  # no --api-key here
        engine = [p for p in srv.descendants if "resource_tracker" not in _cmdline(p)]
        assert engine
        os.kill(srv.proc.pid, signal.SIGKILL)  # no chance to clean up
        srv.proc.wait(10)
        assert not wait_gone(srv.descendants, 10), "the engine outlived a killed API process"
    finally:
        srv.stop()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
