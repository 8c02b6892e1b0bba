"""Run under TRITON_INTERPRET=1 (see test_gemv_interp.py): skinny GEMM and decode-batch GEMM vs the torch
references."""
import torch

from interp_util import patch_interpreter_index

patch_interpreter_index()
from voltllm.kernels.gemv import gemv, gemv_ref

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

# decode-batch GEMM (tl.dot, 16-64 rows): masked rows (17, 33), an odd N, K not a multiple of BLOCK_K, bias,
# the silu*mul prologue, split-K; outputs poisoned with NaN first. TMA configs (sixth field True) run the tensor-
# descriptor kernel where K keeps rows 16-byte aligned (K = 256 / 128 / 160) and the pointer kernel at K = 300.
from voltllm.kernels.batch_gemm import _tma_aligned, batch_gemm, batch_gemm_ref  # noqa: E402

tma_runs = 0

for m, n, k, bias in ((16, 48, 256, False), (17, 40, 300, True), (33, 64, 128, False), (64, 96, 160, True)):
    for dtype in (torch.float16,):  # (bf16: GPU only, the interpreter truncates fp32 -> bf16)
        for silu_mul in (False, True):
            x = torch.randn(m, 2 * k if silu_mul else k, dtype=dtype)
            w = torch.randn(n, k, dtype=dtype) / k ** 0.5
            b = torch.randn(n, dtype=dtype) if bias else None
            out = torch.full((m, n), float("nan"), dtype=dtype)
            # split-K: 2 and 3 slices (uneven, the last one short of BLOCK_K at k=300), 4 asked on fewer K tiles
            for cfg in ((32, 128, 4, 3, 1), (16, 64, 4, 1, 1), (64, 256, 4, 2, 1), (32, 64, 4, 1, 3),
                        (16, 128, 4, 1, 2), (64, 128, 4, 1, 4), (32, 128, 4, 2, 1, True), (64, 64, 4, 2, 3, True)):
                tma_runs += len(cfg) == 6 and _tma_aligned(x, w, k)
                out.fill_(float("nan"))
                batch_gemm(x, w, b, config=cfg, silu_mul=silu_mul, out=out)
                ref = batch_gemm_ref(x, w, b, silu_mul=silu_mul)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 2e-3, ("batch_gemm", m, n, k, dtype, cfg, silu_mul, err)
                if cfg[4] > 1:  # the split-K tile counters are back at zero for the next call
                    from voltllm.kernels.batch_gemm import _counters
                    assert not _counters[x.device].any(), cfg
# gated: w = [gate; up] (2N rows), silu(gate) * up in the epilogue; pointer and TMA tiles, odd N (the last TMA gate
# tile reads into the up rows), bias of 2N, a K tail under the TMA tile (K = 160: BLOCK_K 128 + 32 read as zero)
for m, n, k, bias in ((16, 24, 256, True), (17, 20, 300, False), (64, 48, 128, True), (32, 16, 160, False)):
    x = torch.randn(m, k, dtype=torch.float16)
    w = torch.randn(2 * n, k, dtype=torch.float16) / k ** 0.5
    b = torch.randn(2 * n, dtype=torch.float16) if bias else None
    for cfg in ((16, 128, 4, 2, 1), (32, 64, 4, 1, 1), (16, 128, 4, 2, 1, True)):
        tma_runs += len(cfg) == 6 and _tma_aligned(x, w, k)
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        batch_gemm(x, w, b, config=cfg, out=out, gated=True)
        ref = batch_gemm_ref(x, w, b, gated=True)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 2e-3, ("batch_gemm gated", m, n, k, cfg, err)
for bad in (dict(gated=True, config=(32, 64, 4, 1, 2)), dict(gated=True, silu_mul=True)):
    try:  # split-K and the silu*mul prologue do not combine with the gated epilogue
        batch_gemm(torch.zeros(16, 16, dtype=torch.float16), torch.zeros(8, 8 if bad.get("silu_mul") else 16,
                                                                          dtype=torch.float16), **bad)
        raise AssertionError(f"accepted {bad}")
    except ValueError:
        pass
try:
    batch_gemm(torch.zeros(16, 8), torch.zeros(4, 8))
    raise AssertionError("fp32 accepted")
except ValueError:
    pass
assert tma_runs == 15, tma_runs  # 3 aligned shapes x 2 variants x 2 TMA configs, 3 aligned gated shapes
print("ok batch_gemm")
