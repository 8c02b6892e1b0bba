"""Triton GDN prefill conv1d on CUDA against voltllm.kernels.gdn_ref (the interpreter test's checks), at the
qwen3.5-27b shape's conv width too, with its time beside the torch form's (printed with -s)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "_gdn_conv_interp_check", Path(__file__).resolve().parents[1] / "unit" / "_gdn_conv_interp_check.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


@pytest.mark.parametrize("name", list(H.CHECKS))
def test_gdn_conv_kernel_cuda(name):
    status = H.CHECKS[name]("cuda")
    assert status.startswith("ok"), status


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens", [[8192], [128] * 64, [1] * 16 + [2000, 3]], ids=["1x8192", "64x128", "mixed"])
def test_gdn_conv_real_shape(dtype, lens):
    """qwen3.5-27b-shape conv width (2 x 16 x 128 + 48 x 128 channels), kernel 4; timed against the torch form."""
    import triton.testing

    from voltllm.kernels import gdn_ref as R
    from voltllm.kernels.gdn_conv import causal_conv1d_prefill, conv_tiles

    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    status = H.run_conv("cuda", qsl, 10240, 4, dtype, False, 9)
    assert status.startswith("ok"), status
    c, n = 10240, len(lens)
    x = torch.randn(qsl[-1], c, device="cuda", dtype=dtype)
    w = torch.randn(c, 4, device="cuda", dtype=dtype)
    pool = torch.randn(n, 3, c, device="cuda", dtype=dtype)
    slots = torch.arange(n, device="cuda")
    init = torch.ones(n, dtype=torch.bool, device="cuda")
    plan, tiles = R.conv_plan(qsl, 4, x.device), conv_tiles(qsl, init)
    t_ref = triton.testing.do_bench(lambda: R.causal_conv1d_varlen(x, w, None, pool, slots, qsl, init, plan=plan))
    t_tri = triton.testing.do_bench(lambda: causal_conv1d_prefill(x, w, None, pool, slots, qsl, init, tiles=tiles))
    gbps = 2 * x.numel() * x.element_size() / (t_tri * 1e-3) / 1e9
    print(f"\nconv1d {dtype} {len(lens)} requests, {qsl[-1]} tokens: triton {t_tri * 1e3:.1f} us ({gbps:.0f} GB/s "
          f"in + out), torch form {t_ref * 1e3:.1f} us")
