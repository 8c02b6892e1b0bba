"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A kernel launched with PDL may start while its predecessor's last wave still runs: its programs are placed
on the SMs as they free up and wait in `griddepcontrol.wait` until the predecessor has finished and its
writes are visible. Each participating kernel calls `pdl_enter(PDL)` first: wait, then let its own
successor launch. So a kernel never touches memory before its predecessor is complete (the same ordering
as plain launches), and at most one kernel waits ahead of the running one. What it hides is the launch and
ramp-up of every kernel of the step (hundreds per batch-1 decode step, ~1-3 us each).

`configure` is called once by the model runner: on for sm_90+ on the native route; off on the CPU, on the
compat route (sm_70/75 have no griddepcontrol, and the forced route must behave like them) and by default.
With PDL off the kernels compile without the instructions (the sm_70/75 gate checks that).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_enabled = False


def configure(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


def launch_options() -> dict:
    """Extra launch keywords for a participating kernel: its PDL constexpr, and Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if _enabled else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

__triton_helpers__ = ("pdl_enter",)
