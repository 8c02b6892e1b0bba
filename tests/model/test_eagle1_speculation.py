"""EAGLE-1 speculation (CPU): tiny random heads in the EAGLE repo's layout (tests/eagle1_models.py) beside a tiny llama
target (one llama layer, fc with a bias, the checkpoint's own embedding copy not read), a tiny qwen2 target (a HASS
head of two qwen2 layers: q / k / v biases, the second layer's input norm, both fc inputs normed; a logit scale) and a
tiny qwen3_5 hybrid:

- every draft logit of every proposal (first draft and chained passes) equals a float64 reference of the head's math
  fed by transformers' last hidden states of the target, through chunked prefill, rejected drafts and concurrent
  requests; the reference reading another target state fails the same check;
- greedy outputs equal plain decoding's, with oracle drafts accepted and rejected; seeded sampled runs repeat;
- the graph form (CPU stand-ins of the decode graphs) gives the eager form's drafts;
- configuration refusals (an EAGLE-3 head, a whole model, missing tensors, a foreign layer kind).
"""
import json
import random

import pytest

from eagle1_models import Eagle1Reference, eagle1_to_speculators, make_eagle1, patch_eagle1
from eagle3_models import make_eagle3, to_speculators
from graph_stand_ins import stand_in_graphs
from mtp_models import check_against_reference, record_draft_logits, record_drafts
from spec_oracle import PlainRuns, oracle_table, run_checked
from tiny_models import HYBRID_VOCAB, make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams
from voltllm.config import ConfigError

_rng = random.Random(1)
VOCAB = 192
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(11)], [_rng.randrange(VOCAB) for _ in range(23)], [7, 8],
           [_rng.randrange(VOCAB) for _ in range(6)]]
BASE = dict(block_size=4, max_num_seqs=4, skip_tokenizer_init=True, dtype="float32")
K = 3
_plain = PlainRuns(BASE)
_run = run_checked


def _spec(head, k=K, **kw):
    return {"method": "eagle", "model": head, "num_speculative_tokens": k, **kw}


def _shape(path):
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    return cfg["hidden_size"], cfg["vocab_size"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    target = make_model(str(tmp_path_factory.mktemp("e1-llama")), "llama")
    return target, make_eagle1(str(tmp_path_factory.mktemp("e1-llama-head")), *_shape(target))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    target = make_model(str(tmp_path_factory.mktemp("e1-qwen2")), "qwen2")
    head = make_eagle1(str(tmp_path_factory.mktemp("e1-qwen2-head")), *_shape(target), kind="qwen2", layers=2,
                       fc_bias=False, para_norm=True, own_embedding=False, logit_scale=0.7, seed=2)
    return target, head


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    target = make_tiny_hybrid(str(tmp_path_factory.mktemp("e1-hybrid")), "qwen3_5", seed=0, gen_seed=1)
    if target is None:
        pytest.skip("this transformers has no qwen3_5")
    return target, make_eagle1(str(tmp_path_factory.mktemp("e1-hybrid-head")), 64, HYBRID_VOCAB, seed=3)


@pytest.fixture(scope="module", params=["llama", "qwen2", "hybrid"])
def pair(request):
    return request.getfixturevalue(request.param)


def _check(target, head, seen, prompts, outs, **ref_kw):
    """(atol 1e-3: an EAGLE-1 head's logits are the LM head of an un-normed state, ~10x an EAGLE-3 head's here, so
    the fp32 engine's noise is too: ~1e-4 of them on the hybrid's chained passes)"""
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(prompts, outs)}
    return check_against_reference(Eagle1Reference(target, head, **ref_kw), seen, fulls, K, atol=1e-3)


@pytest.mark.parametrize("budget", [64, 5])
def test_draft_logits_equal_reference(pair, monkeypatch, budget):
    """Budget 5: prompts in chunks beside verifications."""
    target, head = pair
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = PROMPTS[:3]
    seen = record_draft_logits(monkeypatch)
    llm = LLM(target, speculative_config=_spec(head), max_num_batched_tokens=budget, **BASE)
    outs = _run(llm, prompts, sp)
    assert outs == _plain(target, prompts, sp, max_num_batched_tokens=budget)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    assert _check(target, head, seen, prompts, outs) >= 3 * len(prompts)
    assert any(len(lg) == K for _, _, lg, _ in seen)


def test_reference_check_has_teeth(llama, monkeypatch):
    target, head = llama
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS[:2]
    seen = record_draft_logits(monkeypatch)
    outs = _run(LLM(target, speculative_config=_spec(head), **BASE), prompts, sp)
    assert _check(target, head, seen, prompts, outs) > 0
    with pytest.raises(AssertionError):
        _check(target, head, seen, prompts, outs, read_last=False)


def test_oracle_drafts_keep_plain_tokens(pair, monkeypatch):
    """All / some / no drafts accepted at every offset, prompt chunks beside verifications (budget 7)."""
    target, head = pair
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _plain(target, PROMPTS, sp, max_num_batched_tokens=7)
    table = oracle_table(PROMPTS, ref)
    patch_eagle1(monkeypatch, table, VOCAB)
    llm = LLM(target, speculative_config=_spec(head), max_num_batched_tokens=7, **BASE)
    assert _run(llm, PROMPTS, sp) == ref
    stats = llm.engine.stats().extra
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_graph_form_equals_eager_and_reference(request, monkeypatch, which):
    """Requests of different lengths joining and finishing mid-run: with the target's decode graphs and the head's
    passes in their graph form (CPU stand-ins, rows padded to a power of two) the drafts and tokens equal the eager
    form's, and every draft logit the reference's."""
    target, head = request.getfixturevalue(which)
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (14, 9, 17, 5)]
    kw = dict(max_num_batched_tokens=16, max_num_seqs=16)
    runs = []
    for graphs in (False, True):
        with monkeypatch.context() as mp:
            drafts, counts = record_drafts(mp)
            seen = record_draft_logits(mp)
            llm = LLM(target, speculative_config=_spec(head), **{**BASE, **kw})
            if graphs:
                stand_in_graphs(llm, 16)
            runs.append((_run(llm, PROMPTS, sps), drafts, dict(counts), seen))
    (eager, eager_drafts, eager_counts, _), (graph, graph_drafts, counts, seen) = runs
    assert graph == eager == _plain(target, PROMPTS, sps, **kw)
    assert graph_drafts == eager_drafts and len(graph_drafts) > 3
    assert eager_counts == {"chained": 0, "step": 0}
    assert counts["step"] > 0 and counts["chained"] > 0
    assert _check(target, head, seen, PROMPTS, graph) > 0


def test_sampled_runs_repeat(llama):
    target, head = llama
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=4)
    llm = LLM(target, speculative_config=_spec(head), **BASE)
    assert _run(llm, PROMPTS, sp) == _run(llm, PROMPTS, sp)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0


def test_dummy_weights_run(llama):
    """--load-format dummy: random target and head weights (norms at 1): the engine starts, drafts and stays
    consistent."""
    target, head = llama
    llm = LLM(target, load_format="dummy", speculative_config=_spec(head), **BASE)
    _run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    head_params = llm.engine.runner.draft.model.named_parameters()
    assert all(float(p.float().std()) > 0 for n, p in head_params if "norm" not in n)


def _refusal(target, spec):
    from voltllm.config import EngineArgs

    with pytest.raises(ConfigError) as e:
        EngineArgs(model=target, speculative_config=json.dumps(spec), skip_tokenizer_init=True).create_engine_config()
    return str(e.value)


def test_bad_heads_are_refused(llama, tmp_path):
    target, _ = llama
    hidden, vocab = _shape(target)
    e3 = make_eagle3(str(tmp_path / "e3"), hidden, vocab, layer_ids=[1, 2])
    assert "use method \"eagle3\"" in _refusal(target, _spec(e3))
    assert "no fc.weight" in _refusal(target, _spec(target))
    assert "hidden size" in _refusal(target, _spec(make_eagle1(str(tmp_path / "wide"), hidden * 2, vocab)))
    assert "vocabulary" in _refusal(target, _spec(make_eagle1(str(tmp_path / "voc"), hidden, vocab + 1)))
    assert "model_type" in _refusal(target, _spec(make_eagle1(str(tmp_path / "mix"), hidden, vocab,
                                                              model_type="mixtral")))
    assert "add_para_norm" in _refusal(target, _spec(make_eagle1(
        str(tmp_path / "hass"), hidden, vocab, para_norm=True, drop=("embedding_layernorm.weight",))))
    assert "past its num_hidden_layers" in _refusal(target, _spec(make_eagle1(
        str(tmp_path / "deep"), hidden, vocab, layers=2, num_hidden_layers=1)))
    # the EAGLE-3 method pointed at an EAGLE-1 head names the right method
    assert "use method \"eagle\"" in _refusal(target, {**_spec(make_eagle1(str(tmp_path / "e1"), hidden, vocab)),
                                                        "method": "eagle3"})
    missing = make_eagle1(str(tmp_path / "missing"), hidden, vocab, drop=("layers.0.mlp.up_proj.weight",))
    with pytest.raises(Exception, match="incomplete"):
        LLM(target, speculative_config=_spec(missing), **BASE)


def _split_head(runner):
    return runner.draft is not None and runner.draft.group is not None


def test_under_tensor_parallelism(qwen2, monkeypatch):
    """-tp 2 (gloo): the head is split over both ranks as the target's layers are, each rank reading the target's last
    hidden states (whole after the all-reduces) and the target's vocabulary-parallel embedding / LM head (no whole
    copies on rank 0); its draft logits equal the reference's, the tokens one device's plain ones."""
    target, head = qwen2
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seen = record_draft_logits(monkeypatch)  # (rank 0 runs in this process: the head is there)
    llm = LLM(target, tensor_parallel_size=2, speculative_config=_spec(head), max_num_batched_tokens=6, **BASE)
    try:
        assert llm.engine.runner.full_vocab is None and llm.engine.runner.draft.group is not None
        assert llm.engine.tp_workers.call_on_workers(_split_head) == [True]
        outs = _run(llm, PROMPTS[:3], sp)
    finally:
        llm.engine.shutdown()
    assert outs == _plain(target, PROMPTS[:3], sp)
    assert _check(target, head, seen, PROMPTS[:3], outs) >= 9


def test_speculators_format_head_drafts_as_the_eagle_layout(llama, tmp_path, monkeypatch):
    """The same head in the speculators format (speculators_model_type "eagle": fusion_fc, transformer.*): given as
    --speculative-config's model with no method (detected, K from its proposal method) it drafts exactly what the EAGLE
    repo's layout drafts; as --model it serves its verifier with itself attached, as vLLM does."""
    target, head = llama
    spec_head = eagle1_to_speculators(head, str(tmp_path / "spec"), verifier=target, speculative_tokens=K)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS[:3]
    runs = []
    for spec in (_spec(head), {"model": spec_head}):
        drafts, _ = record_drafts(monkeypatch)
        llm = LLM(target, speculative_config=spec, **BASE)
        assert llm.engine.scheduler.spec.method == "eagle" and llm.engine.scheduler.spec.num_speculative_tokens == K
        runs.append((_run(llm, prompts, sp), drafts[:]))
        monkeypatch.undo()
    assert runs[0] == runs[1] and runs[0][1]
    assert runs[0][0] == _plain(target, prompts, sp)
    served = LLM(spec_head, **BASE)  # --model HEAD: its verifier, the head as drafter
    assert served.engine.scheduler.spec.method == "eagle"
    assert _run(served, prompts, sp) == runs[0][0] and served.engine.stats().extra["spec_draft_tokens"] > 0


def test_speculators_format_refusals(llama, tmp_path):
    target, head = llama
    hidden, vocab = _shape(target)
    assert "layernorms" in _refusal(target, {"model": eagle1_to_speculators(head, str(tmp_path / "ln"), target,
                                                                            layernorms=True)})
    e1 = eagle1_to_speculators(head, str(tmp_path / "e1"), target)
    assert "use method \"eagle\"" in _refusal(target, _spec(e1) | {"method": "eagle3"})
    e3 = to_speculators(make_eagle3(str(tmp_path / "e3"), hidden, vocab, layer_ids=[1, 2]), str(tmp_path / "e3s"),
                        target)
    assert "use method \"eagle3\"" in _refusal(target, _spec(e3))
    assert "LlamaDecoderLayer" in _refusal(target, {"model": eagle1_to_speculators(
        head, str(tmp_path / "q"), target, transformer_layer_architecture="Qwen2DecoderLayer")})
