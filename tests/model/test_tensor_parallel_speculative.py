"""Speculative decoding under tensor parallelism on the CPU (gloo): tiny fp32 llama-family models with -tp 2 and
n-gram or draft-model drafts against -tp 1. Rank 0 drafts (host n-grams, or a draft model unsharded beside its
shard, or split over both ranks with draft_tensor_parallel_size 2: worker/draft_runner.py), verifies and samples;
rank 1 runs the same verification forward (the same rows, the same logits gathers) and a split draft's passes.
Greedy tokens equal plain -tp 1 decoding and -tp 1 speculation, through chunked prefill and prefix-cache hits, with
drafts accepted and rejected; seeded sampled requests equal -tp 1 speculation's."""
import pytest

from tiny_models import make_model
from voltllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# repetitive prompts (n-gram drafts accepted) beside ones whose drafts mostly miss
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "0123456789 0123456789 0123",
           "Hi"]
# small blocks and a small token budget: chunked prefill, verifications beside prompt chunks, prefix-cache hits
ENGINE = dict(block_size=4, max_num_batched_tokens=9, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
           SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
           SamplingParams(temperature=0.5, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]


def _tokens(llm, prompts, params):
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["llama-ngram", "qwen3-draft", "llama-splitdraft"])
def engines(request, tmp_path_factory):
    """(plain tp1, speculative tp1, speculative tp2). qwen3-draft: the target as its own draft model (unsharded on
    rank 0), whose greedy drafts are all accepted; splitdraft: the same split over both ranks
    (draft_tensor_parallel_size 2, each rank holding its heads of the draft's KV); the n-gram case has rejected drafts
    too."""
    kind, method = request.param.split("-")
    root = tmp_path_factory.mktemp(request.param)
    path = make_model(str(root / "target"), kind)
    if method == "ngram":
        spec = NGRAM
    else:
        spec = {"model": path, "num_speculative_tokens": 3}
    plain = LLM(path, **ENGINE)
    one = LLM(path, speculative_config=spec, **ENGINE)
    split = {"draft_tensor_parallel_size": 2} if method == "splitdraft" else {}
    two = LLM(path, tensor_parallel_size=2, speculative_config={**spec, **split}, **ENGINE)
    draft = two.engine.runner.draft
    assert (draft is not None and draft.group is not None) == bool(split)
    assert two.engine.tp_workers.call_on_workers(_holds_draft) == [bool(split)]
    yield plain, one, two
    two.engine.shutdown()


def _holds_draft(runner):
    return runner.draft is not None


def _spec_counts(llm):
    extra = llm.engine.stats().extra
    return extra.get("spec_draft_tokens", 0), extra.get("spec_accepted_tokens", 0)


def test_greedy_equals_tp1_chunked_and_cached(engines):
    """Greedy tokens equal plain tp1 decoding; tp2 drafts and accepts exactly what tp1 speculation does (the same
    drafts judged by the same logits), some drafts accepted."""
    plain, one, two = engines
    expected = _tokens(plain, PROMPTS, GREEDY)
    a0, b0 = _spec_counts(one), _spec_counts(two)
    assert _tokens(one, PROMPTS, GREEDY) == expected
    assert _tokens(two, PROMPTS, GREEDY) == expected
    a1, b1 = _spec_counts(one), _spec_counts(two)
    drafted, accepted = b1[0] - b0[0], b1[1] - b0[1]
    assert (drafted, accepted) == (a1[0] - a0[0], a1[1] - a0[1])
    assert 0 < accepted <= drafted
    if one.config.speculative.method == "ngram":  # repetitive prompts beside ones whose n-grams miss
        assert accepted < drafted
    # the same prompts again: prefix-cache hits on every rank's cache, then verification from there
    hits = two.engine.stats().prefix_cache_hits
    assert _tokens(two, PROMPTS, GREEDY) == expected
    assert two.engine.stats().prefix_cache_hits > hits


def test_seeded_sampling_equals_tp1_speculative(engines):
    _, one, two = engines
    assert _tokens(two, PROMPTS, SAMPLED) == _tokens(one, PROMPTS, SAMPLED)


def _graph_form_setup(monkeypatch, tmp_path):
    """A tiny llama, engine arguments with room for graph rows, greedy params and plain decoding's tokens; then CPU
    stand-ins of the decode graphs in this process and every worker (tests/tp_eager_graphs.py)."""
    import sys

    import tp_eager_graphs

    path = make_model(str(tmp_path / "llama"), "llama")
    engine = {**ENGINE, "max_num_seqs": 16, "max_num_batched_tokens": 64}
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = _tokens(LLM(path, **engine), PROMPTS, greedy)
    tp_eager_graphs.worker_env(monkeypatch, tmp_path, sys.path)
    monkeypatch.setattr("voltllm.worker.runner.ModelRunner.capture_cuda_graphs", tp_eager_graphs._capture)
    return path, engine, greedy, expected


def test_verification_as_decode_graph_rows_on_every_rank(monkeypatch, tmp_path):
    """Verification steps where every request decodes run as decode rows replayed by the decode graphs on both ranks
    (stood in for on the CPU by eager replays on the same buffers, tests/tp_eager_graphs.py)."""
    path, engine, greedy, expected = _graph_form_setup(monkeypatch, tmp_path)
    two = LLM(path, tensor_parallel_size=2, speculative_config=NGRAM, **engine)
    try:
        replays = []
        orig = two.engine.runner._prepare_token_rows

        def token_rows(*args):
            replays.append(two.engine.runner.graphs.replays)
            return orig(*args)

        monkeypatch.setattr(two.engine.runner, "_prepare_token_rows", token_rows)
        assert _tokens(two, PROMPTS, greedy) == expected
        assert replays and two.engine.runner.graphs.replays > 0  # verifications as graph rows
        assert two.engine.stats().extra["spec_accepted_tokens"] > 0
    finally:
        two.engine.shutdown()


def test_split_draft_graph_form_on_every_rank(monkeypatch, tmp_path):
    """A draft model split over both ranks (draft_tensor_parallel_size 2) in its graph form on each (CPU stand-ins of
    the target's and the draft's decode graphs in every process, tests/tp_eager_graphs.py): its proposal passes and its
    run beside decode steps replay from the buffers each rank fills from rank 0's plan; greedy tokens equal plain
    decoding and the target's own drafts are all accepted."""
    path, engine, greedy, expected = _graph_form_setup(monkeypatch, tmp_path)
    spec = {"model": path, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}
    two = LLM(path, tensor_parallel_size=2, speculative_config=spec, **engine)
    try:
        assert _tokens(two, PROMPTS, greedy) == expected
        drafted, accepted = _spec_counts(two)
        assert 0 < accepted == drafted
        assert two.engine.runner.draft.graphs.replays > 0
        assert two.engine.tp_workers.call_on_workers(_draft_replays)[0] > 0
    finally:
        two.engine.shutdown()


def _draft_replays(runner):
    return runner.draft.graphs.replays
