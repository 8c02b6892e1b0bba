"""A draft model and the target's MTP module under pipeline parallelism on the CPU (gloo): both draft on rank 0
(stage 0), which holds the embedding, the final norm and the LM head and gets the last stage's rows back, so the MTP
reads the same final hidden states as on one rank; the later stages run the verification steps' forwards from rank
0's StepInputs and, on a hybrid, keep the accepted rows of their own Gated DeltaNet states (rank 0's counts, a
broadcast). Drafts from an oracle (tests/spec_oracle.py: right and wrong ones) make every verification outcome
happen; greedy outputs equal plain decoding's on one rank, and the MTP's draft logits equal the float64 reference
fed by transformers' hidden states of the target (tests/mtp_models.py).

DFlash drafters and an EAGLE-3 head read the outputs of target layers on both stages (and DFlash the last layer's,
after rank 0's final norm): their rows ride the hand-overs back to rank 0. Tokens and acceptance counts equal one
rank's with the same drafter and oracle, and every draft logit equals one rank's and the float64 reference's
(tests/eagle3_models.py, tests/dflash_models.py); rank 0 dropping the rows that came back fails the reference."""
import random

import pytest
import torch

from mtp_models import MTPReference, check_against_reference, make_mtp_target, record_draft_logits
from spec_oracle import oracle_table, patch_device_proposals, patch_draft_model, run_checked
from tiny_models import HYBRID_VOCAB, make_model
from voltllm import LLM, SamplingParams

_rng = random.Random(4)
PROMPTS = [[_rng.randrange(190) for _ in range(n)] for n in (19, 5, 26)]
# small blocks, snapshots every 8 tokens, a small token budget: chunked prefill and verifications beside prompt chunks
ENGINE = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=9, max_num_seqs=4, skip_tokenizer_init=True)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
K = 3


@pytest.mark.parametrize("tp", [1, 2])
def test_draft_model_matches_plain(tmp_path, monkeypatch, tp):
    """A one-layer draft model (its own KV in the target's blocks, on rank 0) beside a dense qwen3 of 4 layers split
    into two stages (with -tp 2: stages of two tensor-parallel ranks)."""
    target = make_model(str(tmp_path / "target"), "qwen3", num_hidden_layers=4)
    draft = make_model(str(tmp_path / "draft"), "llama", seed=1, num_hidden_layers=1)
    plain = run_checked(LLM(target, **ENGINE), PROMPTS, GREEDY)
    patch_draft_model(monkeypatch, oracle_table(PROMPTS, plain), 400)
    llm = LLM(target, pipeline_parallel_size=2, tensor_parallel_size=tp,
              speculative_config={"model": draft, "num_speculative_tokens": K}, **ENGINE)
    try:
        runner = llm.engine.runner
        assert runner.pp.size == 2 and runner.draft is not None and len(runner.model.layers) == 2
        assert run_checked(llm, PROMPTS, GREEDY) == plain
        stats = llm.engine.stats().extra
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        if tp == 1:
            assert run_checked(llm, PROMPTS, GREEDY) == plain  # again, from prefix-cache hits
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_mtp_on_a_hybrid_matches_plain_and_reference(tmp_path_factory, monkeypatch, tp):
    """A qwen3_5 hybrid of 8 layers (each stage a full-attention layer and Gated DeltaNet ones) and its MTP module on
    rank 0: oracle drafts (partly accepted) for greedy outputs equal to one rank's, and every proposal's draft
    logits (the module's own, before the oracle replaces its drafts) equal to the reference's, so the module read
    the right final hidden states, embedding and LM head. With -tp 2, rank 0's whole copies of the vocabulary are
    gathered over stage 0's two ranks."""
    made = make_mtp_target(tmp_path_factory, "qwen3_5", model=dict(num_hidden_layers=8))
    if made is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    path, mtp = made
    from voltllm.worker.mtp_runner import MTPRunner

    plain = run_checked(LLM(path, **ENGINE), PROMPTS, GREEDY)
    seen = record_draft_logits(monkeypatch)
    table = oracle_table(PROMPTS, plain)
    patch_device_proposals(monkeypatch, MTPRunner, table, HYBRID_VOCAB)
    llm = LLM(path, pipeline_parallel_size=2, tensor_parallel_size=tp,
              speculative_config={"method": "mtp", "num_speculative_tokens": K}, **ENGINE)
    try:
        runner = llm.engine.runner
        assert runner.pp.size == 2 and isinstance(runner.draft, MTPRunner) and len(runner.model.layers) == 4
        assert (runner.full_vocab is not None) == (tp > 1)
        assert run_checked(llm, PROMPTS, GREEDY) == plain
        stats = llm.engine.stats().extra
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        if tp == 1:
            assert run_checked(llm, PROMPTS, GREEDY) == plain  # again: prefix-cache hits resumed from state snapshots
            assert runner.state_snapshots.num_restored > 0
    finally:
        llm.engine.shutdown()
    assert check_against_reference(MTPReference(path, mtp), seen, table, K) >= 3 * len(PROMPTS)


# -- DFlash and EAGLE-3: the target layers they read sit on both stages; each stage adds its layers' outputs to the
# rows the hand-over carries back to rank 0 (worker/aux_features.py) --------------------------------------------
AUX_ENGINE = dict(ENGINE, dtype="float32")


def _spec_run(path, spec, records_of, pp=1, tp=1, aux=True):
    """(greedy outputs, the drafter's accepted / drafted counts, its recorded logits) of one engine; aux: the drafter
    reads target layers' outputs (DFlash, EAGLE-3), so the target keeps them."""
    llm = LLM(path, pipeline_parallel_size=pp, tensor_parallel_size=tp, speculative_config=spec, **AUX_ENGINE)
    try:
        runner = llm.engine.runner
        assert (runner.pp is not None) == (pp > 1)
        assert runner.draft is not None and (runner.model.aux_hidden is not None) == aux
        records = records_of(runner)
        outs = run_checked(llm, PROMPTS, GREEDY)
        stats = llm.engine.stats().extra
    finally:
        llm.engine.shutdown()
    return outs, (stats["spec_accepted_tokens"], stats["spec_draft_tokens"]), records


def _same_logits(got, want, atol=1e-5):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=atol, rtol=atol), (a - b).nan_to_num().abs().max()


def drop_later_stages_aux(monkeypatch):
    """Rank 0 keeps its own aux rows and drops what the hand-over brought back (the later stages' layers' columns):
    what the tests below must catch."""
    from voltllm.distributed.pipeline import PipelineStage

    orig = PipelineStage.pass_on

    def pass_on(self, x, residual, aux=None):
        kept = None if aux is None else aux[:x.shape[0]].clone()
        out = orig(self, x, residual, aux)
        if kept is not None:
            aux[:x.shape[0]].copy_(kept)
        return out

    monkeypatch.setattr(PipelineStage, "pass_on", pass_on)


@pytest.fixture(scope="module")
def eagle3_llama(tmp_path_factory):
    """An 8-layer llama target and a head reading vLLM's default layers 2 / 4 / 5 (the outputs of layers 1 and 3 on
    stage 0, of layer 4 on stage 1), a 96-id draft vocabulary."""
    from eagle3_models import make_eagle3

    target = make_model(str(tmp_path_factory.mktemp("pp-e3")), "llama", num_hidden_layers=8)
    head = make_eagle3(str(tmp_path_factory.mktemp("pp-e3-head")), 64, 400, draft_vocab=96)
    plain = run_checked(LLM(target, **AUX_ENGINE), PROMPTS, GREEDY)
    return target, head, [2, 4, 5], plain


def _eagle3(monkeypatch, made, **kw):
    from eagle3_models import patch_eagle3

    target, head, _, plain = made
    seen = record_draft_logits(monkeypatch)
    patch_eagle3(monkeypatch, oracle_table(PROMPTS, plain), 400)
    outs, counts, _ = _spec_run(target, {"method": "eagle3", "model": head, "num_speculative_tokens": K},
                                lambda r: None, **kw)
    return outs, counts, list(seen)


@pytest.mark.parametrize("tp", [1, 2])
def test_eagle3_matches_one_rank(eagle3_llama, monkeypatch, tp):
    """Oracle drafts (right and wrong) beside the head's own proposals: the -pp 2 (-tp 2) engine's tokens and
    acceptance equal one rank's, and every draft logit equals one rank's and the float64 reference fed by
    transformers' hidden states of the target (so the head read every stage's layers, through chunked prompts and
    verifications)."""
    from eagle3_models import Eagle3Reference

    target, head, ids, plain = eagle3_llama
    one = _eagle3(monkeypatch, eagle3_llama)
    monkeypatch.undo()
    outs, counts, seen = _eagle3(monkeypatch, eagle3_llama, pp=2, tp=tp)
    assert outs == one[0] == plain
    assert counts == one[1] and 0 < counts[0] < counts[1]
    assert [(p, s) for p, s, _, _ in seen] == [(p, s) for p, s, _, _ in one[2]]
    for (_, _, got, _), (_, _, want, _) in zip(seen, one[2]):
        _same_logits(got, want)
    ref = Eagle3Reference(target, head, ids)
    assert check_against_reference(ref, seen, oracle_table(PROMPTS, plain), K) >= 3 * len(PROMPTS)


def test_eagle3_without_the_later_stage_aux_rows_fails(eagle3_llama, monkeypatch):
    """The check above has teeth: rank 0 dropping the rows its hand-over brought back (layer 4's output) gives draft
    logits the reference refuses."""
    from eagle3_models import Eagle3Reference

    target, head, ids, plain = eagle3_llama
    drop_later_stages_aux(monkeypatch)
    outs, _, seen = _eagle3(monkeypatch, eagle3_llama, pp=2)
    assert outs == plain  # (the verification keeps the tokens right whatever the drafts)
    with pytest.raises(AssertionError):
        check_against_reference(Eagle3Reference(target, head, ids), seen, oracle_table(PROMPTS, plain), K)


def _dflash(monkeypatch, target, drafter, plain, vocab, **kw):
    from dflash_models import record_block_logits
    from spec_oracle import patch_dflash

    patch_dflash(monkeypatch, oracle_table(PROMPTS, plain), vocab)
    return _spec_run(target, {"method": "dflash", "model": drafter, "num_speculative_tokens": K},
                     lambda r: record_block_logits(r.draft), **kw)


@pytest.mark.parametrize("kind, tp", [("qwen3", 1), ("qwen3", 2), ("qwen3_5", 1)])
def test_dflash_matches_one_rank(tmp_path_factory, monkeypatch, kind, tp):
    """A DFlash drafter reading layers on both stages and the last layer (its final norm's output, rank 0's): on a
    4-layer qwen3 layers 0 (stage 0), 2 and 3 (stage 1); on an 8-layer qwen3_5 hybrid a Gated DeltaNet layer of
    each stage and the last (attention) layer. Oracle drafts: tokens and acceptance equal one rank's, every block's
    logits equal one rank's and the float64 reference's."""
    from dflash_models import check_block_logits, make_dflash

    root = tmp_path_factory.mktemp(f"pp-dflash-{kind}")
    if kind == "qwen3":
        n, vocab, layers = 4, 400, [0, 2, 3]
        target = make_model(str(root / "target"), "qwen3", num_hidden_layers=n)
    else:
        from tiny_models import make_tiny_hybrid

        n, vocab, layers = 8, HYBRID_VOCAB, [1, 5, 7]
        target = make_tiny_hybrid(str(root / "target"), "qwen3_5", seed=0, gen_seed=1, num_hidden_layers=n)
        if target is None:
            pytest.skip("this transformers has no Qwen3_5TextConfig")
    drafter = make_dflash(str(root / "dflash"), 64, vocab, n, layers, block_size=4)
    plain = run_checked(LLM(target, **AUX_ENGINE), PROMPTS, GREEDY)
    one = _dflash(monkeypatch, target, drafter, plain, vocab)
    monkeypatch.undo()
    outs, counts, records = _dflash(monkeypatch, target, drafter, plain, vocab, pp=2, tp=tp)
    assert outs == one[0] == plain
    assert counts == one[1] and 0 < counts[0] < counts[1]
    assert [r["rows"] for r in records] == [r["rows"] for r in one[2]]
    _same_logits([r["logits"] for r in records if r["rows"]], [r["logits"] for r in one[2] if r["rows"]])
    assert check_block_logits(records, target, drafter, layers) >= 3 * len(PROMPTS)


def test_eagle1_matches_one_rank(tmp_path_factory, monkeypatch):
    """An EAGLE-1 head (reads the target's last hidden state, which comes back to rank 0 from the last stage) under
    -pp 2: oracle drafts beside its own proposals give one rank's tokens, acceptance and draft logits, and the float64
    reference's."""
    from eagle1_models import Eagle1Reference, make_eagle1, patch_eagle1

    target = make_model(str(tmp_path_factory.mktemp("pp-e1")), "llama", num_hidden_layers=4)
    head = make_eagle1(str(tmp_path_factory.mktemp("pp-e1-head")), 64, 400, seed=5)
    plain = run_checked(LLM(target, **ENGINE), PROMPTS, GREEDY)
    runs = []
    for kw in ({}, {"pp": 2}):
        with monkeypatch.context() as mp:
            seen = record_draft_logits(mp)
            patch_eagle1(mp, oracle_table(PROMPTS, plain), 400)
            outs, counts, _ = _spec_run(target, {"method": "eagle", "model": head, "num_speculative_tokens": K},
                                        lambda r: None, aux=False, **kw)
            runs.append((outs, counts, list(seen)))
    (one, one_counts, one_seen), (outs, counts, seen) = runs
    assert outs == one == plain
    assert counts == one_counts and 0 < counts[0] < counts[1]
    for (_, _, got, _), (_, _, want, _) in zip(seen, one_seen):
        _same_logits(got, want, atol=1e-4)
    assert check_against_reference(Eagle1Reference(target, head), seen, oracle_table(PROMPTS, plain), K,
                                   atol=1e-3) >= 3 * len(PROMPTS)
