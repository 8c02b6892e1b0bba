"""Hybrid models on a CUDA GPU: the Triton MoE grouped GEMM and chunked gated-delta-rule kernels against their
torch references (the interpreter checks again, then real shapes), and tiny Qwen3.5 / Qwen3-Next /
Qwen3.5-MoE checkpoints through the engine (every Triton path on: chunked GDN prefill, GDN decode, MoE): fp32
greedy tokens equal the CPU reference, fp16/bf16 stay close, the compat route agrees with the native one, and
prefix caching with state snapshots gives the cold run's tokens.

Run on the GPU machine:  pytest -m gpu tests/gpu/test_hybrid_gpu.py
Kernel timings are a benchmark, not a test: `voltllm bench --scenario kernels --random-weights qwen3.5-27b-shape`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from gpu_timing import graph_time_us

from tiny_models import HYBRID_MOE, make_tiny_hybrid

pytestmark = pytest.mark.gpu

UNIT = Path(__file__).resolve().parents[1] / "unit"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, UNIT / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MOE = _load("_moe_interp_check")
CHUNK = _load("_gdn_chunk_interp_check")


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


# ---------------------------------------------------------------------------------------------
# kernels: the interpreter checks on the GPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MOE.CHECKS))
def test_moe_checks_cuda(name):
    _need_cuda()
    status = MOE.CHECKS[name]("cuda")
    assert status.startswith("ok"), status


@pytest.mark.parametrize("name", list(CHUNK.CHECKS))
def test_gdn_chunk_checks_cuda(name):
    _need_cuda()
    status = CHUNK.CHECKS[name]("cuda")
    assert status.startswith("ok"), status


# ---------------------------------------------------------------------------------------------
# kernels at real shapes: correctness and timings vs the torch references
# ---------------------------------------------------------------------------------------------
MOE_SHAPES = {  # hidden, experts, top-k, expert intermediate
    "qwen3-next-80b-a3b": (2048, 512, 10, 512),
    "qwen3.5-moe-35b-a3b": (2048, 256, 8, 512),
}


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_real_shape(shape, dtype):
    _need_cuda()
    from voltllm.kernels.moe import fused_experts
    from voltllm.model.layers.moe import fused_experts_ref, route

    h, e, k, inter = MOE_SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=dtype, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, inter, device="cuda", dtype=dtype, generator=gen) * inter ** -0.5
    for t in (1, 4, 32, 512, 4096):
        x = torch.randn(t, h, device="cuda", dtype=dtype, generator=gen)
        w, ids = route(torch.randn(t, e, device="cuda", generator=gen), k, True)
        got = fused_experts(x, w13, w2, w, ids)
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w, ids)
        err = (got.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert err <= 2e-2 * scale, f"T={t}: max err {err:.3e} vs max |ref| {scale:.3e}"


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_moe_decode_path_real_shape(shape):
    """The decode-sized MoE path (one-launch router, unsorted expert GEMVs) at real shapes, fp16: equal to the
    references, and timed (CUDA graphs, as decode steps run) beside the router + grouped GEMM it replaces."""
    _need_cuda()
    from voltllm.kernels.moe import fused_experts
    from voltllm.kernels.moe_decode import fused_experts_small, moe_route
    from voltllm.model.layers.moe import fused_experts_ref, route

    h, e, k, inter = MOE_SHAPES[shape]
    dtype = torch.float16
    gen = torch.Generator(device="cuda").manual_seed(3)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=dtype, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, inter, device="cuda", dtype=dtype, generator=gen) * inter ** -0.5
    for t in (1, 2, 4, 6):
        x = torch.randn(t, h, device="cuda", dtype=dtype, generator=gen)
        logits = torch.randn(t, e, device="cuda", generator=gen).to(dtype)
        w_ref, ids_ref = route(logits, k, True)
        w, ids = moe_route(logits, k, True)
        assert torch.equal(ids.long(), ids_ref) and (w - w_ref).abs().max().item() < 1e-6
        got = fused_experts_small(x, w13, w2, w, ids)
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), w_ref, ids_ref)
        err = (got.float() - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().max().item(), f"T={t}: max err {err:.3e}"

        def new():
            a, b = moe_route(logits, k, True)
            return fused_experts_small(x, w13, w2, a, b)

        def old():
            a, b = route(logits, k, True)
            return fused_experts(x, w13, w2, a, b)

        times = [graph_time_us(fn, reps=50) for fn in (new, old)]
        print(f"\n{shape} T={t}: router + experts {times[0]:.1f} us (decode path) vs {times[1]:.1f} us "
              f"(torch router + grouped GEMM); expert bytes {t * k * 3 * inter * h * 2 / 1e6:.1f} MB")


@pytest.mark.parametrize("dtype,precision,hoist", [
    (torch.float16, "ieee", None), (torch.float16, "tf32x3", None), (torch.float16, "tf32", None),
    (torch.float16, "tf32x3", False), (torch.float16, "ieee", False), (torch.bfloat16, "tf32x3", None),
    (torch.bfloat16, "ieee", None)])
def test_gdn_chunk_real_shape(dtype, precision, hoist):
    """qwen3.5-27b-shape GDN layer (16 key heads, 48 value heads, dims 128): one 8K prefill, and a mixed batch,
    with exact fp32 FMA products, 3xTF32 (the native route's) and tf32 ones, each precision with its own tile
    (the tf32x3 / ieee first tiles have HOIST and dots in pieces, False runs them without HOIST). bf16 only with
    the default tiles (each variant compiles its kernels: the whole file has to fit one device call)."""
    _need_cuda()
    from voltllm.kernels import gdn_ref as R
    from voltllm.kernels.gdn_chunk import gated_delta_rule_chunked

    hk, hv, d = 16, 48, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    for lens in ([8192], [4096, 1000, 37, 1, 1]):
        t = sum(lens)
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        # q and k are L2-normalized per head, as the GDN layer does before the delta rule (un-normalized
        # keys with |k|^2 = d make the recurrence blow up, which no real model feeds it)
        q = torch.nn.functional.normalize(torch.randn(t, hk, d, device="cuda", generator=gen), dim=-1).to(dtype)
        k = torch.nn.functional.normalize(torch.randn(t, hk, d, device="cuda", generator=gen), dim=-1).to(dtype)
        v = torch.randn(t, hv, d, device="cuda", dtype=dtype, generator=gen)
        g = -torch.rand(t, hv, device="cuda", generator=gen) * 0.5
        beta = torch.rand(t, hv, device="cuda", generator=gen)
        n = len(lens)
        pool = torch.randn(n, hv, d, d, device="cuda", generator=gen) * 0.1
        slots = torch.arange(n, device="cuda")
        init = torch.tensor([i % 2 == 1 for i in range(n)], device="cuda")
        ref_pool = pool.clone()
        ref = R.gated_delta_rule_varlen(q, k, v, g, beta, ref_pool, slots, qsl, init)
        got_pool = pool.clone()
        got = gated_delta_rule_chunked(q, k, v, g, beta, got_pool, slots, qsl, init, precision=precision, hoist=hoist)
        err = (got.float() - ref.float()).abs().max().item()
        err_s = (got_pool - ref_pool).abs().max().item()
        tol_s = 5e-3 if precision == "tf32" else 1e-3
        assert err <= 1e-2 * max(1.0, ref.float().abs().max().item()), f"{lens}: out err {err:.3e}"
        assert err_s <= tol_s * max(1.0, ref_pool.abs().max().item()), f"{lens}: state err {err_s:.3e}"
        print(f"{dtype} {precision} hoist={hoist} {lens}: out err {err:.2e}, state err {err_s:.2e}")


# ---------------------------------------------------------------------------------------------
# tiny hybrid checkpoints through the engine
# ---------------------------------------------------------------------------------------------
MOE_CFG = dict(HYBRID_MOE, num_experts=8)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    pytest.importorskip("transformers")
    out = {}
    for i, kind in enumerate(("qwen3_5", "qwen3_next", "qwen3_5_moe")):
        extra = {} if kind == "qwen3_5" else dict(MOE_CFG, **({"mlp_only_layers": [1]} if kind == "qwen3_next" else {}))
        path = make_tiny_hybrid(tmp_path_factory.mktemp(kind), kind, 500 + i, 600 + i, **extra)
        if path is not None:
            out[kind] = path
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 192, (150,), generator=g).tolist()
    return [shared + torch.randint(0, 192, (n,), generator=g).tolist() for n in (20, 9)] + \
        [torch.randint(0, 192, (n,), generator=g).tolist() for n in (700, 5, 64)]


def _greedy(llm, prompts, n: int = 32):
    from voltllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _agree(a, b) -> float:
    return sum(x == y for s, r in zip(a, b) for x, y in zip(s, r)) / sum(len(s) for s in a)


@pytest.fixture(scope="module")
def cpu_runs(hybrids):
    """fp32 CPU reference per kind: (greedy tokens per prompt, top-1/top-2 logit margin at each of them)."""
    from voltllm import LLM, SamplingParams

    runs = {}
    for kind, path in hybrids.items():
        llm = LLM(path, device="cpu", skip_tokenizer_init=True, mamba_cache_mode="none")
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2))
        runs[kind] = _tokens_and_margins(outs)
    return runs


def _tokens_and_margins(outs) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens per request and the top-1/top-2 logprob margin at each (outputs generated with logprobs=2)."""
    tokens = [o.outputs[0].token_ids for o in outs]
    margins = [[lps[0] - lps[1] for lps in (sorted((lp.logprob for lp in pos.values()), reverse=True)
                                            for pos in o.outputs[0].logprobs)] for o in outs]
    return tokens, margins


@pytest.fixture(scope="module")
def cpu_tokens(cpu_runs):
    return {kind: run[0] for kind, run in cpu_runs.items()}


def _first_flips(got, ref_tokens, ref_margins) -> list[tuple[int, int, float]]:
    """(request, position, reference margin there) of each request's first token that differs from the
    reference. Only the first flip counts: after it the two runs decode different contexts."""
    flips = []
    for r, (g, want, margin) in enumerate(zip(got, ref_tokens, ref_margins)):
        i = next((i for i, (a, b) in enumerate(zip(g, want)) if a != b), None)
        if i is not None:
            flips.append((r, i, margin[i]))
    return flips


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_engine_gpu_fp32_matches_cpu(hybrids, cpu_tokens, kind):
    _need_cuda()
    if kind not in hybrids:
        pytest.skip(f"{kind} not in this transformers")
    from voltllm import LLM

    llm = LLM(hybrids[kind], device="cuda", dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_num_batched_tokens=256, mamba_cache_mode="none", max_num_seqs=8)  # 5 prompts: few graphs to capture
    got, _ = _greedy(llm, _prompts())
    assert got == cpu_tokens[kind], f"agreement {_agree(got, cpu_tokens[kind]):.3f}"
    llm.engine.check_integrity()


# a half-precision run may leave the fp32 reference only where the reference's top-1/top-2 logit margin is below
# this. The tiny random models' margins are small (median ~0.15-0.17 logit, 30-36% below 0.1); on the CPU, bf16
# runs first flip at margins <= 0.072 (measured); fp16 has 3 more mantissa bits. Until session 19: fp16 0.1, bf16
# 0.25. With the Triton prefill conv1d (fp32 accumulation and one rounding, as Dao's causal-conv1d kernel does,
# where the torch form rounds twice; the fp32 engine runs stay token-identical to the CPU) fp16 qwen3_next first
# flips at 0.1117 (request 1, token 25) and bf16 qwen3_5_moe at 0.2829 (request 0, token 22: with the torch conv
# that request left the reference at token 0, margin 0.02); benchmarks/results/gdn-prefill-conv/. A request that
# follows the reference longer meets wider margins: the criterion has luck in it (the teacher-forced test below
# has none). Single-tf32 chunk products flipped fp16 at 0.29.
HALF_FLIP_MARGIN = {"float16": 0.15, "bfloat16": 0.3}


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype,compat", [("float16", "none"), ("bfloat16", "none"), ("float16", "sm70")])
def test_engine_gpu_half(hybrids, cpu_runs, kind, dtype, compat):
    """Half precision on the GPU vs the fp32 CPU run, greedy: every request follows the reference until a
    near-tie of the reference (tiny random models have many: a flip there changes the rest of the run, so a bare
    agreement ratio measures luck, not correctness; a broken kernel flips where the margin is wide)."""
    _need_cuda()
    if kind not in hybrids:
        pytest.skip(f"{kind} not in this transformers")
    from voltllm import LLM

    llm = LLM(hybrids[kind], device="cuda", dtype=dtype, compat=compat, skip_tokenizer_init=True,
              gpu_memory_utilization=0.3, max_num_batched_tokens=256, max_num_seqs=8)
    got, _ = _greedy(llm, _prompts())
    ref_tokens, ref_margins = cpu_runs[kind]
    flips = _first_flips(got, ref_tokens, ref_margins)
    print(f"\n{kind} {dtype} compat={compat}: greedy agreement with the fp32 CPU run {_agree(got, ref_tokens):.3f}; "
          f"first flips (request, position, reference margin) {[(r, i, round(m, 4)) for r, i, m in flips]}")
    assert all(m < HALF_FLIP_MARGIN[dtype] for _, _, m in flips), flips
    llm.engine.check_integrity()


def _teacher_forced_logprobs(llm, seqs: list[list[int]]) -> list[list[float]]:
    """log p(token t | tokens < t) at every position t >= 1 of each sequence, each from one prompt pass
    (prompt_logprobs=0: the prompt token's own logprob)."""
    from voltllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    return [[pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, seqs)]


# mean |logprob - fp32 CPU logprob| per sequence over the reference's own tokens. Measured on the CPU's torch path
# (session 19, these models and sequences): fp16 means 0.0016-0.0127, bf16 0.017-0.071, while the largest single
# deviations reach 0.43 / 1.25 (an MoE routing choice or a near-tie moving in half precision), so the mean is the
# criterion; a wrong kernel moves every position.
TEACHER_FORCED_MEAN = {"float16": 0.03, "bfloat16": 0.15}


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype,compat", [("float16", "none"), ("bfloat16", "none"), ("float16", "sm70")])
def test_engine_gpu_half_teacher_forced(hybrids, kind, dtype, compat):
    """Half precision on the GPU vs the fp32 CPU run on the same token sequences (the CPU run's prompts and greedy
    continuations, fed as prompts in chunks of 256: the prefill kernels over every position, with the state
    carried between chunks). Unlike the greedy test above, nothing depends on where a run first leaves the
    reference."""
    _need_cuda()
    if kind not in hybrids:
        pytest.skip(f"{kind} not in this transformers")
    from voltllm import LLM, SamplingParams

    ref_llm = LLM(hybrids[kind], device="cpu", skip_tokenizer_init=True, mamba_cache_mode="none")
    outs = ref_llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(_prompts(), outs)]
    ref = _teacher_forced_logprobs(ref_llm, seqs)
    del ref_llm
    llm = LLM(hybrids[kind], device="cuda", dtype=dtype, compat=compat, skip_tokenizer_init=True,
              gpu_memory_utilization=0.3, max_num_batched_tokens=256, max_num_seqs=8, mamba_cache_mode="none")
    got = _teacher_forced_logprobs(llm, seqs)
    means = [sum(abs(a - b) for a, b in zip(x, y)) / len(x) for x, y in zip(got, ref)]
    worst = [max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(got, ref)]
    print(f"\n{kind} {dtype} compat={compat}: mean |logprob delta| per sequence {[round(m, 4) for m in means]}, "
          f"largest {[round(w, 3) for w in worst]}")
    assert max(means) < TEACHER_FORCED_MEAN[dtype], means
    llm.engine.check_integrity()


def test_engine_gpu_prefix_cache_snapshots(hybrids, cpu_tokens):
    """Shared 150-token prefix, --mamba-block-size 32, chunks of 64 (snapshots at 64, 128, 160 for the first
    request): the second one resumes at 128 and every request gives the cold tokens."""
    _need_cuda()
    from voltllm import LLM

    kind = "qwen3_next"
    llm = LLM(hybrids[kind], device="cuda", dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_num_batched_tokens=64, block_size=16, mamba_block_size=32, max_num_seqs=8)
    snaps = llm.engine.runner.state_snapshots
    assert snaps is not None
    prompts = _prompts()
    first, cached0 = _greedy(llm, prompts[:1])
    rest, cached = _greedy(llm, prompts[1:])
    assert first + rest == cpu_tokens[kind]
    assert cached0 == [0] and cached[0] == 128
    assert snaps.num_restored >= 1
    llm.engine.step()
    llm.engine.check_integrity()


# ---------------------------------------------------------------------------------------------
# CUDA graphs: replayed decode steps equal eager ones
# ---------------------------------------------------------------------------------------------
def _generate_each(llm, prompts, max_tokens, logprobs=None):
    """Greedy outputs, request i running max_tokens[i] tokens."""
    from voltllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _greedy_each(llm, prompts, max_tokens):
    outs = _generate_each(llm, prompts, max_tokens)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _engine(path, graphs: bool, **kw):
    from voltllm import LLM

    llm = LLM(path, device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.3, max_num_seqs=16,
              enforce_eager=not graphs, **kw)
    g = llm.engine.runner.graphs
    assert (g is not None and bool(g.graphs)) == graphs
    return llm


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_equal_eager(hybrids, kind, dtype):
    """Five requests of different prompt and output lengths: decode batches of 5, 4, 3, 2, 1 rows replay the
    graphs of 8, 4, 4, 2, 1 rows (padding rows on the scratch state slot)."""
    _need_cuda()
    if kind not in hybrids:
        pytest.skip(f"{kind} not in this transformers")
    prompts, max_tokens = _prompts(), [40, 12, 28, 33, 20]
    kw = dict(dtype=dtype, max_num_batched_tokens=256, mamba_cache_mode="none")
    llm = _engine(hybrids[kind], True, **kw)
    got, _ = _greedy_each(llm, prompts, max_tokens)
    assert llm.engine.runner.graphs.replays > 0
    if dtype == "float32":  # an --enforce-eager engine: fp32 leaves no rounding to differ
        want, _ = _greedy_each(_engine(hybrids[kind], False, **kw), prompts, max_tokens)
        assert got == want, f"agreement {_agree(got, want):.3f}"
    else:
        # padding changes GEMM shapes and the split-KV count (max_seq_len), so bf16 rounding differs and flips this
        # random model's near-ties (whole-run agreement 0.77 on qwen3_5 at 7eb8102d, session 70: one early flip
        # changes the rest of a request). So each request must follow the same engine's eager steps (the same
        # kernels) until a near-tie of theirs, as test_engine_gpu_half holds the runs to the fp32 reference.
        graphs, llm.engine.runner.graphs = llm.engine.runner.graphs, None
        want, margins = _tokens_and_margins(_generate_each(llm, prompts, max_tokens, logprobs=2))
        llm.engine.runner.graphs = graphs
        flips = _first_flips(got, want, margins)
        print(f"\n{kind} bf16 graphs vs eager: agreement {_agree(got, want):.3f}, first flips (request, position, "
              f"eager margin) {[(r, i, round(m, 4)) for r, i, m in flips]}")
        assert all(m < HALF_FLIP_MARGIN[dtype] for _, _, m in flips), flips
    llm.engine.step()  # release the slots of the requests that finished last
    llm.engine.check_integrity()
    assert llm.engine.runner.state_cache.num_free == llm.engine.runner.state_cache.num_slots


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_cuda_graphs_prefix_cache_snapshots(hybrids, kind):
    """--mamba-cache-mode align, synchronous scheduling (decode positions get snapshots too, saved after a
    replay): the 170-token prompt decodes past 192, the next prompt extends its output to 200 tokens and
    resumes from the snapshot at 192 (taken in a replayed decode step). Graphs and eager agree on tokens,
    cached tokens and snapshot counts."""
    _need_cuda()
    if kind not in hybrids:
        pytest.skip(f"{kind} not in this transformers")
    prompts = _prompts()
    runs = []
    for graphs in (False, True):
        llm = _engine(hybrids[kind], graphs, dtype="float32", max_num_batched_tokens=64, block_size=16,
                      mamba_block_size=32, mamba_cache_mode="align", async_scheduling=False)
        snaps = llm.engine.runner.state_snapshots
        assert snaps is not None
        first, c0 = _greedy_each(llm, prompts[:1], [40])
        second = prompts[0] + first[0][:30] + [7, 7, 7]
        rest, c1 = _greedy_each(llm, [second] + prompts[1:3], [24, 24, 24])
        runs.append((first + rest, c0 + c1, snaps.num_saved, snaps.num_restored))
        llm.engine.step()
        llm.engine.check_integrity()
        if graphs:
            assert llm.engine.runner.graphs.replays > 0
    assert runs[1] == runs[0]
    assert runs[1][1] == [0, 192, 128, 0]  # 192: a snapshot of a decode step
