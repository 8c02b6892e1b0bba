"""Triton GDN decode kernels (delta-rule step, conv1d step) under Triton's CPU interpreter, against
voltllm.kernels.gdn_ref. TRITON_INTERPRET=1 must be set before triton.jit runs, so the checks run in a
subprocess (tests/unit/_gdn_decode_interp_check.py), once per module; each check is one test here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from interp_util import check_names, run_interp_checks

HELPER = Path(__file__).with_name("_gdn_decode_interp_check.py")
ROOT = Path(__file__).resolve().parents[2]




CHECKS = check_names(HELPER)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, ('cpu',), timeout=600)


@pytest.mark.parametrize("name", CHECKS)
def test_gdn_decode_kernel_interp(interp_results, name):
    assert name in interp_results, f"check {name} did not run"
    assert interp_results[name].startswith("ok"), interp_results[name]


def test_kernels_registered_for_compat_gate():
    pytest.importorskip("triton")
    code = ("import voltllm.kernels.gdn_decode; from voltllm.kernels.registry import REGISTRY; "
            "print(sorted(n for n in REGISTRY if n.startswith('gdn.')))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "['gdn.decode_conv1d', 'gdn.decode_delta_rule']" in out.stdout, out.stderr[-2000:]
