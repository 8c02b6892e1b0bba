"""A tensor- or pipeline-parallel worker process (rank 1..N-1): builds its model shard or stage and replays the steps
rank 0 sends.

It mirrors EngineCore's start-up (runner, KV cache, GEMM tuning, CUDA graphs) so that the collectives inside those line
up with rank 0's, then loops: each ("step", StepInputs) is one forward (ModelRunner.execute_follower). Pipe messages
from rank 0 (pickled tuples): ("step", StepInputs), ("draft", MTPProposal or DFlashBlock) (a split MTP module's chained
passes or DFlash drafter's block, sent before the step whose drafts they make), ("sleep_mode", method, args)
(--enable-sleep-mode: this rank's RunnerSleep does what rank 0's does, distributed/sleep.py), ("profile", "start" |
"stop") (--profiler-config: this rank's own profiler), ("call", fn, args) (tests: fn(runner, *args)), ("fail", text)
(tests: raise here), ("shutdown",). To rank 0: ("hello",) before joining the process group, ("ready", num_blocks),
("sleep_mode", None or the message of a wake-up that failed here and can be retried), ("profile", None or an error's
message, files written), ("called", result), ("error", text) before exiting.

It never outlives the engine: Linux's parent-death signal (SIGTERM when its parent, the engine's forkserver, exits,
which it does when the engine does), and EOF on its pipe.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import traceback
from typing import Any

logger = logging.getLogger("voltllm")


def _leave_the_forkserver_to_the_engine() -> None:
    """CPython gives every child of a forkserver a copy of the pipe that keeps the forkserver running, so it would
    live as long as any worker does, and the workers (their parent-death signal waits for it to exit) as long as it
    does. Closing ours leaves the engine as the only holder: when the engine exits, the forkserver does, and we get
    SIGTERM."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, as another user's process
        pass
    return True


def run_worker(config: Any, rank: int, port: int, conn: Any, parent_pid: int, log_level: int) -> None:
    """Entry point of rank `rank` (the target of a process forked by the executor's forkserver)."""
    from voltllm.engine.engine_proc import _die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops us
    forkserver_pid = os.getppid()
    _leave_the_forkserver_to_the_engine()
    _die_with_parent()
    # the engine died before prctl took effect: its forkserver, which exits with it, is gone (we were reparented: to
    # init, or a subreaper), or the engine itself is (a zombie still passes _alive; then the pipe's EOF stops us)
    if os.getppid() != forkserver_pid or forkserver_pid == 1 or not _alive(parent_pid):
        os._exit(0)
    pp = config.parallel.pipeline_parallel_size
    who = f"tp{rank}" if pp == 1 else f"pp{rank // config.parallel.tensor_parallel_size}" + (
        f"-tp{rank % config.parallel.tensor_parallel_size}" if config.parallel.tensor_parallel_size > 1 else "")
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s {who}: %(message)s",
                        datefmt="%H:%M:%S")
    code = 0
    try:
        runner = _start(config, rank, port, conn)
        conn.send(("ready", runner.num_blocks))
        sleep_state = None
        if config.enable_sleep_mode:
            from voltllm.worker.sleep_mode import RunnerSleep

            sleep_state = RunnerSleep(runner)
        from voltllm.profiling import EngineProfiler

        profiler = EngineProfiler(config.profiler, config.parallel.data_parallel_rank, rank)
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "step":
                runner.execute_follower(msg[1])
                profiler.step()
            elif msg[0] == "draft":  # a split drafter's proposal (MTP, DFlash), before the step it drafts for
                runner.draft.follow_propose(msg[1])
            elif msg[0] == "sleep_mode":
                conn.send(("sleep_mode", _sleep_mode_call(sleep_state, msg[1], msg[2])))
            elif msg[0] == "profile":
                conn.send(("profile", *_profile_call(profiler, msg[1], runner.device)))
            elif msg[0] == "call":
                conn.send(("called", msg[1](runner, *msg[2])))
            elif msg[0] == "shutdown":
                break
            elif msg[0] == "fail":
                raise RuntimeError(msg[1])
    except EOFError:  # rank 0 is gone
        pass
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it in the engine
        code = 1
        logger.debug("tensor-parallel worker %d failed", rank, exc_info=True)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        except (OSError, ValueError):
            pass
    finally:
        logging.shutdown()
        os._exit(code)  # skip interpreter teardown (seconds with torch loaded): nothing here needs it


def _profile_call(profiler: Any, what: str, device: Any) -> tuple:
    """Rank 0's start_profile / stop_profile here: (None or the error's message, the files written). A stop with
    nothing running (after a start that failed on another rank) writes nothing."""
    try:
        if what == "start":
            profiler.start(device)
            return None, []
        return None, profiler.collect()
    except (ValueError, OSError, RuntimeError) as e:  # (ProfilerError is a ValueError)
        return f"{type(e).__name__}: {e}", []


def _sleep_mode_call(state: Any, method: str, args: tuple):
    """One phase of sleep / wake-up on this rank. A wake-up that failed here (out of memory) leaves its tag asleep
    and is answered with its message: rank 0 undoes it on the other ranks and raises it, and a later wake_up
    retries. Any other failure ends the worker (rank 0 raises it as this worker's error)."""
    from voltllm.distributed.sleep import WORKER_PHASES

    if state is None or method not in WORKER_PHASES:
        raise RuntimeError(f"unexpected sleep-mode call {method!r} (sleep mode {'on' if state else 'off'})")
    try:
        getattr(state, method)(*args)
    except RuntimeError as e:
        if method != "wake_tag":
            raise
        return str(e)
    return None


def _start(config: Any, rank: int, port: int, conn: Any):
    """Join the group, then EngineCore's start-up steps that hold collectives, in its order."""
    import torch

    from voltllm.distributed.group import TPGroup, make_store, rank_device
    from voltllm.worker.runner import ModelRunner

    size = config.parallel.world_size
    device = rank_device(config.device.device, rank)
    if device.type == "cpu":  # ranks (and data-parallel engines) share the CPU's cores (rank 0 keeps its setting)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (size * config.parallel.data_parallel_size)))
    config = dataclasses.replace(config, device=dataclasses.replace(config.device, device=device))
    conn.send(("hello",))
    tp = TPGroup(rank, size, make_store(rank, size, port), device)
    torch.manual_seed(config.parallel.global_seed(config.model.seed))  # (rank 0's: the ranks sample alike)
    runner = ModelRunner(config, tp=tp)
    runner.initialize_kv_cache()
    runner.tune_decode_gemms()
    runner.warm_up_mixed_step()
    runner.capture_cuda_graphs()
    return runner
