"""Static checks of the code base (no GPU needed): the sm_70/sm_75 compile gate (voltllm.check.sm70_gate).

Names are loaded lazily so that `python -m voltllm.check.sm70_gate` does not import the module twice.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GateReport", "GateResult", "find_unregistered_kernels", "run_gate"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("voltllm.check.sm70_gate"), name)
    raise AttributeError(f"module 'voltllm.check' has no attribute {name!r}")
