"""Draft-model speculative decoding on the GPU: the draft's proposal steps and its run beside each step replay its
own decode CUDA graphs (on the target's input buffers); greedy outputs equal plain decoding in fp32 (native and
--compat sm70) and agree in fp16 except at near-ties; graphs and eager give the same tokens; the self-draft accepts
(nearly) everything, greedy and sampled; seeded sampled requests repeat; the KV blocks hold the draft's layers too."""
import os
import shutil

import pytest
import torch

from tiny_models import make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "0123456789 0123456789 0123", "Hi"] * 3
KW = dict(device="cuda", max_model_len=512, gpu_memory_utilization=0.2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("draft")
    target = make_model(str(root / "target"), "llama")
    near = str(root / "near")
    shutil.copytree(target, near)
    file = os.path.join(near, "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in load_file(file).items()}, file,
              metadata={"format": "pt"})
    return {"self": target, "near": near}


def _spec(draft, k=3):
    return {"model": draft, "num_speculative_tokens": k}


def _tokens(llm, sp):
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    llm.engine.check_integrity()
    return out


@pytest.mark.parametrize("compat", ["none", "sm70"])
@pytest.mark.parametrize("draft", ["self", "near"])
def test_fp32_greedy_equals_plain_decoding(models, compat, draft):
    kw = dict(KW, dtype="float32", compat=compat)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ref = _tokens(LLM(models["self"], **kw), sp)
    llm = LLM(models["self"], speculative_config=_spec(models[draft]), **kw)
    assert llm.engine.runner.draft.graphs is not None and llm.engine.runner.draft.graphs.graphs
    assert _tokens(llm, sp) == ref
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] > 0
    if draft == "self":  # (one-row and many-row kernels may round differently: near-ties may disagree)
        assert extra["spec_accepted_tokens"] >= 0.95 * extra["spec_draft_tokens"]


def test_graphs_equal_eager(models):
    kw = dict(KW, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    eager = _tokens(LLM(models["self"], speculative_config=_spec(models["near"]), enforce_eager=True, **kw), sp)
    assert _tokens(LLM(models["self"], speculative_config=_spec(models["near"]), **kw), sp) == eager


def test_fp16_agrees_with_plain_decoding(models):
    kw = dict(KW, dtype="float16")
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ref = _tokens(LLM(models["self"], **kw), sp)
    got = _tokens(LLM(models["self"], speculative_config=_spec(models["near"], 4), **kw), sp)
    agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
    assert agree >= 0.9, agree


def test_sampled_requests_speculate_and_repeat(models):
    """Drafts drawn from the draft's distribution (Sampler.draw_drafts on the GPU), verified with p / q; the
    self-draft accepts nearly all; seeded requests repeat from run to run."""
    kw = dict(KW, dtype="float16")
    sp = SamplingParams(temperature=2.0, seed=3, max_tokens=48, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(models["self"], speculative_config=_spec(models["self"]), **kw)
        runs.append(_tokens(llm, sp))
        extra = llm.engine.stats().extra
        assert extra["spec_accepted_tokens"] >= 0.9 * extra["spec_draft_tokens"] > 0
    assert runs[0] == runs[1] and all(len(t) == 48 for t in runs[0])


def test_kv_blocks_hold_the_draft_too(models):
    """A block's bytes are the target's and the draft's (twice for a self-draft), and the memory sizing (which
    profiles the draft's forward too) still leaves a cache for both."""
    kw = dict(KW, dtype="float16", enforce_eager=True)
    plain = LLM(models["self"], **kw).engine
    with_draft = LLM(models["self"], speculative_config=_spec(models["self"]), **kw).engine
    assert with_draft.runner.kv_block_bytes() == 2 * plain.runner.kv_block_bytes()
    assert with_draft.runner.draft.kv_caches[0].shape[1] == with_draft.kv.num_blocks > 0
