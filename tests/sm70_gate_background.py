"""The sm_70 gate's report for the test suite, compiled in the background while the other tests run.

The gate cross-compiles every compat kernel spec for sm_70 and sm_75 (~480 compiles, ~1,300 CPU-s on a cold Triton
cache): on CI's two cores the largest part of the suite. Most other tests leave part of those cores idle (one torch
thread, servers waiting on sockets), so conftest starts the gate in a child process at niceness 19 (its compile
workers inherit it: they get only CPU time no test wants) as soon as the gate's tests are collected, and moves the
tests that read the report to the end of the run; they wait for it there. The report is the same as a foreground
`run_gate((70, 75))`. Run as a script, this module is that child: `python sm70_gate_background.py REPORT.pickle`.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

ARCHS = (70, 75)
NICE = 19
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_child: Optional[subprocess.Popen] = None
_files: dict[str, str] = {}


def start() -> None:
    """Start the background gate (once per process)."""
    global _child
    if _child is not None:
        return
    folder = tempfile.mkdtemp(prefix="voltllm-sm70-gate-")
    _files.update(report=os.path.join(folder, "report.pickle"), log=os.path.join(folder, "stderr.txt"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the gate compiles for real targets
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
    with open(_files["log"], "w") as log:
        # its own session: stop() ends the compile workers with it
        _child = subprocess.Popen([sys.executable, os.path.abspath(__file__), _files["report"]], env=env,
                                  stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)


def report() -> Any:
    """The gate's GateReport: waits for the background run (starting it when nothing did)."""
    start()
    assert _child is not None
    rc = _child.wait()
    if rc != 0 or not os.path.exists(_files["report"]):
        with open(_files["log"]) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"the background sm_70 gate exited with {rc}:\n{tail}")
    with open(_files["report"], "rb") as f:
        return pickle.load(f)


def stop() -> None:
    """End a background gate still running (a run stopped early, or one whose gate tests were deselected)."""
    if _child is not None and _child.poll() is None:
        try:
            os.killpg(_child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _child.wait()


def _end_with_parent() -> None:
    """A test run killed outright (no session finish) must not leave the gate compiling: when this child's parent
    is gone, end its process group (this child and its compile workers)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _main(path: str) -> int:
    _end_with_parent()
    os.nice(NICE)
    from voltllm.check.sm70_gate import run_gate

    result = run_gate(ARCHS)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, path)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
