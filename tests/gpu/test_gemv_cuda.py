"""Skinny GEMM (voltllm.kernels.gemv, 1-4 rows) and decode-batch GEMM (voltllm.kernels.batch_gemm, 2-64 rows)
on CUDA at real decode shapes: every tile config, fp16 and bf16, with and without the fused silu(gate) * up
prologue and bias (all four at two shapes, the models' own variant at the others), against the fp32 torch
reference on fresh random inputs (outputs poisoned with NaN first); and the start-up tuners' choices compute
the same as cuBLAS."""
from __future__ import annotations

import random

import pytest
import torch

from voltllm.kernels.gemv import CONFIGS, gemv, gemv_ref

pytestmark = pytest.mark.gpu

# every (silu_mul, bias) variant at two shapes (one with masked edges); elsewhere the variant the models use
# there (plain; silu*mul on the down projections), to keep the file's compile time within one device call
FULL_SHAPES = [(4096, 4096), (1000, 333)]
SHAPES = FULL_SHAPES + [(6144, 4096), (4096, 12288), (960, 576), (576, 1536), (49152, 576)]
DOWN_SHAPES = {(4096, 12288), (576, 1536)}


def _variants(n, k):
    if (n, k) in FULL_SHAPES:
        return (False, False), (False, True), (True, False), (True, True)
    return ((True, False),) if (n, k) in DOWN_SHAPES else ((False, False),)


def _check_every_config(run, ref_fn, configs, rows, n, k, dtype, variants):
    """run(x, w, bias, cfg, silu_mul, out) at every config and row count, for each (silu_mul, bias) variant,
    vs ref_fn (fp32), on fresh random inputs (the seed is in the failure message); outputs poisoned with NaN
    first."""
    seed = random.SystemRandom().randrange(1 << 30)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, dtype=dtype, device="cuda", generator=g) / k ** 0.5
    bias = torch.randn(n, dtype=dtype, device="cuda", generator=g)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for m in rows:
        for silu_mul, with_bias in variants:
            x = torch.randn(m, 2 * k if silu_mul else k, dtype=dtype, device="cuda", generator=g)
            for b in ((bias,) if with_bias else (None,)):
                ref = ref_fn(x, w, b, silu_mul=silu_mul).float()
                for cfg in configs:
                    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                    run(x, w, b, cfg, silu_mul, out)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    assert err < tol, (seed, n, k, m, silu_mul, b is not None, cfg, err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_real_shapes(n, k, dtype):
    _check_every_config(lambda x, w, b, cfg, silu_mul, out: gemv(x, w, b, out=out, config=cfg, silu_mul=silu_mul),
                        gemv_ref, CONFIGS, (1, 2, 3, 4), n, k, dtype, _variants(n, k))


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


# (960, 576): SmolLM2's qkv, a K tail under the TMA tiles (576 is not a multiple of BLOCK_K)
BATCH_SHAPES = [(4096, 4096), (1000, 333), (6144, 4096), (4096, 12288), (24576, 4096), (960, 576)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k", BATCH_SHAPES)
def test_batch_gemm_real_shapes(n, k, dtype):
    """Decode-batch GEMM (voltllm.kernels.batch_gemm, tl.dot): every config in fp16 (in bf16 one plain and two
    split-K tiles: the tile logic is the same, and compiling all of them twice makes the GPU suite outrun one
    device call) at 16-64 rows (17 and 48: masked rows), with and without silu*mul and bias, vs the fp32
    reference; outputs poisoned with NaN first."""
    from voltllm.kernels.batch_gemm import CONFIGS as BATCH_CONFIGS, TMA_CONFIGS, batch_gemm, batch_gemm_ref
    from voltllm.kernels.batch_gemm import tma_supported

    configs = BATCH_CONFIGS if dtype == torch.float16 else (
        BATCH_CONFIGS[0], *[c for c in BATCH_CONFIGS if c[4] == 2][:1], *[c for c in BATCH_CONFIGS if c[4] == 4][:1])
    assert dtype == torch.float16 or [c[4] for c in configs] == [1, 2, 4]
    # TMA tiles (sm_90+) where K keeps rows 16-byte aligned; an unaligned K would run their pointer fallback, which
    # the CPU interpreter test covers (compiling it here too would cost minutes)
    if tma_supported(torch.device("cuda")) and k % 8 == 0:
        configs = (*configs, *(TMA_CONFIGS if dtype == torch.float16 else
                               (TMA_CONFIGS[0], *[c for c in TMA_CONFIGS if c[4] > 1][:1])))
    _check_every_config(lambda x, w, b, cfg, silu_mul, out: batch_gemm(x, w, b, config=cfg, silu_mul=silu_mul,
                                                                        out=out),
                        batch_gemm_ref, configs, (2, 7, 16, 17, 48, 64), n, k, dtype, _variants(n, k))


def test_batch_gemm_split_k_in_graph_is_deterministic():
    """Split-K decode-batch GEMM replayed from a CUDA graph: each replay (fresh inputs copied in) gives bit for bit
    the eager result of the same inputs (the last-arriving slice reduces in slice order, whatever the arrival
    order) and the fp32 reference; the tile counters are back at zero after every call. 8B qkv / down shapes."""
    from voltllm.kernels.batch_gemm import _counters, batch_gemm, batch_gemm_ref

    g = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(1 << 30))
    for n, k, cfg in ((6144, 4096, (64, 128, 4, 4, 4)), (4096, 12288, (128, 128, 8, 3, 2)),
                      (1000, 333, (32, 128, 4, 4, 2)), (4096, 12288, (64, 128, 4, 6, 2, True))):
        w = torch.randn(n, k, dtype=torch.float16, device="cuda", generator=g) / k ** 0.5
        b = torch.randn(n, dtype=torch.float16, device="cuda", generator=g)
        x = torch.randn(64, k, dtype=torch.float16, device="cuda", generator=g)
        out = torch.full((64, n), float("nan"), dtype=torch.float16, device="cuda")
        batch_gemm(x, w, b, config=cfg, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            batch_gemm(x, w, b, config=cfg, out=out)
        for _ in range(3):
            x.copy_(torch.randn(64, k, dtype=torch.float16, device="cuda", generator=g))
            out.fill_(float("nan"))
            graph.replay()
            eager = batch_gemm(x, w, b, config=cfg)
            torch.cuda.synchronize()
            assert torch.equal(out, eager), (n, k, cfg)
            ref = batch_gemm_ref(x, w, b).float()
            assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-3, (n, k, cfg)
            assert not _counters[x.device].any()


def test_batch_tuned_model_matches_cublas(monkeypatch):
    """Decode-batch tuning on 8 MiB weights at 8 / 16 / 64 rows: the layers give cuBLAS's answer at every row
    count, whichever GEMM they chose, and weights under BATCH_MIN_WEIGHT_BYTES are not timed; with the default
    threshold (0) a small weight is timed on the short candidate list and gives cuBLAS's answer too."""
    from voltllm.kernels.batch_gemm import SMALL_WEIGHT_CONFIGS
    from voltllm.model.layers.linear import Linear, down_proj_silu_mul
    from voltllm.worker import skinny_tuning
    from voltllm.worker.skinny_tuning import tune_batch_gemm

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Linear(2048, 2048, dtype=torch.float16) for _ in range(4)],
                                Linear(576, 960, dtype=torch.float16)).cuda()
    for m in model:
        m.weight.data.normal_(0, 0.02)
    monkeypatch.setattr(skinny_tuning, "BATCH_MIN_WEIGHT_BYTES", 4 << 20)
    decisions = tune_batch_gemm(model, [1, 8, 16, 64, 128])
    assert set(decisions) == {(2048, 2048, 8), (2048, 2048, 16), (2048, 2048, 64)}
    assert not model[4].batch_gemm
    monkeypatch.setattr(skinny_tuning, "BATCH_MIN_WEIGHT_BYTES", 0)
    small = tune_batch_gemm(model[4:], [16, 64])
    assert set(small) == {(960, 576, 16), (960, 576, 64)}
    assert all(c is None or c in SMALL_WEIGHT_CONFIGS for c in small.values())
    for rows in (8, 16, 64, 33, 3):
        for m, k in [(m, 2048) for m in list(model)[:4]] + [(model[4], 576)]:
            x = torch.randn(rows, k, dtype=torch.float16, device="cuda")
            ref = torch.nn.functional.linear(x, m.weight).float()
            assert ((m(x).float() - ref).norm() / ref.norm()).item() < 2e-3
        gu = torch.randn(rows, 4096, dtype=torch.float16, device="cuda")
        act = torch.nn.functional.silu(gu[:, :2048]) * gu[:, 2048:]
        ref = torch.nn.functional.linear(act, model[0].weight).float()
        assert ((down_proj_silu_mul(model[0], gu).float() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("prefetch_k", [64, 1024, 4096])
def test_pdl_prefetch_chain_in_graph(prefetch_k):
    """With programmatic dependent launch and the L2 weight prefetch before the wait (sm_90+): a chain where
    each GEMM reads the previous one's output, replayed from a CUDA graph, equals the fp32 reference chain;
    shapes with masked edges and K shorter than the prefetch (clamped addresses); the decode-batch GEMM with
    pointer and with TMA loads. Outputs poisoned first."""
    from gpu_timing import replay_with_pdl
    from voltllm.kernels.batch_gemm import TMA_CONFIGS, batch_gemm

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    g = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(1 << 30))
    dims = [333, 1000, 4096, 576, 333]
    ws = [torch.randn(n, k, dtype=torch.float16, device="cuda", generator=g) / k ** 0.5
          for k, n in zip(dims[:-1], dims[1:])]
    for rows, gemm in ((1, lambda x, w, out: gemv(x, w, out=out, prefetch_k=prefetch_k)),
                       (16, lambda x, w, out: batch_gemm(x, w, out=out, prefetch_k=prefetch_k)),
                       (64, lambda x, w, out: batch_gemm(x, w, out=out, config=TMA_CONFIGS[-1],  # TMA, split-K
                                                         prefetch_k=prefetch_k))):
        x0 = torch.randn(rows, dims[0], dtype=torch.float16, device="cuda", generator=g)
        outs = [torch.empty(rows, n, dtype=torch.float16, device="cuda") for n in dims[1:]]
        replay_with_pdl(lambda: [gemm(x, w, o) for x, w, o in zip([x0] + outs[:-1], ws, outs)], outs)
        ref = x0.float()
        for w, o in zip(ws, outs):
            ref = (ref @ w.float().t()).half().float()
            assert ((o.float() - ref).norm() / ref.norm()).item() < 3e-3, (rows, prefetch_k, tuple(w.shape))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_norm_and_accumulate_real_shapes(dtype):
    """The decode layer's fused GEMVs at 8B shapes: RMSNorm of an fp32 residual (large values) in the prologue,
    and the residual add into fp32 in the epilogue (plain and silu*mul), vs the fp32 reference; poisoned."""
    g = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(1 << 30))
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    res = torch.randn(1, 4096, device="cuda", generator=g) * 40
    nw = torch.rand(4096, device="cuda", generator=g) + 0.5
    for n, cfg in ((6144, (4, 1024, 4, 1)), (24576, (4, 512, 2, 3)), (1000, (8, 256, 4, 1))):
        w = (torch.randn(n, 4096, device="cuda", generator=g) / 64).to(dtype)
        out = torch.full((1, n), float("nan"), dtype=dtype, device="cuda")
        gemv(res, w, out=out, config=cfg, norm=(nw, 1e-6, 0.0))
        ref = gemv_ref(res, w, norm=(nw, 1e-6, 0.0)).float()
        assert ((out.float() - ref).norm() / ref.norm()).item() < tol, (n, cfg)
    for k, silu_mul in ((4096, False), (12288, True)):
        w = (torch.randn(4096, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
        x = torch.randn(1, 2 * k if silu_mul else k, dtype=dtype, device="cuda", generator=g)
        acc = res.clone()
        gemv(x, w, out=acc, config=(4, 1024, 4, 1), silu_mul=silu_mul, accumulate=True)
        ref = res + gemv_ref(x, w, silu_mul=silu_mul).float()
        assert ((acc - ref).norm() / ref.norm()).item() < 1e-3, (k, silu_mul)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_fused_decode_engine_matches_unfused(tmp_path, kind):
    """Batch-1 decode with the norms and residual adds folded into the GEMVs (skinny forced on every
    projection, CUDA graphs captured again): the same greedy tokens as the unfused layers (fp32 model), and
    the batch-1 graph really holds the fused path."""
    from tiny_models import make_model

    import voltllm.model.models.llama as llama
    from voltllm import LLM, SamplingParams

    llm = LLM(make_model(str(tmp_path), kind), device="cuda", dtype="float32")
    runner, model = llm.engine.runner, llm.engine.runner.model
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["hello world, this is", "a b c d e f"]
    for layer in model.layers:
        for p in layer.projections():
            p.skinny = (4, 1024, 4, 1)
    calls = []
    original = llama.norm_linear
    llama.norm_linear = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        runner.capture_cuda_graphs()
    finally:
        llama.norm_linear = original
    assert runner.graphs is not None and len(calls) >= 2 * len(model.layers)
    fused = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    model.fused_decode = lambda ids: False
    runner.capture_cuda_graphs()
    plain = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert fused == plain


def test_tuners_time_down_projections_with_silu_mul():
    """A Linear fed [gate | up] (silu_mul_input) is tuned apart from a plain Linear of the same shape; the
    decode-batch tuner times it as it runs (SiLU*mul kernel + cuBLAS against the GEMM with the activation in its
    prologue; one row keeps the plain timing, see skinny_tuning); whatever each chose, down_proj_silu_mul gives
    cuBLAS's answer."""
    from voltllm.model.layers.linear import Linear, down_proj_silu_mul
    from voltllm.worker.skinny_tuning import tune_batch_gemm, tune_skinny_gemm

    torch.manual_seed(0)
    plain, down = Linear(2048, 2048, dtype=torch.float16).cuda(), Linear(2048, 2048, dtype=torch.float16).cuda()
    down.silu_mul_input = True
    for m in (plain, down):
        m.weight.data.normal_(0, 0.02)
    model = torch.nn.Sequential(plain, down)
    assert set(tune_skinny_gemm(model)) == {(2048, 2048), (2048, 2048, "silu_mul")}
    assert set(tune_batch_gemm(model, [16])) == {(2048, 2048, 16), (2048, 2048, 16, "silu_mul")}
    for rows in (1, 16):
        gu = torch.randn(rows, 4096, dtype=torch.float16, device="cuda")
        act = torch.nn.functional.silu(gu[:, :2048]) * gu[:, 2048:]
        ref = torch.nn.functional.linear(act, down.weight).float()
        assert ((down_proj_silu_mul(down, gu).float() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k", [(12288, 4096), (1536, 576), (500, 333)])
def test_gated_gemv_real_shapes(n, k, dtype):
    """gemv(gated=True), w = [gate; up] (2n x k): silu(x gate^T) * (x up^T) at every config (bf16: the first two;
    the tile logic is the same and each config compiles per variant: 20-25 s per case at 5849530) and 1-4 rows,
    plain and with the RMSNorm prologue (fp32 residual), with bias, vs the fp32 reference; outputs poisoned
    first."""
    seed = random.SystemRandom().randrange(1 << 30)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(2 * n, k, dtype=dtype, device="cuda", generator=g) / k ** 0.5
    b = torch.randn(2 * n, dtype=dtype, device="cuda", generator=g)
    nw = torch.rand(k, device="cuda", generator=g) + 0.5
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for m in (1, 2, 4):
        x = torch.randn(m, k, dtype=dtype, device="cuda", generator=g)
        res = torch.randn(m, k, device="cuda", generator=g) * 30
        for inp, norm, bias in ((x, None, None), (x, None, b), (res, (nw, 1e-6, 0.0), None)):
            ref = gemv_ref(inp, w, bias, norm=norm, gated=True).float()
            for cfg in CONFIGS if dtype == torch.float16 else CONFIGS[:2]:
                out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                gemv(inp, w, bias, out=out, config=cfg, norm=norm, gated=True)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < tol, (seed, n, k, m, norm is not None, bias is not None, cfg, err)


def test_tuned_mlp_matches_cublas_whatever_it_chose():
    """One-row tuning of a llama MLP (gate_up [2I, H], down [H, I]) may pick the gated gate_up GEMV + plain down, the
    silu*mul prologue or SiLU kernel + GEMV: the MLP gives cuBLAS's answer at one row either way (also in the fused
    decode layer's form: norm GEMV + residual-add GEMV), and the choice is logged per MLP."""
    from voltllm.model.layers.linear import linear_add_, norm_linear, one_row_gated
    from voltllm.model.layers.norm import RMSNorm
    from voltllm.model.models.llama import MLP
    from voltllm.worker.skinny_tuning import tune_skinny_gemm

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[MLP(2048, 5632, torch.float16) for _ in range(4)]).cuda()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    tune_skinny_gemm(model)
    x = torch.randn(1, 2048, dtype=torch.float16, device="cuda")
    norm = RMSNorm(2048, 1e-6).cuda()
    for mlp in model:
        gu = torch.nn.functional.linear(x, mlp.gate_up_proj.weight).float()
        act = (torch.nn.functional.silu(gu[:, :5632]) * gu[:, 5632:]).half()
        ref = torch.nn.functional.linear(act, mlp.down_proj.weight).float()
        assert ((mlp(x).float() - ref).norm() / ref.norm()).item() < 3e-3
        if mlp.gate_up_proj.skinny and mlp.down_proj.skinny:  # the fused decode layer's MLP half
            res = x.float() * 3
            nref = (res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()).half()
            gu2 = torch.nn.functional.linear(nref, mlp.gate_up_proj.weight).float()
            act2 = (torch.nn.functional.silu(gu2[:, :5632]) * gu2[:, 5632:]).half()
            ref2 = res + torch.nn.functional.linear(act2, mlp.down_proj.weight).float()
            gated = one_row_gated(mlp.gate_up_proj, res)
            a = norm_linear(mlp.gate_up_proj, res, norm, gated=gated)
            out = res.clone()
            linear_add_(mlp.down_proj, a, out, silu_mul=not gated)
            assert ((out - ref2).norm() / ref2.norm()).item() < 3e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k", [(12288, 4096), (500, 333), (1536, 576)])
def test_gated_batch_gemm_real_shapes(n, k, dtype):
    """batch_gemm(gated=True), w = [gate; up] (2n x k): silu(x gate^T) * (x up^T) at every split-free tile (pointer
    and, where K keeps rows aligned, TMA; bf16: one of each), 17 (masked) and 64 rows, vs the fp32 reference;
    outputs poisoned first. 500 x 333: masked features, K tail, and bias (each variant compiles every tile again);
    1536 x 576 (SmolLM2's MLP): a K tail under the TMA tiles."""
    from voltllm.kernels.batch_gemm import CONFIGS as BATCH_CONFIGS, batch_gemm, batch_gemm_ref, configs_for

    seed = random.SystemRandom().randrange(1 << 30)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(2 * n, k, dtype=dtype, device="cuda", generator=g) / k ** 0.5
    b = torch.randn(2 * n, dtype=dtype, device="cuda", generator=g)
    configs = [c for c in configs_for(torch.device("cuda")) if c[4] == 1 and (len(c) == 5 or k % 8 == 0)]
    if dtype == torch.bfloat16:
        configs = [BATCH_CONFIGS[0]] + [c for c in configs if len(c) == 6][:1]
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for m in (17, 64):
        x = torch.randn(m, k, dtype=dtype, device="cuda", generator=g)
        for bias in (None, b) if n == 500 else (None,):
            ref = batch_gemm_ref(x, w, bias, gated=True).float()
            for cfg in configs:
                out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                batch_gemm(x, w, bias, config=cfg, out=out, gated=True)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < tol, (seed, n, k, m, bias is not None, cfg, err)


def test_batch_tuned_mlp_matches_cublas_whatever_it_chose():
    """Decode-batch tuning of a llama MLP at 16 / 64 rows may pick the gated gate_up GEMM + plain down, or gate_up,
    SiLU kernel (or prologue) and down as chosen alone: the MLP gives cuBLAS's answer at every row count either
    way (an untuned one too)."""
    from voltllm.model.models.llama import MLP
    from voltllm.worker.skinny_tuning import tune_batch_gemm

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[MLP(2048, 5632, torch.float16) for _ in range(4)]).cuda()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    tune_batch_gemm(model, [16, 64])
    for rows in (16, 64, 33):
        x = torch.randn(rows, 2048, dtype=torch.float16, device="cuda")
        for mlp in model:
            gu = torch.nn.functional.linear(x, mlp.gate_up_proj.weight).float()
            act = (torch.nn.functional.silu(gu[:, :5632]) * gu[:, 5632:]).half()
            ref = torch.nn.functional.linear(act, mlp.down_proj.weight).float()
            assert ((mlp(x).float() - ref).norm() / ref.norm()).item() < 3e-3, (rows, mlp.gate_up_proj.batch_gated)
