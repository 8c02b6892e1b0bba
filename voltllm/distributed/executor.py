"""Rank 0's side of tensor parallelism: starts ranks 1..N-1 (worker.py), joins the group with them, sends each
step, and turns a worker's failure into one readable error in the engine.

Workers start from a forkserver (`_worker_context`): a clean process that this one starts once, which imports torch,
the runner and transformers' config classes and never touches a GPU; each worker is a fork of it. A spawned worker
spent ~2 s importing those for every engine (tests build hundreds of tensor-parallel engines); the forkserver pays that
once per process. Like spawn, nothing of this process's state reaches a worker but its pickled arguments and the
environment the forkserver started with.

Failure handling: a worker that raises reports ("error", ...) on its pipe and exits. On the CPU (gloo) rank 0's
next collective then fails at once (the peer's connection closes); on CUDA a watchdog thread sees the worker exit
and aborts the group, so NCCL does not wait out its timeout. Either way EngineCore asks `failure()` for the
worker's own message. Workers are stopped by shutdown(), by a finalizer when the engine is dropped, and by the
parent-death signal when this process dies.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import time
import weakref
from typing import Any, Optional

from voltllm.distributed.group import TPGroup, make_store, rank_device
from voltllm.distributed.step import StepInputs

logger = logging.getLogger("voltllm")

START_TIMEOUT_S = 300.0  # a worker's start (the forkserver's imports included; not its model load) must end within this
STOP_TIMEOUT_S = 5.0  # a worker's clean exit after "shutdown" before it is terminated


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed; the message is its own error."""


class TPWorkers:
    def __init__(self, config: Any):
        self.size = config.parallel.world_size
        self.error: Optional[TPWorkerError] = None
        self._stopping = threading.Event()
        self._broken = threading.Event()  # set by the CUDA watchdog when a worker exited
        store = make_store(0, self.size, 0)
        ctx = _worker_context()
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        log_level = logging.getLogger("voltllm").getEffectiveLevel()
        from voltllm.distributed.worker import run_worker

        # registered first: it stops whatever started, should a later start fail (the lists fill in place)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._stopping)
        # daemonic: multiprocessing ends them at interpreter exit even if shutdown() never ran
        with _children_allowed():
            for rank in range(1, self.size):
                ours, theirs = ctx.Pipe(duplex=True)
                p = ctx.Process(target=run_worker, name=f"voltllm-tp{rank}", daemon=True,
                                args=(config, rank, store.port, theirs, os.getpid(), log_level))
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(ours)
        try:
            self._wait_for("hello", START_TIMEOUT_S)  # before the group: a worker that dies early is not waited on
            self.group = TPGroup(0, self.size, store, rank_device(config.device.device, 0))
        except BaseException:
            self.shutdown()
            raise
        if config.device.device.type == "cuda":
            threading.Thread(target=_watch, args=(self.procs, self._stopping, self._broken, self.group),
                             name="voltllm-tp-watchdog", daemon=True).start()
        logger.info("tensor parallelism: %d ranks (workers: pids %s)", self.size, [p.pid for p in self.procs])

    # -- start-up -------------------------------------------------------------------------------
    def _wait_for(self, kind: str, timeout: Optional[float], at_start: bool = True) -> list[Any]:
        """Each worker's next message, which must be `kind`; raises the worker's error (or its death) otherwise."""
        out = []
        deadline = None if timeout is None else time.monotonic() + timeout
        exited = _exited_at_start if at_start else _exited
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if not p.is_alive() and not conn.poll(0):
                    raise self._fail(exited(rank, p.exitcode))
                if deadline is not None and time.monotonic() > deadline:
                    raise self._fail(TPWorkerError(f"tensor-parallel worker {rank} did not start within "
                                                   f"{timeout:.0f} s"))
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                p.join(1.0)
                raise self._fail(exited(rank, p.exitcode)) from None
            if msg[0] != kind:
                raise self._fail(self._worker_error(rank, msg))
            out.append(msg[1:])
        return out

    def wait_ready(self, num_blocks: int) -> None:
        """After EngineCore's start-up: every worker finished its own, with the same KV block count."""
        counts = [m[0] for m in self._wait_for("ready", None)]
        if any(c != num_blocks for c in counts):
            raise self._fail(TPWorkerError(f"tensor-parallel ranks disagree on the KV block count: {num_blocks} "
                                           f"(rank 0) vs {counts}"))

    # -- steps ----------------------------------------------------------------------------------
    def send_step(self, step: StepInputs) -> None:
        self._send(("step", step))

    def send(self, msg: tuple) -> None:
        """One message to every worker (worker.py lists them)."""
        self._send(msg)

    def collect(self, kind: str) -> list[tuple]:
        """Each worker's answer to the last message sent, which must be `kind` (its fields after the kind); a worker's
        error or death raises TPWorkerError, which stays: every later call raises it."""
        if self.error is not None:
            raise self.error
        return self._wait_for(kind, None, at_start=False)

    def call_on_workers(self, fn: Any, *args: Any) -> list[Any]:
        """Tests and diagnostics: fn(runner, *args) on every worker (fn a module-level function: it is pickled by
        name), their results in rank order. Between steps only."""
        self.send(("call", fn, args))
        return [m[0] for m in self.collect("called")]

    def fail_worker(self, rank: int, text: str) -> None:
        """Tests: make worker `rank` raise RuntimeError(text) at its next message (the engine must report it)."""
        self.conns[rank - 1].send_bytes(pickle.dumps(("fail", text)))

    def _send(self, msg: tuple) -> None:
        if self.error is not None:
            raise self.error
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            raise self.failure() or TPWorkerError(f"a tensor-parallel worker is gone ({e})") from None

    # -- failures -------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the failure if the watchdog saw a worker exit: a step that completed after it aborted the group
        holds the aborted collectives' garbage, whose tokens must not reach a client."""
        if self._broken.is_set() or self.error is not None:
            raise self.failure() or TPWorkerError("a tensor-parallel worker exited")

    def _worker_error(self, rank: int, msg: tuple) -> TPWorkerError:
        if msg[0] == "error":
            if len(msg) > 2:
                logger.error("tensor-parallel worker %d failed:\n%s", rank, msg[2])
            return TPWorkerError(f"tensor-parallel worker {rank} failed: {msg[1]}")
        return TPWorkerError(f"tensor-parallel worker {rank}: unexpected message {msg[0]!r}")

    def _fail(self, err: TPWorkerError) -> TPWorkerError:
        if self.error is None:
            self.error = err
        return self.error

    def failure(self, wait_s: float = 1.0) -> Optional[TPWorkerError]:
        """The first worker's error if one failed (waiting up to wait_s for a failing worker's message or exit: a
        worker reports before it exits, and its exit is what fails rank 0's collectives, but a killed one may be
        reaped a moment later); None while all are well."""
        if self.error is not None:
            return self.error
        deadline = time.monotonic() + wait_s
        while True:
            for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
                try:
                    if conn.poll(0):
                        msg = conn.recv()
                        if msg[0] == "error":  # (another is an answer rank 0 no longer waits for: not a failure)
                            return self._fail(self._worker_error(rank, msg))
                        continue
                except (EOFError, OSError):
                    pass
                if not p.is_alive():
                    return self._fail(TPWorkerError(f"tensor-parallel worker {rank} exited (exit code {p.exitcode})"))
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def abandon(self, e: BaseException) -> None:
        """Rank 0 failed mid-step while the workers may still wait in that step's collectives: the group is out of
        step, so it is stopped and every later step raises instead of pairing collectives of different steps."""
        self._fail(TPWorkerError(f"tensor-parallel rank 0 failed mid-step ({type(e).__name__}: {e}); the workers "
                                 "were stopped"))
        self.shutdown()

    # -- shutdown -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._finalizer()
        group = getattr(self, "group", None)
        if group is not None and group.device.type == "cuda":  # release NCCL without waiting on the gone peers
            group.abort()


def _exited_at_start(rank: int, code: Optional[int]) -> TPWorkerError:
    return TPWorkerError(f"tensor-parallel worker {rank} exited during start-up (exit code {code}; its output says "
                         "why; a worker imports the main script again, so a script that builds the engine at import "
                         "time needs an `if __name__ == '__main__':` guard)")


def _exited(rank: int, code: Optional[int]) -> TPWorkerError:
    return TPWorkerError(f"tensor-parallel worker {rank} exited (exit code {code}; its output says why)")


# what the forkserver imports once, so that the workers it forks start with it loaded: torch, the runner and its
# kernels, and transformers' config classes (a worker unpickles the model's hf config: ~1.3 s of imports by itself)
WORKER_PRELOAD = ("voltllm.distributed.worker", "voltllm.worker.runner", "transformers.configuration_utils")


def _worker_context() -> Any:
    """The forkserver context the workers start from (module docstring). The forkserver exits when this process does
    (EOF on the pipe only this process holds), and the workers with it (their parent-death signal)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(WORKER_PRELOAD))
    return ctx


class _children_allowed:
    """multiprocessing refuses to start children from a daemonic process, and the API server's engine process is
    one. Our workers cannot be orphaned (parent-death signal, pipe EOF, the engine's shutdown), so the flag is
    lifted while they start."""

    def __enter__(self):
        self.proc = multiprocessing.current_process()
        self.was = self.proc._config.get("daemon", False)
        self.proc._config["daemon"] = False

    def __exit__(self, *exc):
        self.proc._config["daemon"] = self.was


def _watch(procs: list, stopping: threading.Event, broken: threading.Event, group: TPGroup) -> None:
    """CUDA: a worker that exits while the engine runs leaves rank 0's NCCL collectives waiting; abort the group so
    they fail and the engine reports the worker's error. (No reference to the TPWorkers: it must stay collectable.)"""
    sentinels = [p.sentinel for p in procs]
    while not stopping.is_set():
        if multiprocessing.connection.wait(sentinels, timeout=0.5) and not stopping.is_set():
            logger.error("a tensor-parallel worker exited; aborting the group")
            broken.set()
            group.abort()
            return


def _stop(procs: list, conns: list, stopping: threading.Event) -> None:
    """Ask every worker to exit, then terminate (and kill) those that do not (finalizer: no reference to self)."""
    stopping.set()
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("shutdown",)))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for conn in conns:
        conn.close()
