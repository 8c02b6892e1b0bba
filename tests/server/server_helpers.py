"""Helpers for the server tests: a `voltllm serve` subprocess, process-tree checks, /metrics parsing."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx

API_KEY = "test-key-123"
MODEL_NAMES = ("smol", "smol-alias")
EMBED_NAME, EMBED_MAX_LEN = "tiny-embed", 64  # the shared embedding server (conftest.py `embed_server`)
_SCRIPT = os.path.join(os.path.dirname(sys.executable), "voltllm")
VOLTLLM = [_SCRIPT] if os.path.isfile(_SCRIPT) else [sys.executable, "-m", "voltllm.cli"]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Direct children of pid, from /proc (Linux)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


def descendants_of(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for k in children_of(todo.pop()):
            out.append(k)
            todo.append(k)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


class ServerProc:
    """A `voltllm serve` subprocess in its own process group, with its log in a temp file."""

    def __init__(self, args: list[str], port: int, https: bool = False, env: Optional[dict[str, str]] = None):
        self.port = port
        self.base = f"{'https' if https else 'http'}://127.0.0.1:{port}"
        self.verify = not https  # the HTTPS tests use a self-signed certificate
        self.log = tempfile.NamedTemporaryFile(prefix="voltllm-serve-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(VOLTLLM + ["serve"] + args + ["--host", "127.0.0.1", "--port", str(port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                     cwd=REPO_ROOT)
        self.descendants: list[int] = []

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"voltllm serve exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2, verify=self.verify).status_code == 200:
                    self.descendants = descendants_of(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"voltllm serve not healthy after {timeout:.0f} s:\n{self.log_text()[-4000:]}")

    def stop(self) -> None:
        """kill_group, then remove the log file (tests read it before they stop the server)."""
        self.kill_group()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except FileNotFoundError:
            pass

    def kill_group(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        for pid in self.descendants:  # anything that left the group
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def metrics(server: ServerProc) -> dict[str, float]:
    """Unlabelled view of /metrics: metric name -> value (summed over label sets)."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def wait_idle(server: ServerProc, timeout: float = 30.0) -> Optional[dict]:
    """Wait until no request runs, waits or holds KV blocks; returns the last metrics seen."""
    deadline = time.monotonic() + timeout
    m = None
    while time.monotonic() < deadline:
        m = metrics(server)
        if (m["voltllm:num_requests_running"] == 0 and m["voltllm:num_requests_waiting"] == 0
                and m["voltllm:kv_cache_usage_perc"] == 0 and m["voltllm:num_requests_active"] == 0):
            return m
        time.sleep(0.2)
    raise AssertionError(f"server not idle after {timeout} s: {m}")
