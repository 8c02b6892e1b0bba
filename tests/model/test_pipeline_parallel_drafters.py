"""A draft model and the target's MTP module under pipeline parallelism on the CPU (gloo): both draft on rank 0
(stage 0), which holds the embedding, the final norm and the LM head and gets the last stage's rows back, so the MTP
reads the same final hidden states as on one rank; the later stages run the verification steps' forwards from rank
0's StepInputs and, on a hybrid, keep the accepted rows of their own Gated DeltaNet states (rank 0's counts, a
broadcast). Drafts from an oracle (tests/spec_oracle.py: right and wrong ones) make every verification outcome
happen; greedy outputs equal plain decoding's on one rank, and the MTP's draft logits equal the float64 reference
fed by transformers' hidden states of the target (tests/mtp_models.py)."""
import random

import pytest

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
