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
# A GEMV whose whole weight is at most this size prefetches it whole before its wait. Measured on the H200
# (benchmarks/results/pdl-gemv-chain-2d9bf0d.txt and the decode benches at 2d9bf0d): the SmolLM2-shape GEMVs
# (<= 3.5 MB, latency-bound) gain ~10% of the decode step; on the 8B ones (32-200 MB, bandwidth-bound) every
# prefetch size tried (512-4096 elements per row) made the chain 2-12% slower.
PREFETCH_MAX_BYTES = 8 << 20


def configure(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


def launch_options() -> dict:
    """Extra launch keywords for a participating kernel: its PDL constexpr, and Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if _enabled else {"PDL": False}


def prefetch_elements(n: int, k: int, itemsize: int) -> int:
    """Weight elements per row a GEMV of an [n, k] weight prefetches before its wait: the whole row (rounded up
    to a power of two >= 64) for weights up to PREFETCH_MAX_BYTES, else none; none without PDL (a kernel then
    starts after its predecessor anyway: nothing to overlap)."""
    if not _enabled or n * k * itemsize > PREFETCH_MAX_BYTES:
        return 0
    return max(64, triton.next_power_of_2(k))


def gemm_launch_options(prefetch_k: int) -> dict:
    """launch_options() plus a GEMM's PREFETCH_K constexpr (0 without PDL)."""
    k = prefetch_k if _enabled else 0
    if k % 64 or (k and k & (k - 1)):
        raise ValueError(f"prefetch_k must be 0 or a power of two >= 64, got {k}")
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
