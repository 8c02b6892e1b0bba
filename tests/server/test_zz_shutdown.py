"""Shutdown: SIGTERM stops `voltllm serve` promptly with no orphan process; if the API process is killed
outright, its engine process exits by itself. Runs last (file name): it stops the shared server."""
from __future__ import annotations

import os
import signal
import time

import httpx

from server_helpers import ServerProc, descendants_of, free_port, wait_gone


def test_sigterm_exits_cleanly_without_orphans(server):
    pids = descendants_of(server.proc.pid)
    assert pids, "the engine process should be a child of the API process"
    t = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(30)
    took = time.monotonic() - t
    assert rc == 0, server.log_text()[-3000:]
    assert took < 10, f"SIGTERM took {took:.1f} s"
    assert not wait_gone(pids, 5), "orphan processes after SIGTERM"
    assert "stopped" in server.log_text()


def test_engine_exits_when_api_process_is_killed(model_path):
    srv = ServerProc([model_path, "--device", "cpu", "--max-model-len", "512", "--num-gpu-blocks-override", "64",
                      "--disable-log-stats"], free_port())
    try:
        srv.wait_healthy(300)
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
