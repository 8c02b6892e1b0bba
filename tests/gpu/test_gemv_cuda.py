"""Skinny GEMM (voltllm.kernels.gemv) on CUDA at real decode shapes: every tile config, 1-4 rows, fp16 and
bf16, with and without the fused silu(gate) * up prologue and bias, against the fp32 torch reference on
fresh random inputs (outputs poisoned with NaN first); and the start-up tuner's choices compute the same
as cuBLAS."""
from __future__ import annotations

import random

import pytest
import torch

from voltllm.kernels.gemv import CONFIGS, gemv, gemv_ref

pytestmark = pytest.mark.gpu

SHAPES = [(6144, 4096), (4096, 4096), (4096, 12288), (960, 576), (576, 1536), (49152, 576), (1000, 333)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_real_shapes(n, k, dtype):
    seed = random.SystemRandom().randrange(1 << 30)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, dtype=dtype, device="cuda", generator=g) / k ** 0.5
    bias = torch.randn(n, dtype=dtype, device="cuda", generator=g)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for m in (1, 2, 3, 4):
        for silu_mul in (False, True):
            x = torch.randn(m, 2 * k if silu_mul else k, dtype=dtype, device="cuda", generator=g)
            for b in (None, bias):
                ref = gemv_ref(x, w, b, silu_mul=silu_mul).float()
                for cfg in CONFIGS:
                    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                    gemv(x, w, b, out=out, config=cfg, silu_mul=silu_mul)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    assert err < tol, (seed, n, k, m, silu_mul, b is not None, cfg, err)


def test_tuned_model_matches_cublas():
    """A tiny fp16 model: after tuning, the layers that chose the Triton GEMM give cuBLAS's answer."""
    from voltllm.model.layers.linear import Linear
    from voltllm.worker.skinny_tuning import tune_skinny_gemm

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Linear(1024, [2048, 1024], dtype=torch.float16) for _ in range(4)]).cuda()
    for m in model:
        m.weight.data.normal_(0, 0.02)
    decisions = tune_skinny_gemm(model)
    assert set(decisions) == {(3072, 1024)}
    x = torch.randn(1, 1024, dtype=torch.float16, device="cuda")
    for m in model:
        ref = torch.nn.functional.linear(x, m.weight).float()
        assert ((m(x).float() - ref).norm() / ref.norm()).item() < 2e-3
