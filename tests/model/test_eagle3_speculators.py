"""EAGLE-3 heads in the speculators format (engine/speculators.py), CPU: a tiny head of tests/eagle3_models.py saved
again in that format (the same weights under layers.0.*, the target's embedding copied in, the layer's config nested
in transformer_layer_config, a speculators_config naming the verifier) drafts exactly as the original does: the same
drafts, greedy outputs and accepted-token counts. As vLLM: a speculators head as --speculative-config's "model"
needs no method (and takes its drafts per step from its config), and as --model it serves the verifier its config
names with the head attached. Variants not built are refused, one line each.
"""
import json
import os

import pytest

from eagle3_models import make_eagle3, to_speculators
from mtp_models import record_drafts
from spec_oracle import run_checked
from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.config import ConfigError, EngineArgs

BASE = dict(block_size=4, max_num_seqs=4, skip_tokenizer_init=True, dtype="float32")
PROMPTS = [[5, 17, 3, 99, 42, 8, 120, 61, 7, 33, 2], [7, 8], [150, 4, 4, 71, 18, 90]]


def _vocab(path):
    with open(f"{path}/config.json") as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("sp-llama")), "llama", num_hidden_layers=8)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """{name: (SpecForge-layout head, its speculators copy)}: vLLM's default layers and a 96-id draft vocabulary
    (d2t); named layers with norm_before_residual, which the speculators copy leaves to the format's default (true)."""
    out = {}
    for name, kw, drop in (("default", dict(draft_vocab=96), ()),
                           ("named", dict(layer_ids=[3, 1, 6], layout="layers.0", norm_before_residual=True, seed=1),
                            ("norm_before_residual",))):
        head = make_eagle3(str(tmp_path_factory.mktemp(f"sp-{name}")), 64, _vocab(target), **kw)
        out[name] = head, to_speculators(head, str(tmp_path_factory.mktemp(f"sp-{name}-spec")), target, target,
                                         speculative_tokens=2, drop_keys=drop)
    return out


def _spec(head, k=3, **kw):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, **kw}


def _drafting_run(monkeypatch, model, spec=None, max_tokens=14):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with monkeypatch.context() as mp:
        drafts, _ = record_drafts(mp)
        llm = LLM(model, speculative_config=spec, **BASE)
        outs = run_checked(llm, PROMPTS, sp)
    stats = llm.engine.stats().extra
    return outs, drafts, (stats["spec_draft_tokens"], stats["spec_accepted_tokens"])


@pytest.mark.parametrize("name", ["default", "named"])
def test_a_speculators_head_drafts_as_the_original(target, heads, monkeypatch, name):
    head, spec_head = heads[name]
    want = _drafting_run(monkeypatch, target, _spec(head))
    assert want[1] and want[2][0] > 0
    assert _drafting_run(monkeypatch, target, _spec(spec_head)) == want


def test_norm_before_residual_is_read_from_the_config(target, heads, tmp_path, monkeypatch):
    """The copy of a norm_before_residual head that says false drafts otherwise (the flag, absent above, is read)."""
    head, _ = heads["named"]
    wrong = to_speculators(head, str(tmp_path / "nbr-false"), target, target, norm_before_residual=False)
    assert _drafting_run(monkeypatch, target, _spec(wrong), 6)[1] != _drafting_run(monkeypatch, target, _spec(head),
                                                                                   6)[1]


def test_training_only_tensors_are_skipped(target, heads, tmp_path, monkeypatch):
    import torch

    head, _ = heads["default"]
    extra = {"verifier_norm.weight": torch.ones(64), "verifier_lm_head.weight": torch.zeros(96, 64)}
    spec_head = to_speculators(head, str(tmp_path / "extra"), target, target, tensors=extra)
    assert _drafting_run(monkeypatch, target, _spec(spec_head), 6) == _drafting_run(monkeypatch, target,
                                                                                   _spec(head), 6)


def test_detected_without_a_method(target, heads):
    """{"model": HEAD}: method eagle3 and the head's speculative_tokens (2); a given count wins; a plain draft model
    stays a draft model."""
    _, spec_head = heads["default"]
    cfg = EngineArgs(model=target, speculative_config={"model": spec_head}, device="cpu").create_engine_config()
    assert (cfg.speculative.method, cfg.speculative.num_speculative_tokens) == ("eagle3", 2)
    assert cfg.speculative.draft_hf_config.architectures == ["Eagle3LlamaForCausalLM"]
    cfg = EngineArgs(model=target, speculative_config={"model": spec_head, "num_speculative_tokens": 4},
                     device="cpu").create_engine_config()
    assert (cfg.speculative.method, cfg.speculative.num_speculative_tokens) == ("eagle3", 4)
    cfg = EngineArgs(model=target, speculative_config=_spec(spec_head, None), device="cpu").create_engine_config()
    assert cfg.speculative.num_speculative_tokens == 2
    cfg = EngineArgs(model=target, speculative_config={"model": target, "num_speculative_tokens": 2},
                     device="cpu").create_engine_config()
    assert cfg.speculative.method == "draft_model"


def test_as_the_model_it_serves_its_verifier(target, heads, monkeypatch):
    """--model HEAD: the verifier its config names is served (under that name) with the head as drafter, its drafts
    per step from the config unless --speculative-config gives them; "method" and "model" stay the head's."""
    head, spec_head = heads["default"]
    cfg = EngineArgs(model=spec_head, device="cpu").create_engine_config()
    assert cfg.model.model == target and cfg.model.served_model_name == target
    assert cfg.speculative.model == spec_head and cfg.speculative.method == "eagle3"
    assert cfg.speculative.num_speculative_tokens == 2
    cfg = EngineArgs(model=spec_head, speculative_config={"num_speculative_tokens": 3, "method": "ngram",
                                                          "draft_sample_method": "greedy"},
                     device="cpu").create_engine_config()
    assert (cfg.speculative.method, cfg.speculative.num_speculative_tokens) == ("eagle3", 3)
    assert cfg.speculative.draft_sample_method == "greedy" and cfg.speculative.model == spec_head
    assert _drafting_run(monkeypatch, spec_head, {"num_speculative_tokens": 3}) == _drafting_run(
        monkeypatch, target, _spec(head))


def test_as_the_model_an_unloadable_verifier_is_named(target, heads, tmp_path):
    head, _ = heads["default"]
    spec_head = to_speculators(head, str(tmp_path / "elsewhere"), "/models/absent-verifier", target)
    with pytest.raises(ConfigError, match="speculators EAGLE-3 head whose verifier /models/absent-verifier cannot "
                                          "be loaded .*--speculative-config '\\{\"model\""):
        EngineArgs(model=spec_head, device="cpu").create_engine_config()


@pytest.mark.parametrize("what,kw,match", [
    # (an EAGLE-3 head's tensors labelled as an EAGLE-1 head: each method names the other)
    ("eagle1", dict(speculators_model_type="eagle"), "use method \"eagle"),
    ("peagle", dict(speculators_model_type="peagle"), "parallel drafting is not built"),
    ("mtp", dict(speculators_model_type="mtp"), "speculators_model_type 'mtp' is not read"),
    ("qwen3", dict(layer=dict(model_type="qwen3")), "model_type 'qwen3'.*Llama layer only"),
    ("norm_before_fc", dict(norm_before_fc=True), "norm_before_fc .* is not built"),
    ("fc_norm", dict(fc_norm=True), "fc_norm .* is not built"),
    ("norm_output", dict(norm_output=True), "norm_output .* is not built"),
    ("layers", dict(layer=dict(num_hidden_layers=2)), "only one-layer heads"),
])
def test_unbuilt_variants_are_refused(target, heads, tmp_path, what, kw, match):
    """Each refused with method eagle3, detected without one, and as --model."""
    head, _ = heads["default"]
    spec_head = to_speculators(head, str(tmp_path / what), target, target)
    if "layer" in kw:
        with open(os.path.join(spec_head, "config.json")) as f:
            cfg = json.load(f)
        cfg["transformer_layer_config"].update(kw.pop("layer"))
        with open(os.path.join(spec_head, "config.json"), "w") as f:
            json.dump(cfg, f)
    if kw:
        to_speculators(head, spec_head, target, target, **kw)
    for args in (dict(model=target, speculative_config=_spec(spec_head)),
                 dict(model=target, speculative_config={"model": spec_head}), dict(model=spec_head)):
        with pytest.raises(ConfigError, match=match):
            EngineArgs(device="cpu", **args).create_engine_config()


def test_no_drafts_per_step_anywhere(target, heads, tmp_path):
    head, _ = heads["default"]
    spec_head = to_speculators(head, str(tmp_path / "no-k"), target, target)
    with open(os.path.join(spec_head, "config.json")) as f:
        cfg = json.load(f)
    cfg["speculators_config"]["proposal_methods"] = []
    with open(os.path.join(spec_head, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ConfigError, match="no proposal_methods: give num_speculative_tokens"):
        EngineArgs(model=target, speculative_config={"model": spec_head}, device="cpu").create_engine_config()
    cfg = EngineArgs(model=target, speculative_config={"model": spec_head, "num_speculative_tokens": 1},
                     device="cpu").create_engine_config()
    assert cfg.speculative.num_speculative_tokens == 1
