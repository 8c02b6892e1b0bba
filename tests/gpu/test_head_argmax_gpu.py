"""The greedy LM head with its argmax in the decode-batch GEMM's epilogue (kernels/batch_gemm.py `argmax_out`,
kernels/argmax.py `argmax_of_partials`) on CUDA: at the 8B's head shape (every split-K-free config) and odd ones, fp16
and bf16, PDL on, eager and replayed from a CUDA graph, it gives the argmax of the same tile's rounded output (and
torch's argmax of cuBLAS's logits wherever their top two are not within rounding); an engine (whose start-up tuner
timed the epilogue) generates the same greedy tokens with it as with the same tile followed by the argmax kernel."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu


def _configs():
    from voltllm.kernels.batch_gemm import CONFIGS, TMA_CONFIGS, tma_supported

    return [c for c in CONFIGS + (TMA_CONFIGS if tma_supported(torch.device("cuda")) else ()) if c[4] == 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n,k", [(151936, 4096), (49152, 576), (1003, 328)])
def test_argmax_epilogue_matches_its_plain_tile(n, k, dtype):
    """Every split-K-free tile at the 8B head's shape in fp16; elsewhere one pointer and one TMA tile (compile time)."""
    from voltllm.kernels import pdl
    from voltllm.kernels.batch_gemm import batch_gemm

    seed = random.SystemRandom().randrange(1 << 30)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, dtype=dtype, device="cuda", generator=g) / k ** 0.5
    w[n - 1] *= 1.5  # the row's maximum often in the last, partial tile
    pdl.configure(True)
    try:
        for m in (2, 17, 64):
            x = torch.randn(m, k, dtype=dtype, device="cuda", generator=g)
            lib = torch.nn.functional.linear(x, w).float()
            top2 = lib.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 1e-2 * top2[:, 0].abs()  # no near-tie: cuBLAS must agree too
            configs = _configs()
            if (n, k) != (151936, 4096) or dtype != torch.float16:
                configs = [c for c in configs if len(c) == 5][:1] + [c for c in configs if len(c) == 6][:1]
            for cfg in configs:
                got = torch.full((m,), -5, dtype=torch.long, device="cuda")
                batch_gemm(x, w, config=cfg, argmax_out=got)
                plain = batch_gemm(x, w, config=cfg)
                assert torch.equal(got, plain.argmax(dim=-1)), (seed, n, k, m, cfg)
                assert torch.equal(got[clear], lib.argmax(dim=-1)[clear]), (seed, n, k, m, cfg)
    finally:
        pdl.configure(False)


def test_argmax_epilogue_in_graph_and_edges():
    """PDL on: replays of a captured argmax head (fresh rows copied in) give the eager tokens; then the edges through a
    bias: a row of -inf logits everywhere (index 0), +inf in two tiles (the first), a NaN column (it outranks all)."""
    from voltllm.kernels import pdl
    from voltllm.kernels.batch_gemm import batch_gemm

    g = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(1 << 30))
    w = torch.randn(151936, 4096, dtype=torch.float16, device="cuda", generator=g) / 64
    x = torch.randn(64, 4096, dtype=torch.float16, device="cuda", generator=g)
    cfg = (64, 64, 4, 5, 1)
    out = torch.empty(64, dtype=torch.long, device="cuda")
    pdl.configure(True)
    try:
        batch_gemm(x, w, config=cfg, argmax_out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            batch_gemm(x, w, config=cfg, argmax_out=out)
        for _ in range(3):
            x.copy_(torch.randn(64, 4096, dtype=torch.float16, device="cuda", generator=g))
            out.fill_(-1)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, batch_gemm(x, w, config=cfg).argmax(dim=-1))
        bias = torch.zeros(151936, dtype=torch.float16, device="cuda")
        bias[:] = float("-inf")
        got = batch_gemm(x, w, bias, config=cfg, argmax_out=torch.empty_like(out))
        assert torch.equal(got, torch.zeros_like(out))
        bias[:] = 0
        bias[5000] = bias[150000] = float("inf")
        got = batch_gemm(x, w, bias, config=cfg, argmax_out=torch.empty_like(out))
        assert torch.equal(got, torch.full_like(out, 5000))
        w[70000] = float("nan")
        w[140000] = float("nan")
        got = batch_gemm(x, w, bias, config=cfg, argmax_out=torch.empty_like(out))
        assert torch.equal(got, torch.full_like(out, 70000))
    finally:
        pdl.configure(False)


def test_head_argmax_engine_generates_the_same(tmp_path, monkeypatch):
    """A random Qwen3-shaped model (untied head): 24 greedy tokens for 16 prompts with the LM head's argmax epilogue on
    every row count equal the run with the head on the same tile and the argmax kernel after it (same engine, same
    weights: the tile's rounding is the same, only where the argmax is taken moves); the tuner's choice is logged."""
    from tiny_models import make_model

    from voltllm import LLM, SamplingParams

    path = make_model(str(tmp_path / "m"), "qwen3", hidden_size=256, intermediate_size=512, head_dim=64)
    llm = LLM(path, device="cuda", dtype="float16", gpu_memory_utilization=0.3, max_num_seqs=16)
    model = llm.engine.runner.model
    prompts = [f"prompt {i} " * (3 + i) for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, ignore_eos=True)
    cfg = (64, 64, 4, 5, 1)
    model.logits_batch = {r: cfg for r in range(2, 17)}
    model.logits_argmax = {}
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model.logits_argmax = {r: cfg for r in range(2, 17)}
    taken, sampler = [], llm.engine.runner.sampler
    real = sampler.argmax_output  # (the instance's: route counters may wrap it)
    monkeypatch.setattr(sampler, "argmax_output", lambda t: taken.append(t.shape[0]) or real(t))
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert on == off
    assert len(taken) >= 24 and max(taken) == 16, taken  # every step of the batch took the epilogue
    llm.engine.check_integrity()
