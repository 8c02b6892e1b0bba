"""The norm-folded decode layers (voltllm.model.norm_fold) on CUDA: the decode-batch TMA GEMM's folded forms at the
8B's shapes against the fp32 reference (fresh random inputs, outputs poisoned first), and a tiny qwen3 engine (below
the size the start-up choice considers, so the plan is forced) whose folded layers give the unfused layers' tokens and
logprobs, eagerly and from CUDA-graph replays against the same engine's eager steps; fp16, and bf16 (a bf16 residual
stream: norm_fold.FOLD_BF16, set here)."""
from __future__ import annotations

import random
import tempfile

import pytest
import torch

pytestmark = pytest.mark.gpu


def _need_tma():
    from voltllm.kernels.batch_gemm import tma_supported

    if not tma_supported(torch.device("cuda")):
        pytest.skip("needs a TMA GPU (sm_90+)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [16, 33, 64])
def test_folded_gemm_forms_real_shapes(rows, dtype):
    """o_proj / down adding into the residual (fp32; a bf16 model's: bf16) with per-tile sums of squares, then qkv /
    gated gate_up with the norm folded in (the norm weight in the weight, the sums from the partials), as the layers
    chain them."""
    _need_tma()
    from voltllm.kernels.batch_gemm import FoldedNorm, batch_gemm, batch_gemm_ref
    from voltllm.model.norm_fold import FOLD_CONFIGS

    torch.manual_seed(rows)
    dev, h = torch.device("cuda"), 4096
    bf16 = dtype == torch.bfloat16
    tol = 1.5e-2 if bf16 else 3e-3  # (bf16 rounds to 8 bits: W * g, the rows read, the output)
    attn = torch.randn(rows, h, device=dev, dtype=dtype)
    wo = torch.randn(h, h, device=dev, dtype=dtype) / h ** 0.5
    res = torch.randn(rows, h, device=dev) * 4
    res = res.to(dtype) if bf16 else res
    res0 = res.clone()
    g = 1 + 0.2 * torch.randn(h, device=dev)
    norm = FoldedNorm(torch.ones(h, device=dev), 1e-6)
    norm.in_weight = True
    parts = torch.full((256 * 64,), float("nan"), device=dev)
    x16 = torch.full((rows, h), float("nan"), device=dev, dtype=dtype)
    batch_gemm(attn, wo, config=FOLD_CONFIGS["o"], out=x16, residual=res, sumsq_out=parts)
    ref_res = res0.float() + batch_gemm_ref(attn, wo).float()
    assert ((res.float() - ref_res).norm() / ref_res.norm()).item() < (8e-3 if bf16 else 2e-3)
    assert torch.equal(x16, res.to(dtype))
    n_parts = h // FOLD_CONFIGS["o"][0]
    for name, n, gated in (("qkv", 6144, False), ("gate_up", 12288, True)):
        w = torch.randn(2 * n if gated else n, h, device=dev, dtype=dtype) / h ** 0.5
        wg = (w.float() * g).to(dtype)
        out = torch.full((rows, n), float("nan"), device=dev, dtype=dtype)
        batch_gemm(x16, wg, config=FOLD_CONFIGS[name], out=out, gated=gated, norm=norm, sumsq_in=(parts, n_parts))
        ref = batch_gemm_ref(x16, w, gated=gated, norm=(g, 1e-6, 0.0)).float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < tol, (name, rows, dtype, err)
        # the first layer's form: the sums of squares from x itself
        out.fill_(float("nan"))
        batch_gemm(x16, wg, config=FOLD_CONFIGS[name], out=out, gated=gated, norm=norm)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < tol, (name, rows, dtype, "sums from x", err)


def _engine(d, dtype="float16", **kw):
    from tiny_models import make_model
    from voltllm import LLM

    return LLM(make_model(d, "qwen3", num_hidden_layers=3, hidden_size=256, intermediate_size=768,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=32), dtype=dtype,
               device="cuda", gpu_memory_utilization=0.3, max_model_len=512, max_num_seqs=32, **kw)


def _run(llm, prompts):
    """Per prompt: the greedy tokens and, per position, {token: logprob} of the top two and the chosen."""
    from voltllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2))
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _assert_agree(ref, got, bound=0.05):
    """Equal tokens with logprobs within `bound` up to each request's first difference, which must be a near-tie: one
    side's top logprobs hold the other side's choice within 2 * bound of its own (bf16's coarse logits tie three ways
    at times, so the other choice may be missing from one side's top two); nothing is compared after it."""
    flips = 0
    for (rt, rl), (gt, gl) in zip(ref, got):
        for i, (a, b) in enumerate(zip(rt, gt)):
            if a != b:
                flips += 1
                near = ((b in rl[i] and rl[i][a] - rl[i][b] < 2 * bound)
                        or (a in gl[i] and gl[i][b] - gl[i][a] < 2 * bound))
                assert near, (i, rl[i], gl[i])
                break
            assert abs(rl[i][a] - gl[i][b]) < bound, (i, rl[i][a], gl[i][b])
    assert flips <= len(ref) // 4, flips


PROMPTS = [f"prompt {i}: the quick brown fox " * (1 + i % 3) for i in range(20)]


DTYPES = ["float16", "bfloat16"]
BOUNDS = {"float16": 0.05, "bfloat16": 0.1}  # (bf16's 8-bit rounding of W * g and of the rows moves logprobs more)


@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_layers_match_unfused_eager(dtype, monkeypatch):
    """Eager steps (no tuner): the plan forced at every row count from 2 to 64 against the unfused layers."""
    _need_tma()
    import voltllm.model.norm_fold as nf

    monkeypatch.setattr(nf, "FOLD_BF16", True)
    with tempfile.TemporaryDirectory() as d:
        llm = _engine(d, dtype, enforce_eager=True)
        model = llm.engine.runner.model
        assert nf.ineligible(model).startswith("layers of "), nf.ineligible(model)  # (small: forced on here)
        plain = _run(llm, PROMPTS)
        nf.fold_norm_weights(model)
        model.norm_fold = nf.NormFoldPlan(model, {r: dict(nf.FOLD_CONFIGS) for r in range(2, 65)})
        _assert_agree(plain, _run(llm, PROMPTS), BOUNDS[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_start_up_choice_and_graphs(dtype, monkeypatch):
    """The engine makes no plan for a model this small (MIN_LAYER_WEIGHT_BYTES); with the plan forced at every graph
    size from 16 rows and the graphs captured again, replays (decode graphs, and prompt graphs for single short
    prompts) agree with the same engine's eager steps on the same folded weights."""
    _need_tma()
    import voltllm.model.norm_fold as nf

    monkeypatch.setattr(nf, "FOLD_BF16", True)
    with tempfile.TemporaryDirectory() as d:
        llm = _engine(d, dtype)
        runner = llm.engine.runner
        model = runner.model
        assert model.norm_fold is None
        nf.fold_norm_weights(model)
        model.norm_fold = nf.NormFoldPlan(model, {r: dict(nf.FOLD_CONFIGS) for r in range(16, 65)})
        runner.drop_cuda_graphs()
        runner.capture_cuda_graphs()
        replayed = _run(llm, PROMPTS)
        assert runner.graphs is not None and runner.graphs.replays > 0
        # one short prompt at a time: prompt steps of <= 32 tokens, replayed as folded piecewise prompt graphs (the
        # 8B's plan covers 32-64 rows, so its short prompts take this path)
        prompt_replays = runner.prompt_graphs.replays
        singles = [_run(llm, [p])[0] for p in PROMPTS[:3]]
        assert runner.prompt_graphs.replays >= prompt_replays + 3
        graphs, prompt_graphs = runner.graphs, runner.prompt_graphs
        runner.graphs = runner.prompt_graphs = None  # the same engine's eager steps
        try:
            eager = _run(llm, PROMPTS)
            eager_singles = [_run(llm, [p])[0] for p in PROMPTS[:3]]
        finally:
            runner.graphs, runner.prompt_graphs = graphs, prompt_graphs
    _assert_agree(eager, replayed, BOUNDS[dtype])
    _assert_agree(eager_singles, singles, BOUNDS[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_embed_rows_equal_the_unfused_first_inputs(dtype):
    """The folded batch's embeddings, residual stream and first input from one kernel (kernels/embed_rows.py) equal
    the unfused ops' bit for bit, at the 8B's table (151,936 x 4,096) and 1-64 rows with repeated ids, PDL on."""
    from voltllm.kernels import pdl
    from voltllm.kernels.embed_rows import embed_rows, embed_rows_ref

    g = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(1 << 30))
    table = torch.randn(151936, 4096, dtype=dtype, device="cuda", generator=g) * 3
    res_dtype = torch.float32 if dtype == torch.float16 else dtype
    scale = 2.0 ** -4 if dtype == torch.float16 else 1.0
    pdl.configure(True)
    try:
        for rows in (1, 17, 64):
            ids = torch.randint(0, 151936, (rows,), device="cuda", generator=g)
            ids[-1] = ids[0]
            got, want = embed_rows(table, ids, res_dtype, scale), embed_rows_ref(table, ids, res_dtype, scale)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows
    finally:
        pdl.configure(False)
