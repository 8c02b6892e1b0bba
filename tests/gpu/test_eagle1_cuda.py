"""EAGLE-1 speculation on the GPU (tiny random llama / qwen2 targets with random heads in the EAGLE repo's layout,
tests/eagle1_models.py): with the target's decode CUDA graphs and the head's own (MTPRunner's graphs), fp32 draft
logits equal the float64 reference of the head's math and greedy tokens equal plain decoding's (native and --compat
sm70, chunked prompts beside verifications); the head's graph replays give --enforce-eager's drafts exactly in fp32;
fp16 sampled requests repeat by seed."""
from __future__ import annotations

import json

import pytest
import torch

from eagle1_models import Eagle1Reference, make_eagle1
from mtp_models import check_against_reference, record_draft_logits, record_drafts
from tiny_models import make_model

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 3) % 190 for i in range(13)], [(5 * i + 1) % 190 for i in range(29)], [7, 8],
           [(3 * i + 2) % 190 for i in range(41)]]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (target, head): a llama target with a one-layer head (fc bias), a qwen2 one with a two-layer HASS head
    (q / k / v biases, both fc inputs normed, a logit scale)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    made = {}
    for kind, kw in (("llama", {}), ("qwen2", dict(kind="qwen2", layers=2, fc_bias=False, para_norm=True,
                                                   logit_scale=0.7, seed=2))):
        target = make_model(str(tmp_path_factory.mktemp(f"g1-{kind}")), kind)
        with open(f"{target}/config.json") as f:
            cfg = json.load(f)
        made[kind] = target, make_eagle1(str(tmp_path_factory.mktemp(f"g1-{kind}-head")), cfg["hidden_size"],
                                         cfg["vocab_size"], **kw)
    return made


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
    return {"method": "eagle", "model": head, "num_speculative_tokens": k, **kw}


@pytest.mark.parametrize("kind,compat,budget", [("llama", "none", 512), ("qwen2", "none", 512),
                                                ("llama", "sm70", 512), ("qwen2", "none", 20)])
def test_fp32_logits_equal_reference_and_tokens_plain(pairs, monkeypatch, kind, compat, budget):
    target, head = pairs[kind]
    kw = dict(dtype="float32", compat=compat, max_num_batched_tokens=budget)
    plain = _run(_llm(target, **kw), PROMPTS, _greedy())
    seen = record_draft_logits(monkeypatch)
    llm = _llm(target, speculative_config=_spec(head), **kw)
    assert llm.engine.runner.draft.graphs is not None
    outs = _run(llm, PROMPTS, _greedy())
    assert outs == plain
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(PROMPTS, outs)}
    assert check_against_reference(Eagle1Reference(target, head), seen, fulls, 3, atol=2e-3) >= 3 * len(PROMPTS)


def test_graph_replays_give_the_eager_drafts(pairs, monkeypatch):
    target, head = pairs["llama"]
    runs = []
    for eager in (True, False):
        with monkeypatch.context() as mp:
            drafts, counts = record_drafts(mp)
            llm = _llm(target, dtype="float32", enforce_eager=eager, speculative_config=_spec(head))
            runs.append((_run(llm, PROMPTS, _greedy(30)), list(drafts), dict(counts)))
    (eager_out, eager_drafts, eager_counts), (graph_out, graph_drafts, counts) = runs
    assert graph_out == eager_out and graph_drafts == eager_drafts
    assert eager_counts == {"chained": 0, "step": 0} and counts["chained"] > 0 and counts["step"] > 0


def test_fp16_sampled_requests_repeat(pairs):
    from voltllm import SamplingParams

    target, head = pairs["qwen2"]
    llm = _llm(target, dtype="float16", speculative_config=_spec(head))
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=11)
    assert _run(llm, PROMPTS, sp) == _run(llm, PROMPTS, sp)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
