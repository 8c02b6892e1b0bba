"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A kernel launched with PDL may start while its predecessor's last wave still runs: its programs are placed
on the SMs as they free up and wait in `griddepcontrol.wait` until the predecessor has finished and its
writes are visible. Each participating kernel calls `pdl_enter(PDL)` first: wait, then let its own
successor launch. So a kernel never touches memory before its predecessor is complete (the same ordering
as plain launches), and at most one kernel waits ahead of the running one. What it hides is the launch and
ramp-up of every kernel of the step (hundreds per batch-1 decode step, ~1-3 us each).

A kernel whose big operand does not depend on its predecessor (a GEMM's weight) can also start moving it
before the wait: `prefetch_l2` asks for lines to be brought into L2 (a hint: no registers, no ordering; L2 is
the point of coherence, so a prefetch can never make a kernel see stale data). While the small latency-bound
kernels of a decode step run (norms, RoPE, attention), the next GEMM's first weight lines are already coming.

`configure` is called once by the model runner: on for sm_90+ on the native route; off on the CPU, on the
compat route (sm_70/75 have no griddepcontrol, and the forced route must behave like them) and by default.
With PDL off the kernels compile without the instructions (the sm_70/75 gate checks that).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_enabled = False
# weight elements per row a GEMM prefetches into L2 before its wait (a multiple of 64; 0: none). Sized so that
# one wave of GEMV programs asks for roughly what the GPU streams during a small kernel (a few MB), not more
# than L2 holds (benchmarks/micro/pdl_gemv_chain.py)
PREFETCH_K = 1024


def configure(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


def launch_options() -> dict:
    """Extra launch keywords for a participating kernel: its PDL constexpr, and Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if _enabled else {"PDL": False}


def gemm_launch_options(prefetch_k=None) -> dict:
    """launch_options() plus the PREFETCH_K constexpr of a GEMM: PREFETCH_K (or `prefetch_k`) with PDL, else 0
    (without PDL a kernel starts after its predecessor anyway: nothing to overlap)."""
    k = (PREFETCH_K if prefetch_k is None else prefetch_k) if _enabled else 0
    if k % 64:
        raise ValueError(f"prefetch_k must be a multiple of 64, got {k}")
    return {**launch_options(), "PREFETCH_K": k}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()



@triton.jit
def prefetch_l2(ptrs):
    """Hint to bring the 128-byte lines holding `ptrs` into L2 (every pointer must be in bounds)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(W, offs_n, N, stride_wn, K, PREFETCH_K: tl.constexpr):
    """Prefetch the first PREFETCH_K elements (2-byte) of weight rows offs_n (clamped into [0, N) x [0, K))."""
    rows = tl.minimum(offs_n, N - 1)
    LINES: tl.constexpr = PREFETCH_K // 64  # 64 two-byte elements per 128-byte line
    cols = tl.minimum(tl.arange(0, LINES) * 64, K - 1)
    prefetch_l2(W + rows[:, None] * stride_wn + cols[None, :])


__triton_helpers__ = ("pdl_enter", "prefetch_l2", "prefetch_rows_l2")
