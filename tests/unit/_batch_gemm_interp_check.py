"""Run under TRITON_INTERPRET=1 (see test_gemv_interp.py): the decode-batch GEMM vs the torch reference."""
import torch

from interp_util import patch_interpreter_index

patch_interpreter_index()
torch.manual_seed(0)

# decode-batch GEMM (tl.dot, 2-64 rows): masked rows (5, 17, 33), an odd N, K not a multiple of BLOCK_K, bias,
# the silu*mul prologue, split-K; outputs poisoned with NaN first. TMA configs (sixth field True) run the tensor-
# descriptor kernel where K keeps rows 16-byte aligned (K = 256 / 128 / 160) and the pointer kernel at K = 300.
from voltllm.kernels.batch_gemm import _tma_aligned, batch_gemm, batch_gemm_ref  # noqa: E402

tma_runs = 0

for m, n, k, bias in ((5, 48, 256, False), (17, 40, 300, True), (33, 64, 128, False), (64, 96, 160, True)):
    for dtype in (torch.float16,):  # (bf16: GPU only: the interpreter truncates fp32 -> bf16, and its bf16 dots
        # return garbage (~1e10 relative error, Triton 3.6))
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
for m, n, k, bias in ((3, 24, 256, True), (17, 20, 300, False), (64, 48, 128, True), (32, 16, 160, False)):
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
# RMSNorm folded in (TMA tiles, plain and gated): x un-normalised with rows of very different scale (one of 3e3,
# where x * g itself would leave fp16 without the weight's scaling), a norm weight with an offset; and the residual
# epilogue (the fp32 residual updated in place, its rounding returned), with split-K too
from voltllm.kernels.batch_gemm import FoldedNorm  # noqa: E402

for m, n, k, gated in ((5, 48, 256, False), (33, 40, 160, True), (64, 64, 128, False)):
    x = torch.randn(m, k, dtype=torch.float16) * torch.logspace(-2, 1, m)[:, None].half()
    x[m // 2] *= 300.0
    g = torch.randn(k) * 8
    w = torch.randn(2 * n if gated else n, k, dtype=torch.float16) / k ** 0.5
    for cfg in ((32, 128, 4, 2, 1, True), (16, 64, 4, 3, 1, True)):
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        batch_gemm(x, w, config=cfg, out=out, gated=gated, norm=FoldedNorm(g, 1e-6, 1.0))
        ref = batch_gemm_ref(x, w, gated=gated, norm=(g, 1e-6, 1.0))
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 3e-3, ("batch_gemm norm", m, n, k, gated, cfg, err)
        if m == 64:
            row_err = ((out[m // 2].float() - ref[m // 2].float()).norm() / ref[m // 2].float().norm()).item()
            assert row_err < 3e-3, ("batch_gemm norm, the large row", cfg, row_err)
    for cfg in ((32, 128, 4, 2, 1, True), (32, 64, 4, 1, 2, True)):
        res = torch.randn(m, n) * 50
        res0 = res.clone()
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        xin = x[:, :k] / 100
        batch_gemm(xin, w[:n], config=cfg, out=out, residual=res)
        ref = res0 + batch_gemm_ref(xin, w[:n]).float()
        assert ((res - ref).norm() / ref.norm()).item() < 2e-3, ("residual add", cfg)
        assert torch.equal(out, res.half()), ("residual add: the rounded copy", cfg)
# the norm's sums of squares from the producer: a residual-add GEMM (plain and split-K) stores per-tile partials of
# its rounded rows, the next GEMM (the norm weight folded into its weight, gated or not) sums them (poisoned first)
for m, hid, gated in ((17, 96, False), (64, 160, True)):
    xa = torch.randn(m, 128, dtype=torch.float16)
    wo = torch.randn(hid, 128, dtype=torch.float16) / 4
    g = 1 + torch.rand(hid)
    wn = torch.randn(2 * 24 if gated else 24, hid, dtype=torch.float16) / hid ** 0.5
    fold = FoldedNorm(torch.ones(hid), 1e-6)
    fold.in_weight = True
    for pcfg in ((32, 128, 4, 2, 1, True), (64, 64, 4, 1, 2, True)):
        res = torch.randn(m, hid) * 3
        x16 = torch.full((m, hid), float("nan"), dtype=torch.float16)
        parts = torch.full((64 * 8,), float("nan"))
        batch_gemm(xa, wo, config=pcfg, out=x16, residual=res, sumsq_out=parts)
        n_parts = -(-hid // pcfg[0])
        out = torch.full((m, 24), float("nan"), dtype=torch.float16)
        batch_gemm(x16, (wn * g.half()).contiguous(), config=(16, 64, 4, 2, 1, True), out=out, gated=gated,
                   norm=fold, sumsq_in=(parts, n_parts))
        ref = batch_gemm_ref(x16, wn, gated=gated, norm=(g, 1e-6, 0.0))
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 3e-3, ("batch_gemm norm from partials", m, hid, gated, pcfg, err)
# a residual row beyond fp16 (2e5): written scaled by 1/16, with eps scaled by 1/256, the next GEMM's norm is the
# norm of the fp32 rows (unscaled, that row's fp16 copy would be inf)
res = torch.randn(16, 64) * 3
res[5] *= 7e4
x16 = torch.full((16, 64), float("nan"), dtype=torch.float16)
parts = torch.full((64 * 4,), float("nan"))
batch_gemm(torch.zeros(16, 32, dtype=torch.float16), torch.zeros(64, 32, dtype=torch.float16),
           config=(32, 32, 4, 1, 1, True), out=x16, residual=res, sumsq_out=parts, residual_out_scale=1 / 16)
assert torch.isfinite(x16).all() and torch.equal(x16, (res / 16).half())
wn = torch.randn(24, 64, dtype=torch.float16) / 8
fold = FoldedNorm(torch.ones(64), 1e-6 / 256)
fold.in_weight = True
out = torch.full((16, 24), float("nan"), dtype=torch.float16)
batch_gemm(x16, wn, config=(16, 64, 4, 2, 1, True), out=out, norm=fold, sumsq_in=(parts, 2))
ref = (res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + 1e-6)).half().float() @ wn.float().t()
assert ((out.float() - ref).norm() / ref.norm()).item() < 3e-3, "scaled residual"
for bad in (dict(norm=FoldedNorm(torch.ones(16), 1e-6), config=(32, 64, 4, 1, 1)),
            dict(norm=FoldedNorm(torch.ones(16), 1e-6), config=(32, 64, 4, 1, 2, True)),
            dict(residual=torch.zeros(16, 8, dtype=torch.float16), config=(32, 64, 4, 1, 1, True))):
    try:  # the folded forms are TMA-only, the norm without split-K, the residual fp32 (or bf16 with bf16 x) [M, N]
        batch_gemm(torch.zeros(16, 16, dtype=torch.float16), torch.zeros(8, 16, dtype=torch.float16), **bad)
        raise AssertionError(f"accepted {bad}")
    except ValueError:
        pass
for bad in (dict(gated=True, config=(32, 64, 4, 1, 2)), dict(gated=True, silu_mul=True)):
    try:  # split-K and the silu*mul prologue do not combine with the gated epilogue
        batch_gemm(torch.zeros(16, 16, dtype=torch.float16), torch.zeros(8, 8 if bad.get("silu_mul") else 16,
                                                                          dtype=torch.float16), **bad)
        raise AssertionError(f"accepted {bad}")
    except ValueError:
        pass
for x, what in ((torch.zeros(16, 8), "fp32"), (torch.zeros(1, 16, dtype=torch.float16), "one row (the skinny GEMM's)"),
                (torch.zeros(65, 16, dtype=torch.float16), "65 rows")):
    try:
        batch_gemm(x, torch.zeros(4, x.shape[1], dtype=x.dtype))
        raise AssertionError(f"{what} accepted")
    except ValueError:
        pass
assert tma_runs == 15, tma_runs  # 3 aligned shapes x 2 variants x 2 TMA configs, 3 aligned gated shapes
# the argmax epilogue (a greedy LM head): each row's argmax of the output the same tile would store, poisoned target;
# masked rows (5, 17), an N that leaves the last tile short, K under the TMA tile, pointer and TMA tiles. Then ties
# (the same weight row in two tiles: the first column wins), a NaN column (it outranks every number) and rows whose
# largest value sits in the short last tile.
for m, n, k in ((5, 200, 128), (17, 131, 96), (64, 257, 160)):
    x = torch.randn(m, k, dtype=torch.float16)
    w = torch.randn(n, k, dtype=torch.float16) / k ** 0.5
    w[n // 2 + 7] = w[3]  # a tie across tiles
    w[n - 1] *= 3.0  # often the maximum, in the last (partial) tile
    for cfg in ((32, 64, 4, 2, 1), (64, 32, 4, 1, 1), (32, 64, 4, 2, 1, True), (16, 128, 4, 1, 1, True)):
        got = torch.full((m,), -7, dtype=torch.long)
        assert batch_gemm(x, w, config=cfg, argmax_out=got) is got
        want = batch_gemm(x, w, config=cfg).argmax(dim=-1)
        assert torch.equal(got, want), ("batch_gemm argmax", m, n, k, cfg, got.tolist(), want.tolist())
    wn = w.clone()
    wn[n // 3] = float("nan")
    wn[n - 2] = float("nan")
    got = batch_gemm(x, wn, config=(32, 64, 4, 2, 1), argmax_out=torch.empty(m, dtype=torch.long))
    assert torch.equal(got, torch.full((m,), n // 3)), ("batch_gemm argmax NaN", got.tolist())
    wt = w.clone()
    wt[:] = 0
    wt[40] = wt[n - 1] = w[0]  # a tie of the maximum between tile 0 / 1 and the last tile
    got = batch_gemm(x, wt, config=(32, 32, 4, 1, 1), argmax_out=torch.empty(m, dtype=torch.long))
    assert torch.equal(got, batch_gemm(x, wt, config=(32, 32, 4, 1, 1)).argmax(dim=-1)), ("argmax ties", got.tolist())
for bad in (dict(config=(32, 64, 4, 1, 2)), dict(gated=True), dict(out=torch.empty(16, 8, dtype=torch.float16)),
            dict(argmax_out=torch.empty(16, dtype=torch.int32)), dict(argmax_out=torch.empty(15, dtype=torch.long))):
    try:  # the argmax epilogue: plain tiles without split-K, an int64 [M] target, no output tensor
        batch_gemm(torch.zeros(16, 16, dtype=torch.float16), torch.zeros(16 if bad.get("gated") else 8, 16,
                                                                          dtype=torch.float16),
                   **{"argmax_out": torch.empty(16, dtype=torch.long), **bad})
        raise AssertionError(f"argmax accepted {bad}")
    except ValueError:
        pass
print("ok batch_gemm")
