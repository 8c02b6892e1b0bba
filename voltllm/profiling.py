"""vLLM's engine profiling (`--profiler-config`, POST /start_profile and /stop_profile, LLM.start_profile /
stop_profile).

"torch": the engine process runs torch.profiler (CPU and, on a GPU, CUDA activities) between start and stop, then
writes a Chrome trace (`<dir>/voltllm-engine<i>[-rank<r>]-<pid>-<time>-<n>.pt.trace.json[.gz]`, n counting this
process's sessions; for Perfetto or chrome://tracing) and, with torch_profiler_dump_cuda_time_total, a table of the
operators' totals beside it (`...-totals.txt`, sorted by device time on a GPU, by CPU time on the CPU). "cuda": the
CUDA profiler's start / stop (cudaProfilerStart / Stop), for a capture range under Nsight Systems (`nsys profile
--capture-range=cudaProfilerApi`); nothing is written here.
Under tensor / pipeline parallelism every rank's process profiles itself (`...-engine<i>-rank<r>-...` files; rank 0
lists them all), started and stopped by rank 0 between the same two steps.

delay_iterations / max_iterations (vLLM's): the session begins that many engine steps after start (steps that ran a
forward), and ends itself after that many steps, writing its files then (a start may follow at once, as in vLLM; a
stop before it returns those files); without a limit stop writes them. ignore_frontend is accepted: the API server
process is never traced here.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, fields
from typing import Any, Optional

logger = logging.getLogger("voltllm")

# this process's sessions, in the file names: two within a second (two engines in one process too) keep apart
_SESSIONS = itertools.count(1)


class ProfilerError(ValueError):
    """A bad --profiler-config, or start / stop out of turn (HTTP 400 on the server)."""


@dataclass(frozen=True)
class ProfilerConfig:
    """vLLM's ProfilerConfig keys and defaults."""

    profiler: str = "torch"  # torch | cuda
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    ignore_frontend: bool = False
    delay_iterations: int = 0
    max_iterations: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Optional["ProfilerConfig"]:
        """The config of --profiler-config's JSON object; None when it names no profiler (vLLM's default: off)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ProfilerError(f"--profiler-config: unknown keys {unknown} (built: {sorted(known)})")
        if d.get("profiler") is None:
            if any(k.startswith("torch_") for k in d):
                raise ProfilerError("--profiler-config: torch_profiler_* keys need \"profiler\": \"torch\"")
            return None
        if d["profiler"] not in ("torch", "cuda"):
            raise ProfilerError(f"--profiler-config profiler {d['profiler']!r}: use \"torch\" or \"cuda\"")
        for name, value in d.items():
            if name.startswith("torch_profiler_with") or name in ("torch_profiler_use_gzip",
                                                                  "torch_profiler_dump_cuda_time_total",
                                                                  "torch_profiler_record_shapes", "ignore_frontend"):
                if not isinstance(value, bool):
                    raise ProfilerError(f"--profiler-config {name} must be true or false, got {value!r}")
            if name in ("delay_iterations", "max_iterations") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ProfilerError(f"--profiler-config {name} must be an integer >= 0, got {value!r}")
        cfg = cls(**d)
        if cfg.profiler == "torch":
            if not isinstance(cfg.torch_profiler_dir, str) or not cfg.torch_profiler_dir:
                raise ProfilerError("--profiler-config profiler \"torch\" needs torch_profiler_dir (where the traces "
                                    "go)")
            if not os.path.isabs(cfg.torch_profiler_dir):  # (vLLM's rule: the engine may run in another directory)
                raise ProfilerError(f"--profiler-config torch_profiler_dir must be an absolute path, got "
                                    f"{cfg.torch_profiler_dir!r}")
        return cfg


class EngineProfiler:
    """One process's profiler: start() and stop() alternate; stop() returns the files its session wrote. A session
    waits delay_iterations steps (step(), after each engine step that ran a forward) before it begins, and with
    max_iterations ends itself after that many steps."""

    def __init__(self, config: Optional[ProfilerConfig], engine_index: int = 0, rank: Optional[int] = None):
        """rank: this process's rank in a tensor / pipeline-parallel group (in the file names), None alone."""
        self.config = config
        self.engine_index = engine_index
        self.rank = rank
        self._session: Any = None  # the torch profile, or "cuda", while a session records
        self._armed = False  # between start() and stop()
        self._wait = 0  # steps still to skip before the session begins
        self._left = 0  # steps the session may still record (max_iterations; 0: no limit)
        self._written: list[str] = []  # a session that ended itself: its files, for stop()
        self._device: Any = None

    @property
    def running(self) -> bool:
        """Between start() and stop() or the session's end at max_iterations (also while waiting for its first
        step)."""
        return self._armed

    def start(self, device: Any = None) -> None:
        if self.config is None:
            raise ProfilerError("profiling is off: start with --profiler-config '{\"profiler\": \"torch\", "
                                "\"torch_profiler_dir\": \"/abs/dir\"}'")
        if self.running:
            raise ProfilerError("the profiler is already running: stop it first")
        self._device, self._written = device, []
        self._wait, self._left = self.config.delay_iterations, self.config.max_iterations
        if self._wait == 0:
            self._begin()
        else:
            logger.info("profiler starts after %d engine steps", self._wait)
        self._armed = True

    def step(self) -> None:
        """One engine step (with a forward) ran: the session begins or ends at its step counts."""
        if not self._armed:
            return
        if self._session is None:
            if self._wait > 0:
                self._wait -= 1
                if self._wait == 0:
                    self._begin()
            return
        if self._left > 0:
            self._left -= 1
            if self._left == 0:  # (over, as vLLM's: a start may follow at once; a stop returns these files)
                self._written = self._end()
                self._armed = False

    def stop(self) -> list[str]:
        if not self.running:
            if self._written:  # the session ended itself at max_iterations: its files
                written, self._written = self._written, []
                return written
            raise ProfilerError("the profiler is not running: start it first")
        self._armed = False
        if self._session is None:  # still waiting: nothing recorded
            return []
        return self._end()

    def collect(self) -> list[str]:
        """stop() where there is something to stop or return, else nothing (a worker told to stop by rank 0)."""
        return self.stop() if self.running or self._written else []

    def _begin(self) -> None:
        if self.config.profiler == "cuda":
            import torch

            torch.cuda.profiler.start()
            self._session = "cuda"
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self._device is not None and getattr(self._device, "type", None) == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        c = self.config
        os.makedirs(c.torch_profiler_dir, exist_ok=True)
        session = profile(activities=activities, record_shapes=c.torch_profiler_record_shapes,
                          profile_memory=c.torch_profiler_with_memory, with_stack=c.torch_profiler_with_stack,
                          with_flops=c.torch_profiler_with_flops)
        session.__enter__()
        self._session = session
        logger.info("profiler started (traces to %s)", c.torch_profiler_dir)

    def _end(self) -> list[str]:
        session, self._session = self._session, None
        if session == "cuda":
            import torch

            torch.cuda.profiler.stop()
            return []
        session.__exit__(None, None, None)
        c = self.config
        who = f"engine{self.engine_index}" + ("" if self.rank is None else f"-rank{self.rank}")
        stem = os.path.join(c.torch_profiler_dir, f"voltllm-{who}-{os.getpid()}-"
                                                  f"{time.strftime('%Y%m%d-%H%M%S')}-{next(_SESSIONS)}")
        trace = stem + ".pt.trace.json"
        session.export_chrome_trace(trace)
        written = [trace]
        if c.torch_profiler_use_gzip:
            import gzip
            import shutil

            with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(trace)
            written = [trace + ".gz"]
        if c.torch_profiler_dump_cuda_time_total:
            events = session.key_averages()
            on_device = any(getattr(e, "device_time_total", 0) for e in events)
            table = events.table(sort_by="self_device_time_total" if on_device else "self_cpu_time_total",
                                 row_limit=100)
            with open(stem + "-totals.txt", "w") as f:
                f.write(table)
            written.append(stem + "-totals.txt")
        logger.info("profiler stopped: wrote %s", ", ".join(written))
        return written
