"""Triton chunked gated delta rule (voltllm.kernels.gdn_chunk) under Triton's CPU interpreter, against the torch
reference (voltllm.kernels.gdn_ref). TRITON_INTERPRET=1 must be set before triton.jit runs, so the checks run in a
subprocess (tests/unit/_gdn_chunk_interp_check.py), once per module; each check is one test here."""
from __future__ import annotations

from pathlib import Path

import pytest

from interp_util import check_names, registered_kernels, run_interp_checks

HELPER = Path(__file__).with_name("_gdn_chunk_interp_check.py")


CHECKS = check_names(HELPER)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, ('cpu',), timeout=600, shared=True)


@pytest.mark.parametrize("name", CHECKS)
def test_gdn_chunk_kernel_interp(interp_results, name):
    assert name in interp_results, f"check {name} did not run"
    assert interp_results[name].startswith("ok"), interp_results[name]


def test_kernels_registered_for_compat_gate():
    assert str(registered_kernels("voltllm.kernels.gdn_chunk", "gdn.chunk")) == "['gdn.chunk_fwd', 'gdn.chunk_hoist', 'gdn.chunk_prep']"


def test_chunk_table():
    from voltllm.kernels.gdn_chunk import chunk_table

    starts, lens, seq_chunk = chunk_table([0, 64, 65, 200], 64)
    assert starts == [0, 64, 65, 129, 193] and lens == [64, 1, 64, 64, 7] and seq_chunk == [0, 1, 2, 5]
