"""The MoE kernels with expert parallelism's local ids (-1: another rank's expert) under Triton's CPU interpreter:
align, grouped GEMM, the decode launches (the shared expert inside), the quantized per-pair and grouped products, and
the SparseMoE layer over every rank. TRITON_INTERPRET=1 must be set before triton.jit runs, so the checks run in a
subprocess (tests/unit/_expert_parallel_interp_check.py), once per module; each check is one test here."""
from __future__ import annotations

from pathlib import Path

import pytest

from interp_util import check_names, run_interp_checks

HELPER = Path(__file__).with_name("_expert_parallel_interp_check.py")
CHECKS = check_names(HELPER)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, ("cpu",), timeout=600, shared=True)


@pytest.mark.parametrize("name", CHECKS)
def test_expert_parallel_kernel_interp(interp_results, name):
    assert name in interp_results, f"check {name} did not run"
    assert interp_results[name].startswith("ok"), interp_results[name]
