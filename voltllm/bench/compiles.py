"""Triton kernel compiles while the bench runs: a warm run that compiles is not warm.

Triton compiles a new variant of a kernel for each class of its arguments it has not met in this process (an integer
== 1 or divisible by 16, a pointer 16-byte aligned or not), inside the step that first meets it. CompileLog counts
them through `triton.knobs.runtime.jit_cache_hook` (called when a specialization is missing from the process's
cache, before it is compiled or loaded from the disk cache), so each run records the kernels it compiled.
benchmarks/micro/bench_compiles.py shows which arguments set each variant apart.
"""
from __future__ import annotations

from typing import Any, Callable, Optional


class CompileLog:
    """While entered, the names of the Triton kernels compiled in this process, in order. Chains to a hook that
    was installed before (whose answer it keeps: True skips the compile)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._previous: Optional[Callable[..., Any]] = None
        self._knobs: Any = None

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        self.names.append(str(getattr(fn, "name", None) or getattr(fn, "__name__", "?")))
        return self._previous(*args, **kwargs) if self._previous is not None else False

    def __enter__(self) -> "CompileLog":
        try:
            from triton import knobs
        except ImportError:  # a torch without Triton: nothing compiles
            return self
        self._knobs = knobs.runtime
        self._previous = self._knobs.jit_cache_hook
        self._knobs.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook = self._previous
            self._knobs = None

    def mark(self) -> int:
        return len(self.names)

    def since(self, mark: int) -> list[str]:
        """Kernels compiled after `mark` (a value of mark())."""
        return list(self.names[mark:])
