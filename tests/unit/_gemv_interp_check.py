"""Run under TRITON_INTERPRET=1 (see test_gemv_interp.py): the skinny GEMM (plain, its fused norm / accumulate forms,
gated) vs the torch references. The decode-batch GEMM's checks are _batch_gemm_interp_check.py."""
import torch

from interp_util import patch_interpreter_index

patch_interpreter_index()
from voltllm.kernels.gemv import gemv, gemv_ref  # noqa: E402

torch.manual_seed(0)
cases = ((1, 40, 300, False), (3, 17, 96, True), (4, 64, 1030, True), (2, 300, 64, False), (1, 16, 512, False))
for m, n, k, bias in cases:
    for dtype in (torch.float32, torch.float16):
        for silu_mul in (False, True):
            x = torch.randn(m, 2 * k if silu_mul else k, dtype=dtype)
            w = torch.randn(n, k, dtype=dtype) / k ** 0.5
            b = torch.randn(n, dtype=dtype) if bias else None
            out = torch.full((m, n), float("nan"), dtype=dtype)
            # masked tiles, a tile wider than K, and the unmasked (EVEN) path of (1, 16, 512)
            for cfg in ((8, 512, 4, 1), (16, 64, 4, 1), (2, 2048, 4, 3), (4, 256, 2, 3)):
                out.fill_(float("nan"))
                gemv(x, w, b, out=out, config=cfg, silu_mul=silu_mul)
                ref = gemv_ref(x, w, b, silu_mul=silu_mul)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                tol = 1e-5 if dtype == torch.float32 else 2e-3
                assert err < tol, (m, n, k, dtype, cfg, silu_mul, err)
print("ok")

# the decode layer's fused forms: RMSNorm of an fp32 residual in the prologue (fp32 / fp16 norm weight, Qwen3-Next's
# +1 offset, bias, masked K), and the residual add in place into fp32 (silu*mul prologue too)
for m, n, k, bias in ((1, 40, 300, True), (2, 16, 512, False), (1, 24, 96, False)):
    res = torch.randn(m, k) * 30
    w = torch.randn(n, k, dtype=torch.float16) / k ** 0.5
    b = torch.randn(n, dtype=torch.float16) if bias else None
    for nw, offset in ((torch.rand(k) + 0.5, 0.0), (torch.randn(k).half() * 0.1, 1.0)):
        for cfg in ((8, 512, 4, 1), (4, 64, 4, 1), (16, 1024, 4, 3)):
            out = torch.full((m, n), float("nan"), dtype=torch.float16)
            gemv(res, w, b, out=out, config=cfg, norm=(nw, 1e-6, offset))
            ref = gemv_ref(res, w, b, norm=(nw, 1e-6, offset))
            assert gemv(res, w, b, config=cfg, norm=(nw, 1e-6, offset)).dtype == torch.float16
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 2e-3, ("norm", m, n, k, cfg, offset, err)
    for silu_mul in (False, True):
        x = torch.randn(m, 2 * k if silu_mul else k, dtype=torch.float16)
        w2 = torch.randn(k, k, dtype=torch.float16) / k ** 0.5
        for cfg in ((8, 512, 4, 1), (4, 64, 4, 1)):
            acc = torch.randn(m, k) * 10
            ref = acc + gemv_ref(x, w2, silu_mul=silu_mul).float()
            gemv(x, w2, out=acc, config=cfg, silu_mul=silu_mul, accumulate=True)
            err = ((acc - ref).norm() / ref.norm()).item()
            assert err < 1e-3, ("accumulate", m, k, cfg, silu_mul, err)
for bad in (dict(accumulate=True), dict(norm=(torch.ones(8), 1e-6, 0.0), silu_mul=True)):
    try:
        gemv(torch.zeros(1, 16), torch.zeros(8, 8), **bad)
        raise AssertionError(f"accepted {bad}")
    except ValueError:
        pass
print("ok norm / accumulate")

# gated (silu(gate) * up in the epilogue, w = [gate; up]): plain and with the RMSNorm prologue, bias on both
# halves, masked and EVEN tiles; the result equals the unfused GEMV followed by the SiLU*mul
for m, n, k, bias in ((1, 40, 300, True), (2, 16, 512, False), (3, 24, 96, True)):
    w = torch.randn(2 * n, k, dtype=torch.float16) / k ** 0.5
    b = torch.randn(2 * n, dtype=torch.float16) if bias else None
    x = torch.randn(m, k, dtype=torch.float16)
    res = torch.randn(m, k) * 30
    nw = torch.rand(k) + 0.5
    for cfg in ((8, 512, 4, 1), (4, 64, 4, 1), (16, 1024, 4, 3)):
        for inp, norm in ((x, None), (res, (nw, 1e-6, 0.0))):
            out = torch.full((m, n), float("nan"), dtype=torch.float16)
            gemv(inp, w, b, out=out, config=cfg, norm=norm, gated=True)
            ref = gemv_ref(inp, w, b, norm=norm, gated=True).float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-3, ("gated", m, n, k, cfg, norm is not None, err)
for bad in (dict(silu_mul=True), dict(accumulate=True, out=torch.zeros(1, 4))):
    try:
        gemv(torch.zeros(1, 16 if bad.get("silu_mul") else 8), torch.zeros(8, 8), gated=True, **bad)
        raise AssertionError(f"accepted gated {bad}")
    except ValueError:
        pass
print("ok gated")
