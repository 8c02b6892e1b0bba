"""DFlash speculation on the GPU: the block rows through the Triton decode attention (each row's context covers the
whole block), the context K / V written with the backend's store beside decode-graph and prompt-graph steps (the
target's chosen layers' outputs captured inside its graphs): the drafter's logits equal the float64 reference in
fp32; greedy outputs equal plain decoding in fp32 (native and --compat sm70); an always-agreeing drafter is always
accepted; fp16 runs."""
import json
import os

import pytest
import torch

from dflash_models import load_weights, make_dflash, reference_block_logits
from tiny_models import make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "0123456789 0123456789 0123", "Hi"] * 3
KW = dict(device="cuda", max_model_len=512, gpu_memory_utilization=0.2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("dflash")
    target = make_model(str(root / "target"), "qwen3")
    with open(os.path.join(target, "config.json")) as f:
        c = json.load(f)
    hidden, vocab, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    agree = make_model(str(root / "agree"), "qwen3")
    file = os.path.join(agree, "model.safetensors")
    w = load_file(file)
    w["lm_head.weight"] = torch.zeros_like(w["lm_head.weight"])
    save_file(w, file, metadata={"format": "pt"})
    return {"target": target, "agree": agree, "layers": [0, layers - 1],
            "drafter": make_dflash(str(root / "drafter"), hidden, vocab, layers, [0, layers - 1], block_size=8)}


def _spec(path, k=5):
    return {"method": "dflash", "model": path, "num_speculative_tokens": k}


def _tokens(llm, sp, prompts=PROMPTS):
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    llm.engine.check_integrity()
    return out


@pytest.mark.parametrize("compat", ["none", "sm70"])
def test_fp32_greedy_equals_plain_decoding(models, compat):
    kw = dict(KW, dtype="float32", compat=compat)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = _tokens(LLM(models["target"], **kw), sp)
    llm = LLM(models["target"], speculative_config=_spec(models["drafter"]), **kw)
    assert llm.engine.runner.graphs is not None  # the target's graphs capture the hidden-state writes
    drafter_graphs = llm.engine.runner.draft.graphs
    assert _tokens(llm, sp) == ref
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    assert drafter_graphs.replays > 0  # blocks of up to max_num_seqs rows replay the drafter's graphs


def test_fp32_block_logits_equal_the_reference(models):
    from transformers import AutoModelForCausalLM

    llm = LLM(models["target"], speculative_config=_spec(models["drafter"]), dtype="float32", **KW)
    dr = llm.engine.runner.draft
    records = []
    orig_logits, orig_propose = dr.drafter.compute_logits, dr.propose

    def logits_spy(h):
        out = orig_logits(h)
        records[-1]["logits"] = out.detach().double().cpu()
        return out

    def propose_spy(sched):
        records.append({"rows": [(list(s.request.all_token_ids), s.start, len(s.spec_tokens))
                                 for s in sched.scheduled if s.spec_tokens]})
        orig_propose(sched)

    dr.drafter.compute_logits, dr.propose = logits_spy, propose_spy
    _tokens(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), PROMPTS[:4])
    ref_model = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float64).eval()
    w = load_weights(models["drafter"])
    embed = ref_model.get_input_embeddings().weight.detach()
    head = ref_model.get_output_embeddings().weight.detach()
    checked = 0
    for rec in records:
        if not rec["rows"]:
            continue
        n = len(rec["rows"])
        for i, (ids, start, k) in enumerate(rec["rows"]):
            with torch.no_grad():
                hs = ref_model(torch.tensor([ids[:start]]), output_hidden_states=True).hidden_states
            feats = torch.cat([hs[layer + 1][0] for layer in models["layers"]], dim=-1)
            ref = reference_block_logits(w, feats, [ids[start]] + [3] * k, embed, head)
            got = rec["logits"][[j * n + i for j in range(k)]]
            assert (got - ref).abs().max() / ref.abs().max() < 1e-3
            checked += 1
    assert checked >= 8


def test_agreeing_drafter_is_always_accepted(models):
    drafter = models["drafter"]
    llm = LLM(models["agree"], speculative_config=_spec(drafter, 7), dtype="float16", **KW)
    sp = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)
    ref = _tokens(LLM(models["agree"], dtype="float16", **KW), sp)
    assert _tokens(llm, sp) == ref
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] == extra["spec_draft_tokens"] > 0


def test_fp16_sampled_and_greedy_run(models):
    llm = LLM(models["target"], speculative_config=_spec(models["drafter"]), dtype="float16", **KW)
    sp = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=1)
    assert _tokens(llm, sp) == _tokens(llm, sp)
    _tokens(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
