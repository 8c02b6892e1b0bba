"""vLLM's engine profiling (`--profiler-config`, POST /start_profile and /stop_profile, LLM.start_profile /
stop_profile).

"torch": the engine process runs torch.profiler (CPU and, on a GPU, CUDA activities) between start and stop, then
writes a Chrome trace (`<dir>/voltllm-engine<i>-<pid>-<time>-<n>.pt.trace.json[.gz]`, n counting this process's
sessions; for Perfetto or chrome://tracing) and, with torch_profiler_dump_cuda_time_total, a table of the operators'
totals beside it (`...-totals.txt`, sorted by device time on a GPU, by CPU time on the CPU). "cuda": the CUDA
profiler's start / stop (cudaProfilerStart / Stop), for a capture range under Nsight Systems (`nsys profile
--capture-range=cudaProfilerApi`); nothing is written here.
Under tensor parallelism the engine process is rank 0: the other ranks' processes are not traced.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, fields
from typing import Any, Optional

logger = logging.getLogger("voltllm")


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
                                                                  "torch_profiler_record_shapes"):
                if not isinstance(value, bool):
                    raise ProfilerError(f"--profiler-config {name} must be true or false, got {value!r}")
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
    """One engine's profiler: start() and stop() alternate; stop() returns the files it wrote."""

    def __init__(self, config: Optional[ProfilerConfig], engine_index: int = 0):
        self.config = config
        self.engine_index = engine_index
        self._session: Any = None
        self._sessions = 0  # (in the file names: two sessions within a second do not overwrite each other)

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self, device: Any = None) -> None:
        if self.config is None:
            raise ProfilerError("profiling is off: start with --profiler-config '{\"profiler\": \"torch\", "
                                "\"torch_profiler_dir\": \"/abs/dir\"}'")
        if self.running:
            raise ProfilerError("the profiler is already running: stop it first")
        if self.config.profiler == "cuda":
            import torch

            torch.cuda.profiler.start()
            self._session = "cuda"
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if device is not None and getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        c = self.config
        os.makedirs(c.torch_profiler_dir, exist_ok=True)
        session = profile(activities=activities, record_shapes=c.torch_profiler_record_shapes,
                          profile_memory=c.torch_profiler_with_memory, with_stack=c.torch_profiler_with_stack,
                          with_flops=c.torch_profiler_with_flops)
        session.__enter__()
        self._session = session
        logger.info("profiler started (traces to %s)", c.torch_profiler_dir)

    def stop(self) -> list[str]:
        if not self.running:
            raise ProfilerError("the profiler is not running: start it first")
        session, self._session = self._session, None
        if session == "cuda":
            import torch

            torch.cuda.profiler.stop()
            return []
        session.__exit__(None, None, None)
        c = self.config
        self._sessions += 1
        stem = os.path.join(c.torch_profiler_dir, f"voltllm-engine{self.engine_index}-{os.getpid()}-"
                                                  f"{time.strftime('%Y%m%d-%H%M%S')}-{self._sessions}")
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
