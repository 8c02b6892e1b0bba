"""Triton GDN prefill conv1d under Triton's CPU interpreter, against voltllm.kernels.gdn_ref (checks in
tests/unit/_gdn_conv_interp_check.py, run in a subprocess since TRITON_INTERPRET=1 must be set before triton.jit
runs); and its per-step tile table."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interp_util import check_names, registered_kernels, run_interp_checks

HELPER = Path(__file__).with_name("_gdn_conv_interp_check.py")


CHECKS = check_names(HELPER)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, ('cpu',), timeout=600, shared=True)


@pytest.mark.parametrize("name", CHECKS)
def test_gdn_conv_kernel_interp(interp_results, name):
    assert name in interp_results, f"check {name} did not run"
    assert interp_results[name].startswith("ok"), interp_results[name]


def test_conv_tiles_never_cross_a_request():
    pytest.importorskip("triton")
    from voltllm.kernels.gdn_conv import conv_tiles

    qsl = [0, 0, 1, 3, 9, 139, 140]
    t = conv_tiles(qsl, torch.tensor([True, False, True, True, False, True]), block_t=64)
    assert t.num_tiles == 1 + 1 + 1 + 3 + 1
    assert t.req.tolist() == [1, 2, 3, 4, 4, 4, 5]  # request 0 has no tokens: no tile
    assert t.start.tolist() == [0, 1, 3, 9, 73, 137, 139]
    assert t.qsl.tolist() == qsl and t.req.dtype == torch.int32
    assert t.has_init.tolist() == [1, 0, 1, 1, 0, 1] and t.has_init.dtype == torch.int32
    assert conv_tiles([0, 0, 0], torch.zeros(2, dtype=torch.bool)) is None


def test_kernel_registered_for_compat_gate():
    assert registered_kernels("voltllm.kernels.gdn_conv", "gdn.") == ["gdn.prefill_conv1d"]
