"""Triton GDN decode kernels on CUDA against voltllm.kernels.gdn_ref (same checks as the interpreter test),
and a hybrid model's decode step with the kernels == the torch reference path."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "_gdn_decode_interp_check", Path(__file__).resolve().parents[1] / "unit" / "_gdn_decode_interp_check.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)


@pytest.mark.parametrize("name", list(H.CHECKS))
def test_gdn_decode_kernel_cuda(name):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    status = H.CHECKS[name]("cuda")
    assert status.startswith("ok"), status


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gdn_decode_real_shape(dtype):
    """qwen3.5-27b-shape GDN decode: 16 key heads, 48 value heads, dims 128, batch 8."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    status = H.run_delta("cuda", 8, 16, 48, 128, 128, dtype, 7)
    assert status.startswith("ok"), status
    status = H.run_conv("cuda", 8, 2 * 16 * 128 + 48 * 128, 4, dtype, False, 8)
    assert status.startswith("ok"), status
