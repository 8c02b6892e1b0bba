"""The engine-core process: a busy loop around EngineCore, fed and drained over two ZMQ sockets.

Wire protocol (pickled tuples; both ends are this package on the same host, over ipc:// sockets that
the API process creates in a private 0700 directory, and removes as soon as the engine says both are connected:
a connected ipc socket no longer needs its file, and a killed API process then leaves nothing behind in /tmp):

  API -> engine (PUSH -> PULL)                 engine -> API (PUSH -> PULL)
  ("add", [EngineCoreRequest, ...])            ("connected",)  both sockets connected: the directory may go
                                               ("ready", {"num_blocks": ..., ...})
  ("abort", [child request id, ...])           ("startup_error", message)
  ("check",)   run check_integrity()           ("outputs", [EngineCoreOutput, ...], SchedulerStats)
  ("report",)  acceleration report             ("error", [child request id, ...], message)
  ("remove_lora", lora_int_id)                 ("check", message or None)
  ("sleep", level)                             ("report", report dict or {"error": message})
  ("wake_up", tags or None)                    ("sleep_mode", None or (error kind, message), is_sleeping)
  ("profile", "start" | "stop")                ("profile", None or message, files written)
  ("shutdown",)                                ("fatal", message)
remove_lora: an unloaded LoRA adapter, dropped once the requests running with it end (EngineCore.remove_lora).
sleep / wake_up (--enable-sleep-mode): each answered with one "sleep_mode" message, after the "outputs" of the
requests sleep aborted (EngineCore.sleep); error kind "ValueError" is a bad argument, "RuntimeError" a failure (e.g.
too little GPU memory to wake up).

The loop blocks on its input socket only while it has nothing to compute (or nothing but requests whose grammar is
compiling in the background: then it also wakes when a compile ends); otherwise it drains input without waiting and
steps. A request that fails after it was added (its grammar did not compile) is reported with "error", like one
add_request refused. It exits on "shutdown", on SIGTERM, and when its parent (the API process)
is gone: the kernel's parent-death signal on Linux, and a parent-pid check on every loop as a fallback.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback
from typing import Any

logger = logging.getLogger("voltllm")

IDLE_POLL_MS = 200  # how often an idle engine looks at its parent
CONNECT_TIMEOUT_MS = 60_000  # the API process bound both sockets before it spawned us: this is only a safety net


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def run_engine_core(config: Any, input_addr: str, output_addr: str, parent_pid: int, log_level: int) -> None:
    """Entry point of the engine process (multiprocessing spawn target)."""
    # Ctrl-C in a terminal reaches the whole process group: the API process coordinates shutdown,
    # so the engine ignores SIGINT and keeps serving until told to stop. SIGTERM keeps its default
    # action (exit at once): the engine holds nothing that needs flushing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return
    dp, tp = config.parallel.data_parallel_size, config.parallel.world_size
    if dp > 1 and config.device.device.type == "cpu":  # data-parallel engines on the CPU share its cores
        import torch

        torch.set_num_threads(min(torch.get_num_threads(), max(1, (os.cpu_count() or 1) // (dp * tp))))
    # data-parallel engines name themselves in their lines (the process name AsyncLLM gave: voltllm-engine-K)
    who = "%(name)s (%(processName)s)" if config.parallel.data_parallel_size > 1 else "%(name)s"
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s {who}: %(message)s", datefmt="%H:%M:%S")

    import zmq

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.LINGER, 0)
    connected = _connect_confirmed(inp, input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(output_addr)
    core = None
    try:
        if not connected:
            out.send(_dumps(("startup_error", f"could not connect to the API process's input socket {input_addr}")))
            return
        out.send(_dumps(("connected",)))  # (this message itself proves the output socket's connection)
        try:
            from voltllm import acceleration
            from voltllm.engine.core import EngineCore

            acceleration.install_global_hooks()  # before the engine: start-up compiles show in the report
            core = EngineCore(config)
            acceleration.instrument(core.runner)
            if getattr(config.device, "require_acceleration", False):  # the loaded engine, not the prediction
                acceleration.require_acceleration(config, core.runner)
        except Exception as e:  # noqa: BLE001 - reported to the API process, which prints it
            logger.debug("engine startup failed", exc_info=True)
            out.send(_dumps(("startup_error", f"{type(e).__name__}: {e}")))
            return
        stats = core.stats()
        out.send(_dumps(("ready", {"num_blocks": stats.num_blocks, "block_size": config.cache.block_size,
                                   "max_model_len": core.max_model_len, "pid": os.getpid()})))
        _loop(core, inp, out, parent_pid)
    except Exception:  # noqa: BLE001
        msg = traceback.format_exc()
        logger.error("engine core failed:\n%s", msg)
        try:
            out.send(_dumps(("fatal", msg)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    finally:
        if core is not None:
            core.shutdown()  # tensor-parallel workers (they would also go with this process: parent-death signal)
        inp.close(0)
        out.close(1000)
        ctx.term()
        logging.shutdown()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown (seconds with torch loaded): nothing here needs it


def _connect_confirmed(sock: Any, addr: str) -> bool:
    """Connect `sock` to `addr` and wait until the ZMTP handshake with the bound peer succeeded (zmq connects in the
    background), so that the API process may remove the socket's file afterwards."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # before connect: the event cannot be missed
    try:
        sock.connect(addr)
        return bool(monitor.poll(CONNECT_TIMEOUT_MS)) and bool(
            recv_monitor_message(monitor)["event"] & zmq.EVENT_HANDSHAKE_SUCCEEDED)
    finally:
        sock.disable_monitor()
        monitor.close(0)


def _loop(core: Any, inp: Any, out: Any, parent_pid: int) -> None:
    import zmq

    from voltllm.engine.core import InvalidRequestError

    # structured outputs: while only requests waiting for their grammar remain, wait for input or for the compile
    # thread's wake-up here, not inside step()
    core.grammar_wait_s = 0
    idle = zmq.Poller()
    idle.register(inp, zmq.POLLIN)
    wake_fd = core.grammars.wake_fd
    idle.register(wake_fd, zmq.POLLIN)
    while True:
        busy = core.has_unfinished_requests() and not core.waiting_only_for_grammars()
        flush = False
        if busy:
            has_input = inp.poll(0)
        else:
            events = dict(idle.poll(IDLE_POLL_MS))
            if wake_fd in events:
                core.grammars.drain_wake()  # (step() takes the compile's result)
            has_input = inp in events
        if has_input:
            while True:
                try:
                    raw = inp.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = pickle.loads(raw)
                kind = msg[0]
                if kind == "add":
                    reqs = msg[1]
                    added = []
                    if core.is_sleeping():  # (sent while a sleep was on its way: the server answers 503, not 400)
                        out.send(_dumps(("error", [r.request_id for r in reqs], "the engine is sleeping "
                                         "(--enable-sleep-mode): POST /wake_up wakes it", "sleeping")))
                        continue
                    try:
                        for req in reqs:
                            core.add_request(req)
                            added.append(req.request_id)
                    except (InvalidRequestError, ValueError) as e:
                        if added:
                            core.abort_requests(added)
                            flush = True
                        out.send(_dumps(("error", [r.request_id for r in reqs], str(e))))
                elif kind == "abort":
                    core.abort_requests(msg[1])
                    flush = True
                elif kind == "check":
                    try:
                        core.check_integrity()
                        out.send(_dumps(("check", None)))
                    except Exception as e:  # noqa: BLE001
                        out.send(_dumps(("check", f"{type(e).__name__}: {e}")))
                elif kind == "report":
                    try:
                        from voltllm.acceleration import build_report

                        out.send(_dumps(("report", build_report(core.config, core.runner))))
                    except Exception as e:  # noqa: BLE001
                        out.send(_dumps(("report", {"error": f"{type(e).__name__}: {e}"})))
                elif kind == "remove_lora":
                    core.remove_lora(msg[1])
                elif kind in ("sleep", "wake_up"):
                    _sleep_mode_call(core, out, kind, msg[1])
                elif kind == "profile":
                    _profile_call(core, out, msg[1])
                elif kind == "shutdown":
                    return
                else:
                    logger.warning("engine: unknown message %r", kind)
        if os.getppid() != parent_pid:
            logger.warning("engine: the API process is gone; exiting")
            return
        if core.has_unfinished_requests() or flush:
            outputs = core.step()
            for rid, message in core.take_request_errors():
                out.send(_dumps(("error", [rid], message)))
            if outputs or flush or not core.waiting_only_for_grammars():
                out.send(_dumps(("outputs", outputs, core.stats())))


def _profile_call(core: Any, out: Any, what: str) -> None:
    """start_profile / stop_profile (--profiler-config): answered with the error (profiling.ProfilerError: off, or out
    of turn) or None, and the files stop wrote."""
    from voltllm.profiling import ProfilerError

    try:
        files = core.start_profile() if what == "start" else core.stop_profile()
        out.send(_dumps(("profile", None, files or [])))
    except (ProfilerError, OSError, RuntimeError) as e:
        out.send(_dumps(("profile", str(e), [])))


def _sleep_mode_call(core: Any, out: Any, kind: str, arg: Any) -> None:
    """sleep(level) / wake_up(tags): the aborted requests' outputs first, then the answer."""
    error = None
    try:
        if kind == "sleep":
            outputs = core.sleep(arg)
            if outputs:
                out.send(_dumps(("outputs", outputs, core.stats())))
        else:
            core.wake_up(arg)
    except (ValueError, RuntimeError) as e:  # (a wake-up's failure leaves its part asleep: it can be retried)
        logger.warning("%s failed: %s", kind, e)
        error = ("ValueError" if isinstance(e, ValueError) else "RuntimeError", str(e))
    out.send(_dumps(("sleep_mode", error, core.is_sleeping())))
