"""EAGLE-3 speculation on the GPU (tiny random llama / qwen3 / qwen3_5 hybrid targets with random heads in the public
checkpoint format, tests/eagle3_models.py): with the target's decode CUDA graphs and the head's own
(worker/eagle3_runner.py, MTPRunner's graphs), fp32 draft logits equal the float64 reference of the head's math and
greedy tokens equal plain decoding's (native and --compat sm70, chunked prompts beside verifications); the head's
graph replays give --enforce-eager's drafts and tokens exactly in fp32 (K = 1 and 3, padded batches, requests joining
and finishing mid-run) and agree in fp16; an fp16 head that always agrees accepts every draft; sampled requests
repeat by seed; the drafter's enforce_eager keeps the target's graphs."""
from __future__ import annotations

import json

import pytest
import torch

from eagle3_models import Eagle3Reference, make_eagle3
from mtp_models import check_against_reference, record_draft_logits, record_drafts
from tiny_models import HYBRID_VOCAB, make_model, make_tiny_hybrid

pytestmark = pytest.mark.gpu

V = HYBRID_VOCAB  # prompt ids below the tiny tokenizer's vocabulary and the hybrid's
PROMPTS = [[(7 * i + 3) % V for i in range(13)], [(5 * i + 1) % V for i in range(29)], [7, 8]]
GRAPH_PROMPTS = PROMPTS + [[(3 * i + 2) % V for i in range(41)], [(11 * i) % V for i in range(9)]]


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


def _vocab(path):
    with open(f"{path}/config.json") as f:
        return json.load(f)["vocab_size"]


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


def _spec(head, k=3, **kw):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, **kw}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (target, head, layer ids): a llama target (vLLM's default layers, 96-id draft vocabulary with d2t) and
    a qwen3 one (named layers, its own embedding, the target's LM head, norm_before_residual)."""
    llama = make_model(str(tmp_path_factory.mktemp("g-llama")), "llama", num_hidden_layers=8)
    qwen3 = make_model(str(tmp_path_factory.mktemp("g-qwen3")), "qwen3", num_hidden_layers=4)
    hybrid = make_tiny_hybrid(str(tmp_path_factory.mktemp("g-hybrid")), "qwen3_5", seed=0, gen_seed=1)
    made = {} if hybrid is None else {
        "hybrid": (hybrid, make_eagle3(str(tmp_path_factory.mktemp("g-hybrid-head")), 64, HYBRID_VOCAB,
                                       draft_vocab=64, layer_ids=[1, 2, 3], seed=3), [1, 2, 3])}
    return made | {
        "llama": (llama, make_eagle3(str(tmp_path_factory.mktemp("g-llama-head")), 64, _vocab(llama),
                                     draft_vocab=96), [2, 4, 5]),
        "qwen3": (qwen3, make_eagle3(str(tmp_path_factory.mktemp("g-qwen3-head")), 64, _vocab(qwen3),
                                     layer_ids=[3, 1, 2], layout="layers.0", own_embedding=True, own_lm_head=False,
                                     norm_before_residual=True, seed=1), [1, 2, 3]),
    }


@pytest.mark.parametrize("kind,compat,budget", [("llama", "none", 512), ("qwen3", "none", 512),
                                                ("llama", "sm70", 512), ("llama", "none", 20),
                                                ("hybrid", "none", 512), ("hybrid", "none", 20)])
def test_fp32_reference_and_plain(pairs, monkeypatch, kind, compat, budget):
    """(a qwen3_5 hybrid: its verification steps replay the walks graphs, the head's pass after them its own)"""
    _cuda()
    if kind not in pairs:
        pytest.skip("this transformers has no qwen3_5")
    target, head, ids = pairs[kind]
    kw = dict(dtype="float32", compat=compat, max_num_batched_tokens=budget)
    ref = _run(_llm(target, **kw), PROMPTS, _greedy())
    seen = record_draft_logits(monkeypatch)
    llm = _llm(target, speculative_config=_spec(head), **kw)
    got = _run(llm, PROMPTS, _greedy())
    assert got == ref
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(PROMPTS, got)}
    assert check_against_reference(Eagle3Reference(target, head, ids), seen, fulls, 3, atol=2e-3) > 0
    assert llm.engine.runner.draft.graphs is not None
    if kind == "hybrid" and budget == 512:
        assert llm.engine.runner.verify_graphs is not None and llm.engine.runner.verify_graphs.replays > 0


def test_fp16_agreeing_head_accepts_every_draft(tmp_path_factory):
    """Zero LM heads (target and head): every argmax is token 0 in fp16 too, so every draft is accepted."""
    _cuda()
    from safetensors.torch import load_file, save_file

    target = make_model(str(tmp_path_factory.mktemp("g-zero")), "qwen3", num_hidden_layers=4)
    sd = load_file(f"{target}/model.safetensors")
    sd["lm_head.weight"].zero_()
    save_file(sd, f"{target}/model.safetensors", metadata={"format": "pt"})
    head = make_eagle3(str(tmp_path_factory.mktemp("g-zero-head")), 64, _vocab(target), layer_ids=[1, 2, 3],
                       zero_lm_head=True)
    m, k = 25, 3
    llm = _llm(target, dtype="float16", speculative_config=_spec(head, k))
    steps0 = llm.engine.stats().step_counter
    assert _run(llm, PROMPTS[:1], _greedy(m)) == [[0] * m]
    stats = llm.engine.stats()
    assert stats.extra["spec_accepted_tokens"] == stats.extra["spec_draft_tokens"] > 0
    assert stats.step_counter - steps0 == 1 + -(-(m - 1) // (k + 1))


def test_sampled_requests_repeat(pairs):
    _cuda()
    from voltllm import SamplingParams

    target, head, _ = pairs["llama"]
    sps = [_greedy(), SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)] * 2
    runs = [_run(_llm(target, dtype="float32", speculative_config=_spec(head, 2)), PROMPTS[:2] * 2, sps)
            for _ in range(2)]
    assert runs[0] == runs[1]


def _graph_vs_eager(pair, monkeypatch, dtype, k):
    from voltllm import SamplingParams

    target, head, _ = pair
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 11, 30, 17, 6)]
    runs = []
    for eager in (True, False):
        with monkeypatch.context() as mp:
            drafts, counts = record_drafts(mp)
            llm = _llm(target, dtype=dtype, enforce_eager=eager, max_num_batched_tokens=24,
                       speculative_config=_spec(head, k))
            runs.append((_run(llm, GRAPH_PROMPTS, sps), drafts, dict(counts)))
            assert (llm.engine.runner.draft.graphs is None) == eager
            del llm
    (eager_out, eager_drafts, eager_counts), (graph_out, graph_drafts, counts) = runs
    assert eager_counts == {"chained": 0, "step": 0}
    assert counts["step"] > 0 and (counts["chained"] > 0) == (k > 1)
    return eager_out, graph_out, eager_drafts, graph_drafts


@pytest.mark.parametrize("kind,k", [("llama", 1), ("llama", 3), ("qwen3", 3), ("hybrid", 3)])
def test_fp32_graphs_equal_eager(pairs, monkeypatch, kind, k):
    _cuda()
    if kind not in pairs:
        pytest.skip("this transformers has no qwen3_5")
    eager_out, graph_out, eager_drafts, graph_drafts = _graph_vs_eager(pairs[kind], monkeypatch, "float32", k)
    assert graph_out == eager_out
    assert graph_drafts == eager_drafts and len(graph_drafts) > 5


def test_fp16_graphs_agree_with_eager(pairs, monkeypatch):
    """fp16 (rounding may differ with the padded rows' kernels): the first tokens equal, most drafts agree."""
    _cuda()
    eager_out, graph_out, eager_drafts, graph_drafts = _graph_vs_eager(pairs["llama"], monkeypatch, "float16", 3)
    assert all(a[:4] == b[:4] for a, b in zip(eager_out, graph_out))
    pairs_ = [(x, y) for a, b in zip(eager_drafts, graph_drafts) if len(a[0]) == len(b[0])
              for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    assert pairs_ and sum(x == y for x, y in pairs_) >= 0.8 * len(pairs_)


def test_drafter_enforce_eager_keeps_the_target_graphs(pairs):
    _cuda()
    target, head, _ = pairs["llama"]
    ref = _run(_llm(target, dtype="float32", speculative_config=_spec(head, 2)), PROMPTS, _greedy())
    llm = _llm(target, dtype="float32", speculative_config=_spec(head, 2, enforce_eager=True))
    assert llm.engine.runner.draft.graphs is None and llm.engine.runner.graphs is not None
    assert _run(llm, PROMPTS, _greedy()) == ref
