"""allowed_token_ids and bad_words offline on a tiny random model, with async scheduling on and off: every greedy
token is the model's best among the tokens the restrictions leave (checked against the full raw distribution the
request's logprobs report, which the restrictions do not change), sampled tokens keep to them too, and requests
with them take no drafts beside speculating ones."""
import pytest

from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.sampling.bad_words import bad_words_token_ids, banned_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "What is the capital of France?", "Hello world! Voltllm"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, tiny_path):
    return LLM(tiny_path, block_size=4, max_num_batched_tokens=64, async_scheduling=request.param)


def _greedy(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 16, "ignore_eos": True, **kw})


def _vocab(llm):
    return len(llm.get_tokenizer())


def _best_left(position_logprobs: dict, banned) -> int:
    """The highest raw logprob among the tokens not banned (position_logprobs: the whole vocabulary)."""
    return max((t for t in position_logprobs if t not in banned), key=lambda t: position_logprobs[t].logprob)


def test_allowed_token_ids_greedy_and_sampled(llm):
    vocab = _vocab(llm)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy())]
    allowed = sorted({t for ids in plain for t in ids[1:4]} | {7, 50, 51})
    allowed = [t for t in allowed if t != plain[0][0]][:8]  # the first request's own first choice not allowed
    outs = llm.generate(PROMPTS, _greedy(allowed_token_ids=allowed, logprobs=vocab))
    for out in outs:
        c = out.outputs[0]
        assert set(c.token_ids) <= set(allowed)
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert len(lp) == vocab  # the model's distribution over every token, disallowed ones included
            assert tok == _best_left(lp, set(range(vocab)) - set(allowed))
    assert outs[0].outputs[0].token_ids[0] != plain[0][0]
    sampled = llm.generate(PROMPTS, [SamplingParams(temperature=1.5, seed=i, max_tokens=16, ignore_eos=True,
                                                    allowed_token_ids=allowed) for i in range(len(PROMPTS))])
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in sampled)


def _word_from(llm, ids: list[int], start: int, length: int = 2) -> tuple[str, tuple[int, ...]]:
    """A bad word of `length` tokens whose token sequences include ids[k:k + length], for the first k >= start
    whose text round-trips through the tokenizer so."""
    tok = llm.get_tokenizer()
    for k in range(start, len(ids) - length + 1):
        text = tok.decode(ids[k:k + length])
        seq = tuple(ids[k:k + length])
        if text.strip() and seq in bad_words_token_ids([text], lambda s: tok.encode(s, add_special_tokens=False)):
            return text, seq
    pytest.skip("no two generated tokens round-trip through the tokenizer")


def test_bad_words_greedy_against_the_raw_distribution(llm):
    """At every step the greedy token is the best one the bad words leave, given the tokens generated before it
    (with async scheduling, the step in flight's token included): a multi-token word only bites after its prefix."""
    tok = llm.get_tokenizer()
    vocab = _vocab(llm)
    plain = llm.generate(PROMPTS[:2], _greedy(max_tokens=20))
    base = plain[0].outputs[0].token_ids
    two_word, two_seq = _word_from(llm, base, 2)
    one_word, (one_id,) = _word_from(llm, plain[1].outputs[0].token_ids, 0, 1)
    words = [two_word, one_word]
    seqs = bad_words_token_ids(words, lambda s: tok.encode(s, add_special_tokens=False))
    outs = llm.generate(PROMPTS[:2], _greedy(max_tokens=20, bad_words=words, logprobs=vocab))
    for out in outs:
        got = out.outputs[0].token_ids
        for i, (t, lp) in enumerate(zip(got, out.outputs[0].logprobs)):
            assert t == _best_left(lp, set(banned_tokens(seqs, got[:i])))
        for seq in seqs:
            assert all(tuple(got[i:i + len(seq)]) != seq for i in range(len(got)))
    k = next(i for i in range(len(base) - 1) if tuple(base[i:i + 2]) == two_seq)
    got = outs[0].outputs[0].token_ids
    assert got[:k + 1] == base[:k + 1] and got[k + 1] != base[k + 1]  # its prefix generated, then the ban
    assert one_id in plain[1].outputs[0].token_ids and one_id not in outs[1].outputs[0].token_ids


def test_bad_words_hold_for_sampled_requests(llm):
    tok = llm.get_tokenizer()
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
    base = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]] * 4, params)]
    words = [_word_from(llm, ids, 2, 1)[0] for ids in base] + [_word_from(llm, base[0], 1)[0]]
    seqs = bad_words_token_ids(words, lambda s: tok.encode(s, add_special_tokens=False))
    outs = llm.generate([PROMPTS[0]] * 4, [p.clone(bad_words=words) for p in params])
    for out in outs:
        got = out.outputs[0].token_ids
        for seq in seqs:
            assert all(tuple(got[i:i + len(seq)]) != seq for i in range(len(got)))


def test_a_word_that_gives_no_tokens_is_refused_and_the_engine_goes_on(llm):
    from voltllm.engine.request_checks import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="bad_words"):
        llm.generate(PROMPTS[:1], _greedy(bad_words=["   "]))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.generate(PROMPTS[:1], _greedy(allowed_token_ids=[1, _vocab(llm) + 5000]))
    assert len(llm.generate(PROMPTS[:1], _greedy(max_tokens=3))[0].outputs[0].token_ids) == 3


def test_speculation_leaves_restricted_requests_to_plain_decoding(tiny_path):
    """Requests with allowed_token_ids or bad words decode one token a step beside speculating ones: their outputs
    are plain decoding's, as are the others'."""
    llm = LLM(tiny_path, block_size=4)
    plain = _greedy(max_tokens=30)
    words = [llm.get_tokenizer().decode(llm.generate(PROMPTS[1:2], plain)[0].outputs[0].token_ids[4:6])]
    params = [plain, _greedy(max_tokens=30, allowed_token_ids=list(range(40, 90))),
              _greedy(max_tokens=30, bad_words=words)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = LLM(tiny_path, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_min": 1})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.stats().extra["spec_draft_tokens"] > 0  # the plain request did speculate
