"""Speculative decoding for constrained requests, offline on a tiny random qwen3: structured outputs (each
verification row masked by the grammar after the drafts before it), bad words (each row's bans after the history and
the drafts before it) and prompt logprobs. Greedy tokens equal plain decoding's, with host drafts (n-gram) and device
drafts (a draft model); oracle drafts (tests/spec_oracle.py: a plain run's tokens, every fifth wrong) make most of
them accepted and the wrong ones fall outside the grammar."""
import pytest

from spec_oracle import oracle_table, patch_draft_model, patch_ngram
from structured_cases import CHOICES, GRAMMAR, GRAMMAR_RE, REGEX, SCHEMA, check_regex_output, check_schema_output
from tiny_models import make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "What is the capital of France?", "Hello world! Voltllm", "0123456789 0123"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="module")
def plain(tiny_path):
    return LLM(tiny_path, block_size=4)


def _spec(tiny_path, method):
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 4}
    return LLM(tiny_path, block_size=4, speculative_config=spec)


def _greedy(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 60, **kw})


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _check_clean(llm):
    assert len(llm.engine.grammars) == 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_requests_speculate_and_keep_plain_tokens(tiny_path, plain, monkeypatch, method):
    """Greedy JSON-schema, regex, choice and EBNF requests with oracle drafts: the drafts that follow the plain
    constrained output are accepted, the wrong ones (outside the grammar) rejected by the masked verification, and
    the tokens equal plain decoding's. Seeded sampled constrained requests beside them stay inside their grammar."""
    params = [_greedy(structured_outputs={"json": SCHEMA}), _greedy(structured_outputs={"regex": REGEX}),
              _greedy(structured_outputs={"choice": CHOICES}), _greedy(structured_outputs={"grammar": GRAMMAR})]
    want = plain.generate(PROMPTS, params)
    vocab = len(plain.get_tokenizer())
    table = oracle_table([o.prompt_token_ids for o in want], _ids(want))
    (patch_ngram if method == "ngram" else patch_draft_model)(monkeypatch, table, vocab)
    llm = _spec(tiny_path, method)
    outs = llm.generate(PROMPTS, params)
    assert _ids(outs) == _ids(want)
    check_schema_output(outs[0].outputs[0].text)
    check_regex_output(outs[1].outputs[0].text)
    assert outs[2].outputs[0].text in CHOICES
    check_regex_output(outs[3].outputs[0].text, GRAMMAR_RE)
    stats = llm.engine.stats().extra
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["spec_accepted_tokens"] > stats["spec_draft_tokens"] / 2  # (most drafts taken: several per step)
    sampled = [SamplingParams(temperature=0.9, seed=3 + i, max_tokens=60, structured_outputs=p.structured_outputs)
               for i, p in enumerate(params)]
    outs = llm.generate(PROMPTS, sampled)
    check_schema_output(outs[0].outputs[0].text)
    check_regex_output(outs[1].outputs[0].text)
    assert outs[2].outputs[0].text in CHOICES
    check_regex_output(outs[3].outputs[0].text, GRAMMAR_RE)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
    _check_clean(llm)


def test_ngram_drafts_are_cut_at_the_first_token_the_grammar_refuses(tiny_path, plain):
    """Real n-gram drafts of a constrained request: the scheduler keeps only the prefix its grammar accepts, so
    every draft verified is one the grammar allows (a prompt full of the JSON it will write gives n-gram matches),
    and the output is plain decoding's."""
    prompt = 'Write {"name": "ab", "ok": true, "n": 12, "tags": ["a", "b"]} {"name": "ab", "ok": true, "n": 1'
    params = [_greedy(structured_outputs={"json": SCHEMA}), _greedy(max_tokens=30, ignore_eos=True)]
    want = plain.generate([prompt, prompt], params)
    llm = _spec(tiny_path, "ngram")
    seen = []
    sched = llm.engine.scheduler
    orig = sched._propose

    def propose(req, max_new):
        drafts = orig(req, max_new)
        if req.grammar is not None and drafts:
            seen.append(drafts)
            probe = req.grammar.fork()
            assert all(probe.accept_token(t) for t in drafts), drafts
        return drafts

    sched._propose = propose
    outs = llm.generate([prompt, prompt], params)
    assert _ids(outs) == _ids(want)
    check_schema_output(outs[0].outputs[0].text)
    assert seen  # (the constrained request did draft)
    _check_clean(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_bad_words_requests_speculate_and_keep_plain_tokens(tiny_path, plain, method):
    """Bad words of one and of two tokens that the model writes when left alone: the verification bans each one's
    last token after its prefix, in the history or among the drafts before the row, so the self-draft (which bans
    nothing) and n-gram drafts that propose them are rejected and the tokens equal plain decoding's."""
    tok = plain.get_tokenizer()
    prompts = ["0123456789 0123456789 0123456789 0123", "The quick brown fox jumps over the lazy dog. The quick"]
    free = plain.generate(prompts, _greedy(max_tokens=24, ignore_eos=True))
    words = []
    for o in free:
        ids = o.outputs[0].token_ids
        two = next(tok.decode(ids[i:i + 2]) for i in range(3, len(ids) - 1)
                   if tok.encode(tok.decode(ids[i:i + 2]).lstrip(), add_special_tokens=False) == list(ids[i:i + 2]))
        one = next(tok.decode([t]) for t in ids[6:] if tok.encode(tok.decode([t]).lstrip(),
                                                                  add_special_tokens=False) == [t])
        words.append([two, one])
    params = [_greedy(max_tokens=24, ignore_eos=True, bad_words=w) for w in words]
    want = plain.generate(prompts, params)
    assert _ids(want) != _ids(free)  # (the words are ones the model writes)
    llm = _spec(tiny_path, method)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    assert _ids(outs) == _ids(want)
    sampled = [SamplingParams(temperature=0.8, seed=4, max_tokens=24, ignore_eos=True, bad_words=w) for w in words]
    first = llm.generate(prompts, sampled)
    assert _ids(first) == _ids(llm.generate(prompts, sampled))
    llm.engine.check_integrity()


def test_prompt_logprobs_requests_speculate(tiny_path, plain):
    """A request asking prompt logprobs speculates once its prompt is done: its prompt logprobs and tokens are
    plain decoding's, and the self-draft's drafts are all accepted."""
    params = [_greedy(max_tokens=20, ignore_eos=True, prompt_logprobs=2, logprobs=1)] * 2
    want = plain.generate(PROMPTS[:2], params)
    llm = _spec(tiny_path, "draft_model")
    outs = llm.generate(PROMPTS[:2], params)
    stats = llm.engine.stats().extra
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
    assert _ids(outs) == _ids(want)
    for got, exp in zip(outs, want):
        assert len(got.prompt_logprobs) == len(exp.prompt_logprobs) == len(exp.prompt_token_ids)
        for a, b in zip(got.prompt_logprobs[1:], exp.prompt_logprobs[1:]):
            assert {t: round(v.logprob, 4) for t, v in a.items()} == {t: round(v.logprob, 4) for t, v in b.items()}
    llm.engine.check_integrity()
