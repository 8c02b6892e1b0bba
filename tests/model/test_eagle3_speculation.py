"""EAGLE-3 speculation (CPU): tiny random heads in the public checkpoint format (tests/eagle3_models.py) beside a tiny
llama target (8 layers: vLLM's default layers 2 / 4 / 5; a draft vocabulary of 96 ids with d2t, the EAGLE repo's
`midlayer.*` names), a tiny qwen3 target (4 layers named in the config, unsorted; `layers.0.*` names, its own
embedding, the target's LM head, norm_before_residual) and a tiny qwen3_5 hybrid (Gated DeltaNet layers read; its
verification keeps per-position recurrent states, prefix-cache hits restart at state snapshots):

- every draft logit of every proposal (first draft and chained passes) equals a float64 reference of the head's math
  fed by transformers' hidden states of the target, through chunked prefill, rejected drafts, concurrent requests,
  prefix-cache hits and preemption; the reference with a wrong layer or without d2t fails the same check;
- greedy outputs equal plain decoding's, with oracle drafts accepted and rejected; a head that always agrees accepts
  every draft in 1 + ceil((N - 1) / (K + 1)) steps; seeded sampled runs repeat;
- the head's own graph form (CPU stand-ins of the decode graphs, padded rows; a hybrid's verification-walks graphs)
  gives the eager form's drafts;
- -tp 2 (gloo), a Hub head published as pytorch_model.bin, configuration refusals.
"""
import json
import random

import pytest

from eagle3_models import Eagle3Reference, make_eagle3, patch_eagle3
from graph_stand_ins import stand_in_graphs
from mtp_models import check_against_reference, record_draft_logits, record_drafts
from spec_oracle import PlainRuns, oracle_table, run_checked
from tiny_models import HYBRID_VOCAB, make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams
from voltllm.config import ConfigError

_rng = random.Random(0)
VOCAB = 192  # (prompt ids below it: the tiny tokenizer's vocabulary and the hybrid's, HYBRID_VOCAB)
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(11)], [_rng.randrange(VOCAB) for _ in range(23)], [7, 8],
           [_rng.randrange(VOCAB) for _ in range(6)]]
BASE = dict(block_size=4, max_num_seqs=4, skip_tokenizer_init=True, dtype="float32")
K = 3
_plain = PlainRuns(BASE)
_run = run_checked


def _spec(head, k=K, **kw):
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, **kw}


def _vocab(path):
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)["vocab_size"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(target, head, the head's layer ids): vLLM's default layers of an 8-layer target, a 96-id draft vocabulary."""
    target = make_model(str(tmp_path_factory.mktemp("e3-llama")), "llama", num_hidden_layers=8)
    head = make_eagle3(str(tmp_path_factory.mktemp("e3-llama-head")), 64, _vocab(target), draft_vocab=96)
    return target, head, [2, 4, 5]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    target = make_model(str(tmp_path_factory.mktemp("e3-qwen3")), "qwen3", num_hidden_layers=4)
    head = make_eagle3(str(tmp_path_factory.mktemp("e3-qwen3-head")), 64, _vocab(target), layer_ids=[3, 1, 2],
                       ids_in_eagle_config=False, layout="layers.0", own_embedding=True, own_lm_head=False,
                       norm_before_residual=True, seed=1)
    return target, head, [1, 2, 3]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A qwen3_5 hybrid target (Gated DeltaNet layers 0-2, attention layer 3) read at layers 1-3, a 64-id draft
    vocabulary."""
    target = make_tiny_hybrid(str(tmp_path_factory.mktemp("e3-hybrid")), "qwen3_5", seed=0, gen_seed=1)
    if target is None:
        pytest.skip("this transformers has no qwen3_5")
    head = make_eagle3(str(tmp_path_factory.mktemp("e3-hybrid-head")), 64, HYBRID_VOCAB, draft_vocab=64,
                       layer_ids=[1, 2, 3], seed=3)
    return target, head, [1, 2, 3]


@pytest.fixture(scope="module", params=["llama", "qwen3", "hybrid"])
def pair(request):
    return request.getfixturevalue(request.param)


def _check(target, head, ids, seen, prompts, outs, k=K, **ref_kw):
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(prompts, outs)}
    return check_against_reference(Eagle3Reference(target, head, ids, **ref_kw), seen, fulls, k)


@pytest.mark.parametrize("budget", [64, 5])
def test_draft_logits_equal_reference(pair, monkeypatch, budget):
    """Budget 5: prompts in chunks beside verifications."""
    target, head, ids = pair
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = PROMPTS[:3]
    seen = record_draft_logits(monkeypatch)
    llm = LLM(target, speculative_config=_spec(head), max_num_batched_tokens=budget, **BASE)
    outs = _run(llm, prompts, sp)
    assert outs == _plain(target, prompts, sp, max_num_batched_tokens=budget)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    assert _check(target, head, ids, seen, prompts, outs) >= 3 * len(prompts)
    assert any(len(lg) == K for _, _, lg, _ in seen)


def test_reference_check_has_teeth(llama, monkeypatch):
    """The same recorded logits against a reference reading a wrong target layer, or ignoring d2t (draft id = target
    id), fail: the check sees which layers the head reads and where its ids land."""
    target, head, ids = llama
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS[:2]
    seen = record_draft_logits(monkeypatch)
    outs = _run(LLM(target, speculative_config=_spec(head), **BASE), prompts, sp)
    assert _check(target, head, ids, seen, prompts, outs) > 0
    for kw in ({"layer_ids": [2, 4, 6]}, {"layer_ids": [1, 4, 5]}, {"use_d2t": False}):
        with pytest.raises(AssertionError):
            _check(target, head, kw.pop("layer_ids", ids), seen, prompts, outs, **kw)


def test_draft_logits_through_prefix_hits_and_preemption(llama, monkeypatch):
    """A second request starting at the first's cached prefix drafts from head KV the first wrote; a run preempting
    requests (few KV blocks) recomputes theirs: the drafts stay the reference's, the tokens plain decoding's."""
    target, head, ids = llama
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    shared = PROMPTS[1][:17]
    prompts = [shared + [3, 4, 5], shared + [9, 9]]
    seen = record_draft_logits(monkeypatch)
    llm = LLM(target, speculative_config=_spec(head), **BASE)
    outs = [_run(llm, [p], sp)[0] for p in prompts]
    assert llm.engine.stats().prefix_cache_hits > 0
    assert outs == _plain(target, prompts, sp)
    assert _check(target, head, ids, seen, prompts, outs) > 0
    seen.clear()
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    tight = LLM(target, speculative_config=_spec(head), max_num_batched_tokens=16, num_gpu_blocks_override=24, **BASE)
    outs = _run(tight, PROMPTS, sp)
    assert tight.engine.stats().num_preemptions > 0
    assert outs == _plain(target, PROMPTS, sp)
    assert _check(target, head, ids, seen, PROMPTS, outs) > 0


def test_hybrid_snapshot_hits_and_preemption(hybrid, monkeypatch):
    """A hybrid target's prefix-cache hits restart at a recurrent-state snapshot (every 8 tokens here), whose
    positions' head KV the first request wrote; preemption recomputes: drafts the reference's, tokens plain ones."""
    target, head, ids = hybrid
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    shared = PROMPTS[1][:17]
    prompts = [shared + [3, 4, 5], shared + [9, 9]]
    seen = record_draft_logits(monkeypatch)
    llm = LLM(target, speculative_config=_spec(head), mamba_block_size=8, **BASE)
    outs = [_run(llm, [p], sp)[0] for p in prompts]
    assert llm.engine.runner.state_snapshots.stats()["restored"] > 0
    assert outs == _plain(target, prompts, sp, enable_prefix_caching=False)
    assert _check(target, head, ids, seen, prompts, outs) > 0
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tight = LLM(target, speculative_config=_spec(head), max_num_batched_tokens=16, num_gpu_blocks_override=24, **BASE)
    assert _run(tight, PROMPTS, sp) == _plain(target, PROMPTS, sp)
    assert tight.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("budget", [64, 5])
def test_oracle_drafts_greedy_equals_plain(pair, monkeypatch, budget):
    """Drafts from the plain run's own tokens, wrong at every fifth position: accepted, partly accepted and rejected
    drafts, the head's KV written after each (its next proposals read it)."""
    target, head, _ = pair
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = _plain(target, PROMPTS, sp, max_num_batched_tokens=budget)
    patch_eagle3(monkeypatch, oracle_table(PROMPTS, plain), _vocab(target))
    llm = LLM(target, speculative_config=_spec(head), max_num_batched_tokens=budget, **BASE)
    assert _run(llm, PROMPTS, sp) == plain
    stats = llm.engine.stats().extra
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """A qwen3 target and a head whose LM heads are zero: both argmaxes are token 0."""
    from safetensors.torch import load_file, save_file

    target = make_model(str(tmp_path_factory.mktemp("e3-zero")), "qwen3", num_hidden_layers=4)
    f = f"{target}/model.safetensors"
    sd = load_file(f)
    sd["lm_head.weight"].zero_()
    save_file(sd, f, metadata={"format": "pt"})
    head = make_eagle3(str(tmp_path_factory.mktemp("e3-zero-head")), 64, _vocab(target), layer_ids=[1, 2, 3],
                       zero_lm_head=True)
    return target, head


@pytest.mark.parametrize("k", [1, 3])
def test_agreeing_head_accepts_every_draft(agreeing, k):
    target, head = agreeing
    m = 21
    sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
    llm = LLM(target, speculative_config=_spec(head, k), **BASE)
    steps0 = llm.engine.stats().step_counter
    assert _run(llm, PROMPTS[:1], sp) == [[0] * m]
    stats = llm.engine.stats()
    assert stats.extra["spec_accepted_tokens"] == stats.extra["spec_draft_tokens"] > 0
    assert stats.step_counter - steps0 == 1 + -(-(m - 1) // (k + 1))


def test_sampled_requests_repeat_and_greedy_stay_exact(llama):
    target, head, _ = llama
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    sps = [greedy, SamplingParams(temperature=1.0, seed=11, max_tokens=14, ignore_eos=True)] * 2
    runs = [_run(LLM(target, speculative_config=_spec(head), **BASE), PROMPTS, sps) for _ in range(2)]
    assert runs[0] == runs[1]
    ref = _plain(target, PROMPTS, greedy)
    assert [runs[0][i] for i in (0, 2)] == [ref[i] for i in (0, 2)]


# -- the CUDA-graph forms, on the CPU ---------------------------------------------------------------------------
@pytest.mark.parametrize("which,max_rows", [("llama", 16), ("llama", 2), ("hybrid", 16)])
def test_graph_form_equals_eager_and_reference(request, monkeypatch, which, max_rows):
    """Requests of different lengths joining (prompts in chunks of the 16-token budget) and finishing mid-run: with
    the head's passes in their graph form (rows padded to a power of two; max_rows 2: the wider passes eager) the
    drafts and tokens equal the eager form's, and every draft logit the reference's."""
    target, head, ids = request.getfixturevalue(which)
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (14, 9, 17, 5)]
    kw = dict(max_num_batched_tokens=16, max_num_seqs=16)
    runs = []
    for graphs in (False, True):
        with monkeypatch.context() as mp:
            drafts, counts = record_drafts(mp)
            seen = record_draft_logits(mp)
            llm = LLM(target, speculative_config=_spec(head), **{**BASE, **kw})
            if graphs:
                stand_in_graphs(llm, max_rows)
            runs.append((_run(llm, PROMPTS, sps), drafts, dict(counts), seen))
    (eager, eager_drafts, eager_counts, _), (graph, graph_drafts, counts, seen) = runs
    assert graph == eager == _plain(target, PROMPTS, sps, **kw)
    assert graph_drafts == eager_drafts and len(graph_drafts) > 3
    assert eager_counts == {"chained": 0, "step": 0}
    assert counts["step"] > 0 and counts["chained"] > 0
    assert _check(target, head, ids, seen, PROMPTS, graph) > 0


# -- configuration ----------------------------------------------------------------------------------------------
def test_method_keys():
    from voltllm.engine.speculative import SpeculativeConfig, SpeculativeConfigError

    spec = SpeculativeConfig.from_dict(_spec("some/head", draft_sample_method="greedy"))
    assert spec.uses_eagle3 and spec.drafts_on_device and spec.draft_sample_method == "greedy"
    eagle1 = SpeculativeConfig.from_dict({"method": "eagle", "model": "x", "num_speculative_tokens": 2})
    assert eagle1.uses_eagle1 and not eagle1.uses_eagle3 and eagle1.drafts_on_device
    with pytest.raises(SpeculativeConfigError, match="needs \"model\""):
        SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(SpeculativeConfigError, match="unsupported keys for eagle3: parallel_drafting"):
        SpeculativeConfig.from_dict({**_spec("x"), "parallel_drafting": True})
    with pytest.raises(SpeculativeConfigError, match="draft_tensor_parallel_size"):
        SpeculativeConfig.from_dict({**_spec("x"), "draft_tensor_parallel_size": 0})


@pytest.mark.parametrize("what,kw,match", [
    ("eagle1", dict(architectures=["EagleLlamaForCausalLM"]), "EAGLE-1 head"),
    ("other", dict(architectures=["Qwen3ForCausalLM"]), "not an EAGLE-3 Llama head"),
    ("hidden", dict(hidden=32), "hidden size 32 differs"),
    ("target_hidden", dict(target_hidden_size=128), "target of hidden size 128"),
    ("vocab", dict(vocab=1000), "vocabulary of 1000 ids differs"),
    ("no_d2t", dict(draft_vocab=96, drop=("d2t",)), "no d2t"),
    ("no_head", dict(draft_vocab=96, own_lm_head=False), "no lm_head"),
    ("layers", dict(num_hidden_layers=2), "only one-layer heads"),
    ("ids", dict(layer_ids=[1, 4, 9]), r"ids 1\.\.7"),
    ("dup_ids", dict(layer_ids=[1, 4, 4]), "distinct"),
    ("embedding_id", dict(layer_ids=[0, 4, 5]), "the embedding, is not read"),
    ("no_aux", dict(eagle_config={"use_aux_hidden_state": False}), "use_aux_hidden_state"),
    ("not_eagle3", dict(drop=("midlayer.hidden_norm.weight",)), "not an EAGLE-3 head"),
])
def test_checkpoint_refusals(llama, tmp_path, what, kw, match):
    target = llama[0]
    args = dict(hidden=64, vocab=_vocab(target))
    args.update({k: kw.pop(k) for k in ("hidden", "vocab") if k in kw})
    head = make_eagle3(str(tmp_path / what), args["hidden"], args["vocab"], **kw)
    with pytest.raises(ConfigError, match=match):
        LLM(target, speculative_config=_spec(head), **BASE)


def test_target_refusals(tmp_path_factory, llama):
    small = make_model(str(tmp_path_factory.mktemp("e3-3layers")), "llama")  # default layers (2, 1, 0): 0 is out
    head = make_eagle3(str(tmp_path_factory.mktemp("e3-small-head")), 64, _vocab(small))
    with pytest.raises(ConfigError, match="7 layers or more"):
        LLM(small, speculative_config=_spec(head), **BASE)


def test_incomplete_or_bad_weights(llama, tmp_path):
    target = llama[0]
    head = make_eagle3(str(tmp_path / "partial"), 64, _vocab(target), drop=("midlayer.mlp.up_proj.weight",))
    with pytest.raises(ValueError, match="mlp.gate_up_proj"):
        LLM(target, speculative_config=_spec(head), **BASE)
    head = make_eagle3(str(tmp_path / "fc"), 64, _vocab(target), layer_ids=[1, 2, 3, 4])  # 4 layers read, fc of 3
    with pytest.raises(ValueError, match="fc.weight: shape"):
        LLM(target, speculative_config=_spec(head), **BASE)


def _write_bad_bin(path, kind):
    import argparse

    import torch

    if kind == "junk":
        path.write_bytes(b"not a torch file at all")
    elif kind == "foreign_object":  # a pickle weights_only refuses (UnpicklingError)
        torch.save({"fc.weight": argparse.Namespace(x=1)}, path)
    else:  # "no_table": a bare tensor, not a state dict
        torch.save(torch.zeros(2), path)


@pytest.mark.parametrize("kind,match", [("junk", "not a checkpoint torch.load can read"),
                                        ("foreign_object", "Unsupported global"),
                                        ("no_table", "table of named tensors")])
def test_an_unreadable_bin_head_is_a_config_error(llama, tmp_path, kind, match):
    """A pytorch_model.bin torch cannot read with weights_only (a damaged file, a pickle of other objects) or that
    holds no state dict: a ConfigError naming the file, not a traceback. A pre-zip (legacy) torch.save file is read
    (without mapping, as the weight loader reads it)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from voltllm.engine.eagle3 import checkpoint_tensor_names

    target, head, _ = llama
    bad = tmp_path / "head"
    bad.mkdir()
    shutil.copy(f"{head}/config.json", bad / "config.json")
    _write_bad_bin(bad / "pytorch_model.bin", kind)
    with pytest.raises(ConfigError, match=f"EAGLE-3 head: cannot load .*pytorch_model.bin.*{match}"):
        LLM(target, speculative_config=_spec(str(bad)), **BASE)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    tensors = load_file(f"{head}/model.safetensors")
    torch.save(tensors, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert checkpoint_tensor_names(str(legacy)) == set(tensors)


def _split_head(runner):
    return runner.draft is not None and runner.draft.group is not None


def test_under_tensor_parallelism(llama, tmp_path_factory):
    """-tp 2 (gloo): the head is split over both ranks as a target layer is, each rank reading the target's layers
    (whole after each layer's all-reduce) and the target's tied vocabulary-parallel embedding / LM head (a head with
    neither; no whole copies on rank 0); its draft logits equal the reference's, the tokens one device's plain ones."""
    target, _, ids = llama
    head = make_eagle3(str(tmp_path_factory.mktemp("e3-tp-head")), 64, _vocab(target), own_lm_head=False, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with pytest.MonkeyPatch.context() as mp:
        seen = record_draft_logits(mp)  # (rank 0 runs in this process: the head is there)
        llm = LLM(target, tensor_parallel_size=2, speculative_config=_spec(head), max_num_batched_tokens=6, **BASE)
        try:
            assert llm.engine.runner.full_vocab is None and llm.engine.runner.draft.group is not None
            assert llm.engine.tp_workers.call_on_workers(_split_head) == [True]
            outs = _run(llm, PROMPTS[:3], sp)
        finally:
            llm.engine.shutdown()
    assert outs == _plain(target, PROMPTS[:3], sp)
    assert _check(target, head, ids, seen, PROMPTS[:3], outs) >= 9


def test_a_bin_head_from_the_hub(llama, tmp_path, monkeypatch):
    """The EAGLE authors publish heads as pytorch_model.bin: a Hub repo without safetensors is fetched again for its
    .bin files (huggingface_hub stood in for by a snapshot directory holding what such a repo has) and read; its
    drafts are the safetensors copy's."""
    import shutil

    import torch
    from safetensors.torch import load_file

    target, head, _ = llama
    snap = tmp_path / "snapshot"
    snap.mkdir()
    shutil.copy(f"{head}/config.json", snap / "config.json")
    torch.save(load_file(f"{head}/model.safetensors"), snap / "pytorch_model.bin")
    asked = []

    def fetch_repo(repo_id, revision=None, download_dir=None, token=None, trust_remote_code=False,
                   tokenizer_only=False, patterns=None, offline_first=True):
        asked.append((repo_id, tuple(patterns)))
        return str(snap)

    monkeypatch.setattr("voltllm.model.loader.hub.fetch_repo", fetch_repo)
    monkeypatch.setattr("voltllm.model.loader.hub.looks_like_repo_id", lambda name: name == "org/EAGLE3-head")
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with monkeypatch.context() as mp:
        drafts, _ = record_drafts(mp)
        outs = _run(LLM(target, speculative_config=_spec("org/EAGLE3-head"), **BASE), PROMPTS[:2], sp)
    assert [p for _, p in asked] == [("*.json", "*.safetensors"), ("*.json", "pytorch_model*.bin")]
    with monkeypatch.context() as mp:
        want, _ = record_drafts(mp)
        assert _run(LLM(target, speculative_config=_spec(head), **BASE), PROMPTS[:2], sp) == outs
    assert drafts == want and drafts
