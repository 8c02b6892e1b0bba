"""MTP speculation on the GPU (tiny random qwen3_5 / qwen3_next / qwen3_5_moe targets with random mtp.* weights,
tests/mtp_models.py): with decode and verification-walks CUDA graphs, fp32 draft logits equal the float64 reference
of the MTP math and greedy tokens equal plain decoding's (native and --compat sm70, chunked prompts beside
verifications); fp16 with an agreeing module (zero LM head) accepts every draft; sampled requests repeat by seed.
The MTP's own passes replay CUDA graphs (worker/mtp_runner.py): fp32 drafts and tokens equal --enforce-eager's exactly
(K = 1..3, padded batches, requests joining and finishing mid-run), fp16 ones agree."""
from __future__ import annotations

import pytest
import torch

from mtp_models import MTPReference, check_against_reference, make_mtp_target, record_draft_logits, record_drafts
from tiny_models import HYBRID_VOCAB

pytestmark = pytest.mark.gpu

KINDS = ["qwen3_5", "qwen3_next", "qwen3_5_moe"]
PROMPTS = [[(7 * i + 3) % HYBRID_VOCAB for i in range(13)], [(5 * i + 1) % HYBRID_VOCAB for i in range(29)], [7, 8]]


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


def _llm(path, **kw):
    from voltllm import LLM

    return LLM(path, device="cuda", skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=32, block_size=16,
               gpu_memory_utilization=0.3, **kw)


def _run(llm, prompts, sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


def _greedy(n=24):
    from voltllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    made = {k: make_mtp_target(tmp_path_factory, k) for k in KINDS}
    return {k: v for k, v in made.items() if v is not None}


@pytest.mark.parametrize("kind,compat,budget", [("qwen3_5", "none", 512), ("qwen3_next", "none", 512),
                                                ("qwen3_5_moe", "none", 512), ("qwen3_5", "sm70", 512),
                                                ("qwen3_5", "none", 20)])
def test_fp32_reference_and_plain(targets, monkeypatch, kind, compat, budget):
    _cuda()
    if kind not in targets:
        pytest.skip(f"this transformers has no {kind}")
    path, mtp = targets[kind]
    kw = dict(dtype="float32", compat=compat, max_num_batched_tokens=budget)
    ref = _run(_llm(path, **kw), PROMPTS, _greedy())
    seen = record_draft_logits(monkeypatch)
    llm = _llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **kw)
    got = _run(llm, PROMPTS, _greedy())
    assert got == ref
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(PROMPTS, got)}
    assert check_against_reference(MTPReference(path, mtp), seen, fulls, 3, atol=2e-3) > 0
    if budget == 512 and compat == "none":
        assert llm.engine.runner.verify_graphs is not None and llm.engine.runner.verify_graphs.replays > 0


def test_fp16_agreeing_module_accepts_every_draft(tmp_path_factory):
    """Zero LM head: every argmax is token 0 in fp16 too (no near-ties), so every draft is accepted."""
    _cuda()
    path, _ = make_mtp_target(tmp_path_factory, "qwen3_5", zero_lm_head=True)
    m, k = 25, 3
    llm = _llm(path, dtype="float16", speculative_config={"method": "mtp", "num_speculative_tokens": k})
    steps0 = llm.engine.stats().step_counter
    assert _run(llm, PROMPTS[:1], _greedy(m)) == [[0] * m]
    stats = llm.engine.stats()
    assert stats.extra["spec_accepted_tokens"] == stats.extra["spec_draft_tokens"] > 0
    assert stats.step_counter - steps0 == 1 + -(-(m - 1) // (k + 1))


def test_sampled_requests_repeat(targets):
    _cuda()
    from voltllm import SamplingParams

    path, _ = targets["qwen3_5"]
    sps = [_greedy(), SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)] * 2
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    runs = [_run(_llm(path, dtype="float32", speculative_config=spec), PROMPTS[:2] * 2, sps) for _ in range(2)]
    assert runs[0] == runs[1]


# five requests (batches of 5, 4, ... pad to the graphs' 8 / 4 rows; verification rows to 16 / 32), finishing at
# different steps; the last two join while the first three decode (a 24-token budget chunks their prompts)
GRAPH_PROMPTS = PROMPTS + [[(3 * i + 2) % HYBRID_VOCAB for i in range(41)], [(11 * i) % HYBRID_VOCAB for i in range(9)]]


def _graph_vs_eager(path, monkeypatch, dtype, k):
    from voltllm import SamplingParams

    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 11, 30, 17, 6)]
    runs = []
    for eager in (True, False):
        with monkeypatch.context() as mp:
            drafts, counts = record_drafts(mp)
            llm = _llm(path, dtype=dtype, enforce_eager=eager, max_num_batched_tokens=24,
                       speculative_config={"method": "mtp", "num_speculative_tokens": k})
            runs.append((_run(llm, GRAPH_PROMPTS, sps), drafts, dict(counts)))
            mtp_graphs = llm.engine.runner.draft.graphs
            assert (mtp_graphs is None) == eager
            del llm
    (eager_out, eager_drafts, eager_counts), (graph_out, graph_drafts, counts) = runs
    assert eager_counts == {"chained": 0, "step": 0}
    assert counts["step"] > 0 and (counts["chained"] > 0) == (k > 1)
    return eager_out, graph_out, eager_drafts, graph_drafts


@pytest.mark.parametrize("kind,k", [("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_5", 3), ("qwen3_next", 3),
                                    ("qwen3_5_moe", 3)])
def test_fp32_graphs_equal_eager(targets, monkeypatch, kind, k):
    """fp32: the MTP's graph replays give the eager form's drafts and tokens exactly."""
    _cuda()
    if kind not in targets:
        pytest.skip(f"this transformers has no {kind}")
    eager_out, graph_out, eager_drafts, graph_drafts = _graph_vs_eager(targets[kind][0], monkeypatch, "float32", k)
    assert graph_out == eager_out
    assert graph_drafts == eager_drafts and len(graph_drafts) > 5


def test_fp16_graphs_agree_with_eager(targets, monkeypatch):
    """fp16 (rounding may differ with the padded rows' kernels): the first tokens equal, most drafts agree."""
    _cuda()
    eager_out, graph_out, eager_drafts, graph_drafts = _graph_vs_eager(targets["qwen3_5"][0], monkeypatch,
                                                                       "float16", 3)
    assert all(a[:4] == b[:4] for a, b in zip(eager_out, graph_out))
    pairs = [(x, y) for a, b in zip(eager_drafts, graph_drafts) if len(a[0]) == len(b[0])
             for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    assert pairs and sum(x == y for x, y in pairs) >= 0.8 * len(pairs)


def test_drafter_enforce_eager_keeps_the_target_graphs(targets):
    """vLLM's speculative-config enforce_eager: the MTP runs without its graphs, the target keeps its decode graphs;
    fp32 tokens equal those of the MTP with graphs."""
    _cuda()
    path, _ = targets["qwen3_5"]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    ref = _run(_llm(path, dtype="float32", speculative_config=spec), PROMPTS, _greedy())
    llm = _llm(path, dtype="float32", speculative_config={**spec, "enforce_eager": True})
    assert llm.engine.runner.draft.graphs is None and llm.engine.runner.graphs is not None
    assert _run(llm, PROMPTS, _greedy()) == ref
