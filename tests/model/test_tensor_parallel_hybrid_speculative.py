"""Speculative decoding under tensor parallelism for the dense hybrid qwen3_5 on the CPU (gloo): -tp 2 against -tp 1.
A verification walks each request's Gated DeltaNet states per draft position into checkpoint rows on every rank
(each rank its own heads, in the same rows); rank 0 alone judges the drafts, and its accepted counts (a device
broadcast) make every rank keep the same rows. The tiny random hybrids hardly repeat themselves, so the drafts come
from an oracle (tests/spec_oracle.py: plain decoding's own tokens, some replaced by wrong ones): all, some and none
accepted, through chunked prefill, verifications beside prompt chunks and prefix-cache hits restored from snapshots."""
import random
import sys

import pytest

from spec_oracle import oracle_table, patch_draft_model, patch_ngram, run_checked
from tiny_models import HYBRID_VOCAB, make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
_rng = random.Random(0)
_PAT = [_rng.randrange(HYBRID_VOCAB) for _ in range(7)]
PROMPTS = [_PAT * 3, [_rng.randrange(HYBRID_VOCAB) for _ in range(19)], (_PAT[:3] + [5]) * 4 + [9], [7, 8]]
# small blocks, snapshots every 8 tokens, a small token budget: chunked prefill and verifications beside prompt chunks
ENGINE = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=9, max_num_seqs=4, skip_tokenizer_init=True)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target = make_tiny_hybrid(str(tmp_path_factory.mktemp("qwen3_5")), "qwen3_5", seed=0, gen_seed=1)
    if target is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    draft = make_model(str(tmp_path_factory.mktemp("draft")), "llama", seed=1, num_hidden_layers=1,
                       vocab_size=HYBRID_VOCAB, max_position_embeddings=4096)
    return target, draft


@pytest.fixture(scope="module")
def plain(paths):
    return run_checked(LLM(paths[0], **ENGINE), PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def ngram_engines(paths):
    one = LLM(paths[0], speculative_config=NGRAM, **ENGINE)
    two = LLM(paths[0], tensor_parallel_size=2, speculative_config=NGRAM, **ENGINE)
    yield one, two
    two.engine.shutdown()


def test_ngram_greedy_equals_plain_tp1_chunked_and_cached(ngram_engines, plain, monkeypatch):
    one, two = ngram_engines
    patch_ngram(monkeypatch, oracle_table(PROMPTS, plain), HYBRID_VOCAB)
    before = dict(two.engine.stats().extra)
    assert run_checked(two, PROMPTS, GREEDY) == plain
    stats = two.engine.stats().extra
    accepted = stats["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
    assert 0 < accepted < stats["spec_draft_tokens"] - before.get("spec_draft_tokens", 0)
    snaps = two.engine.runner.state_snapshots
    restored = snaps.num_restored
    assert run_checked(two, PROMPTS, GREEDY) == plain  # again: prefix-cache hits resumed from snapshots, verified
    assert snaps.num_restored > restored
    assert run_checked(one, PROMPTS, GREEDY) == plain


def test_ngram_seeded_sampling_equals_tp1_speculative(ngram_engines, plain, monkeypatch):
    """Sampled verification: rank 0's verdicts pick the states every rank keeps."""
    one, two = ngram_engines
    patch_ngram(monkeypatch, oracle_table(PROMPTS, plain), HYBRID_VOCAB)
    sps = [GREEDY, SamplingParams(temperature=0.7, seed=7, max_tokens=24, ignore_eos=True)] * 2
    got = run_checked(two, PROMPTS, sps)
    assert got == run_checked(one, PROMPTS, sps)
    assert [got[i] for i in (0, 2)] == [plain[i] for i in (0, 2)]


def test_draft_model_greedy_equals_plain(paths, plain, monkeypatch):
    """An attention-only draft model, unsharded on rank 0, beside the sharded hybrid target."""
    patch_draft_model(monkeypatch, oracle_table(PROMPTS, plain), HYBRID_VOCAB)
    two = LLM(paths[0], tensor_parallel_size=2, speculative_config={"model": paths[1], "num_speculative_tokens": 3},
              **ENGINE)
    try:
        assert two.engine.runner.draft is not None
        assert run_checked(two, PROMPTS, GREEDY) == plain
        stats = two.engine.stats().extra
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    finally:
        two.engine.shutdown()


def test_verification_walks_graph_path_on_every_rank(paths, plain, monkeypatch, tmp_path):
    """Verification steps as decode rows replayed by the walks graphs on both ranks (stood in for on the CPU by eager
    replays on the same buffers, tests/tp_eager_graphs.py): the worker lays out the same walks from the step."""
    import tp_eager_graphs

    tp_eager_graphs.worker_env(monkeypatch, tmp_path, sys.path)
    monkeypatch.setattr("voltllm.worker.runner.ModelRunner.capture_cuda_graphs", tp_eager_graphs._capture)
    patch_ngram(monkeypatch, oracle_table(PROMPTS, plain), HYBRID_VOCAB)
    two = LLM(paths[0], tensor_parallel_size=2, speculative_config=NGRAM, **{**ENGINE, "max_num_seqs": 16})
    try:
        assert run_checked(two, PROMPTS, GREEDY) == plain
        assert two.engine.runner.verify_graphs.replays > 0
        assert two.engine.stats().extra["spec_accepted_tokens"] > 0
    finally:
        two.engine.shutdown()
