"""vLLM's allowed_token_ids and bad_words: validation, tokenization of the words, the sampler against a plain reference
(only allowed tokens come out, greedy and random; logprobs stay the model's; a multi-token word is banned only after
its prefix, a one-token word always; min_tokens beside them), the vocabulary checks, the HTTP mapping, and the engine's
bookkeeping (history for async scheduling, no speculation)."""
import math
import tempfile

import pytest
import torch

from voltllm.engine.request_checks import InvalidRequestError, check_vocab
from voltllm.sampling.bad_words import bad_words_token_ids, banned_tokens
from voltllm.sampling.params import MAX_BAD_WORD_SEQUENCES, SamplingParams, SamplingParamsError
from voltllm.sampling.sampler import Sampler, SamplingRow

NEG = float("-inf")


def _row(out=(), gen=None, **kw):
    return SamplingRow(SamplingParams(**kw), [], list(out), gen)


# -- SamplingParams -------------------------------------------------------------------------------------------
def test_params_take_and_check_the_fields():
    sp = SamplingParams(allowed_token_ids=(3, 1), bad_words=["foo", " bar baz"])
    assert sp.allowed_token_ids == [3, 1] and sp.bad_words == ["foo", " bar baz"]
    assert SamplingParams().allowed_token_ids is None and SamplingParams(bad_words=None).bad_words == []
    for kw, match in [(dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
                      (dict(allowed_token_ids=[1, -2]), "allowed_token_ids must be token ids.*-2"),
                      (dict(allowed_token_ids=[1, True]), "allowed_token_ids must be token ids"),
                      (dict(allowed_token_ids=[1.5]), "allowed_token_ids must be token ids"),
                      (dict(allowed_token_ids=7), "allowed_token_ids must be a list"),
                      (dict(bad_words=["ok", ""]), "bad_words must be non-empty strings"),
                      (dict(bad_words=[3]), "bad_words must be non-empty strings"),
                      (dict(bad_words="foo"), "bad_words must be a list of strings")]:
        with pytest.raises(SamplingParamsError, match=match):
            SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(allowed_token_ids=[1]), dict(bad_words=["x"])])
def test_restricted_greedy_requests_leave_the_argmax_fast_path(kw):
    assert SamplingParams(temperature=0).argmax_only
    assert not SamplingParams(temperature=0, **kw).argmax_only


def test_bad_words_history_is_the_longest_prefix():
    assert SamplingParams().bad_words_history == 0
    assert SamplingParams(_bad_words_token_ids=((4,), (5,))).bad_words_history == 0
    assert SamplingParams(_bad_words_token_ids=((4,), (5, 6, 7), (8, 9))).bad_words_history == 2


# -- tokenizing bad words -------------------------------------------------------------------------------------
def _encoder(table):
    return lambda text: table[text]


def test_spaced_form_kept_only_when_it_differs_with_the_same_length():
    enc = _encoder({"cat": [10], " cat": [11],  # another single token: both banned
                    "dog": [20], " dog": [20],  # the same token: once
                    "big cat": [30, 11], " big cat": [31, 11],  # same length, another first token: both
                    "hat": [40], " hat": [1, 40],  # a space token then the word: longer, left out
                    "x": [50], " x": []})  # the spaced form gives nothing: the plain one stays
    assert bad_words_token_ids(["cat", "dog", "  big cat", "hat", "x"], enc) == (
        (10,), (11,), (20,), (30, 11), (31, 11), (40,), (50,))


def test_words_that_give_no_tokens_or_too_many_sequences_are_refused():
    with pytest.raises(InvalidRequestError, match="gives no tokens") as e:
        bad_words_token_ids(["   "], _encoder({"": []}))
    assert e.value.param == "bad_words"
    many = [f"w{i}" for i in range(MAX_BAD_WORD_SEQUENCES // 2 + 1)]
    with pytest.raises(InvalidRequestError, match="too many") as e:
        bad_words_token_ids(many, lambda text: [len(text), 1 if text.startswith(" ") else 2])
    assert e.value.param == "bad_words"
    assert len(bad_words_token_ids(many[:-1], lambda text: [len(text), 1 if text.startswith(" ") else 2])) == 128


def test_bad_words_with_a_real_tokenizer():
    from tiny_models import make_tokenizer

    tok = make_tokenizer(tempfile.mkdtemp())
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    seqs = bad_words_token_ids(["capital", " quick brown"], enc)
    assert tuple(enc("capital")) in seqs and tuple(enc("quick brown")) in seqs
    for word in ("capital", "quick brown"):
        spaced = tuple(enc(" " + word))
        assert (spaced in seqs) == (spaced[0] != enc(word)[0] and len(spaced) == len(enc(word)))


def test_banned_tokens_after_the_prefix_only():
    seqs = ((7,), (1, 2, 3), (4, 5))
    assert banned_tokens(seqs, []) == [7]  # no history: only the one-token word
    assert banned_tokens(seqs, [9, 1, 2]) == [7, 3]
    assert banned_tokens(seqs, [1, 2, 9]) == [7]
    assert banned_tokens(seqs, [2]) == [7]  # shorter than the prefix
    assert banned_tokens(seqs, (8, 4)) == [7, 5]


# -- the sampler against a plain reference --------------------------------------------------------------------
def _reference_logits(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """Plain loops: each row's logits with every restriction applied."""
    out = logits.float().clone()
    for i, r in enumerate(rows):
        sp = r.params
        if sp.allowed_token_ids is not None:
            for t in range(out.shape[1]):
                if t not in sp.allowed_token_ids:
                    out[i, t] = NEG
        past = list(r.output_token_ids)
        for seq in sp._bad_words_token_ids:
            if len(seq) == 1 or (len(past) >= len(seq) - 1 and past[len(past) - len(seq) + 1:] == list(seq[:-1])):
                out[i, seq[-1]] = NEG
        if len(past) < sp.min_tokens:
            for t in list(sp.stop_token_ids) + list(sp._eos_token_ids):
                out[i, t] = NEG
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_rows_against_the_reference(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(6, 40) * 3).to(dtype)
    top = logits.float().argmax(-1).tolist()
    second = logits.float().topk(2).indices[:, 1].tolist()
    rows = [
        _row(temperature=0, allowed_token_ids=[3, 17, 29]),
        _row(temperature=0, allowed_token_ids=[top[1]]),  # the argmax itself allowed
        _row(temperature=0, out=[5, 6], _bad_words_token_ids=((top[2],),)),  # single-token: always
        _row(temperature=0, out=[5, 6], _bad_words_token_ids=((6, top[3]),)),  # prefix just generated: banned
        _row(temperature=0, out=[6, 5], _bad_words_token_ids=((6, top[4]),)),  # prefix not the latest: allowed
        _row(temperature=0, out=[1], min_tokens=3, _eos_token_ids=(top[5],), allowed_token_ids=[top[5], second[5]],
             _bad_words_token_ids=((1, 2),)),
    ]
    for owned in (False, True):
        given = logits.clone()
        out = Sampler().sample(given, rows, logits_owned=owned)
        assert out.tokens.tolist() == _reference_logits(logits, rows).argmax(-1).tolist()
        if not owned:
            assert torch.equal(given, logits)  # the caller's logits untouched
    tokens = out.tokens.tolist()
    assert tokens[1] == top[1] and tokens[2] != top[2] and tokens[3] != top[3] and tokens[4] == top[4]
    assert tokens[0] in (3, 17, 29) and tokens[5] == second[5]


def test_random_rows_draw_only_allowed_tokens_with_their_renormalized_probabilities():
    torch.manual_seed(1)
    logits = torch.randn(1, 30)
    allowed = [2, 5, 11, 23]
    n = 6000
    rows = [_row(temperature=1.0, allowed_token_ids=allowed, logprobs=1)] * n
    tokens, lps = Sampler(torch.Generator().manual_seed(0))(logits.repeat(n, 1), rows)
    assert set(tokens) <= set(allowed)
    want = logits[0, allowed].softmax(-1)
    got = torch.tensor([tokens.count(t) for t in allowed], dtype=torch.float32) / n
    assert torch.allclose(got, want, atol=0.03)
    raw = logits[0].log_softmax(-1)  # logprobs: the model's distribution, not the restricted one
    for tok, lp in zip(tokens[:50], lps[:50]):
        assert math.isclose(lp[tok][0], raw[tok].item(), rel_tol=1e-5)
        assert lp[tok][1] == int((raw >= raw[tok]).sum())


def test_seeded_random_rows_never_sample_a_banned_word_end():
    torch.manual_seed(2)
    logits = torch.zeros(200, 8)
    logits[:, 4] = 5.0  # the likeliest token, banned after 3
    rows = [_row(temperature=1.0, out=[1, 3], gen=torch.Generator().manual_seed(i), _bad_words_token_ids=((3, 4),))
            for i in range(200)]
    tokens, _ = Sampler()(logits.clone(), rows)
    assert 4 not in tokens
    free, _ = Sampler()(logits.clone(), [_row(temperature=1.0, out=[3, 1], gen=torch.Generator().manual_seed(i),
                                              _bad_words_token_ids=((3, 4),)) for i in range(200)])
    assert free.count(4) > 100


def test_logprobs_and_penalties_beside_the_restrictions():
    """Logprobs report the raw logits; penalties and logit_bias apply after the restrictions (a +100 bias cannot
    bring back a token that is not allowed)."""
    torch.manual_seed(3)
    logits = torch.randn(2, 20)
    rows = [_row(temperature=0, logprobs=3, allowed_token_ids=[4, 9], logit_bias={7: 100.0}),
            _row(temperature=0, logprobs=2, repetition_penalty=1.5, out=[4, 2], _bad_words_token_ids=((2, 13),),
                 logit_bias={13: 100.0})]
    tokens, lps = Sampler()(logits.clone(), rows)
    assert tokens[0] == (4 if logits[0, 4] > logits[0, 9] else 9)
    assert tokens[1] != 13
    raw = logits.log_softmax(-1)
    for i, lp in enumerate(lps):
        assert set(lp) == {tokens[i], *raw[i].topk(rows[i].params.logprobs).indices.tolist()}
        for t, (v, _) in lp.items():
            assert math.isclose(v, raw[i, t].item(), rel_tol=1e-5)


def test_min_tokens_with_allowed_ids_and_bad_words():
    """min_tokens bans the stop tokens before the minimum even where they are allowed; after it, an allowed EOS
    can end the request; a bad word and min_tokens ban together."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]])
    sp = dict(temperature=0, min_tokens=2, _eos_token_ids=(3,), allowed_token_ids=[1, 3, 4])
    assert Sampler()(logits.clone(), [_row(out=[1], **sp)])[0] == [4]
    assert Sampler()(logits.clone(), [_row(out=[1, 1], **sp)])[0] == [3]
    assert Sampler()(logits.clone(), [_row(out=[9], _bad_words_token_ids=((9, 4),), **sp)])[0] == [1]


def test_rows_with_their_generated_count_from_in_flight_tokens():
    """num_generated counts tokens in flight for min_tokens; the bad-words check reads the ids handed over."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 4.0, 5.0]])
    row = SamplingRow(SamplingParams(temperature=0, min_tokens=3, _eos_token_ids=(3,),
                                     _bad_words_token_ids=((2, 4),)), [], [2], None, num_generated=3)
    assert Sampler()(logits.clone(), [row])[0] == [3]  # 4 banned after 2; EOS allowed (3 generated)
    row.num_generated = 2
    assert Sampler()(logits.clone(), [row])[0] == [2]


# -- vocabulary checks ----------------------------------------------------------------------------------------
def test_vocabulary_checks_name_the_field():
    check_vocab([1], SamplingParams(allowed_token_ids=[0, 99], _bad_words_token_ids=((99,),)), 100)
    for sp, field in [(SamplingParams(allowed_token_ids=[5, 100]), "allowed_token_ids"),
                      (SamplingParams(bad_words=["x"], _bad_words_token_ids=((3, 100),)), "bad_words"),
                      (SamplingParams(bad_words=["x"]), "bad_words")]:  # words not tokenized by a Frontend
        with pytest.raises(InvalidRequestError) as e:
            check_vocab([1], sp, 100)
        assert e.value.param == field


def test_frontend_tokenizes_bad_words_once_for_every_child():
    from tiny_models import make_tokenizer
    from voltllm.engine.frontend import Frontend

    tok = make_tokenizer(tempfile.mkdtemp())
    fe = Frontend(tok, "/nonexistent", 256)
    reqs = fe.make_requests("r", "hello", SamplingParams(n=2, bad_words=["capital"], temperature=1.0))
    want = bad_words_token_ids(["capital"], lambda t: tok.encode(t, add_special_tokens=False))
    assert want and all(r.sampling_params._bad_words_token_ids == want for r in reqs)
    with pytest.raises(InvalidRequestError, match="gives no tokens"):
        fe.make_requests("s", "hello", SamplingParams(bad_words=[" "]))
    assert "s" not in fe.states
    with pytest.raises(InvalidRequestError, match="tokenizer") as e:
        Frontend(None, "/nonexistent", 256).make_requests("t", [1, 2], SamplingParams(bad_words=["x"]))
    assert e.value.param == "bad_words"


# -- HTTP mapping ---------------------------------------------------------------------------------------------
def test_http_requests_carry_the_fields_and_bad_values_are_400s():
    from voltllm.entrypoints.openai.errors import OpenAIError
    from voltllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from voltllm.entrypoints.openai.serving_common import make_params

    for req in (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], allowed_token_ids=[4, 2],
                                      bad_words=["no"]),
                CompletionRequest(prompt="x", allowed_token_ids=[4, 2], bad_words=["no"])):
        req.check()
        sp = req.sampling_params(16, None)
        assert sp.allowed_token_ids == [4, 2] and sp.bad_words == ["no"]
    for body, field in [(dict(allowed_token_ids=[]), "allowed_token_ids"),
                        (dict(allowed_token_ids=[-1]), "allowed_token_ids"), (dict(bad_words=[""]), "bad_words")]:
        req = CompletionRequest(prompt="x", **body)
        with pytest.raises(OpenAIError) as e:
            make_params(lambda: req.sampling_params(16, None))
        assert e.value.status == 400 and e.value.param == field


# -- engine bookkeeping ---------------------------------------------------------------------------------------
def _request(sp: SamplingParams, output=(), pending=0):
    from voltllm.engine.request import Request
    from voltllm.engine.types import EngineCoreRequest

    r = Request(EngineCoreRequest("r", [1, 2, 3], sp), 256)
    r.all_token_ids += list(output)
    r.num_pending = pending
    return r


def test_multi_token_bad_words_wait_for_the_step_in_flight():
    """A step sampling a multi-token bad word's end needs the latest generated ids on the host (async scheduling
    collects the step in flight first, as for penalties); one-token words need none."""
    assert not _request(SamplingParams(bad_words=["x"], _bad_words_token_ids=((5,),))).needs_host_history
    r = _request(SamplingParams(bad_words=["x"], _bad_words_token_ids=((5,), (6, 7, 8))), output=[9, 10, 11, 12])
    assert r.needs_host_history and list(r.sampling_history()) == [11, 12]
    assert list(_request(r.sampling_params, output=[9]).sampling_history()) == [9]  # generated ids only
    assert list(_request(r.sampling_params).sampling_history()) == []
    assert not _request(SamplingParams(allowed_token_ids=[1])).needs_host_history
    assert list(_request(SamplingParams(presence_penalty=1.0), output=[4, 5, 6]).sampling_history()) == [4, 5, 6]
    assert list(_request(SamplingParams(), output=[4]).sampling_history()) == []


def test_bad_words_and_allowed_ids_requests_take_drafts():
    """Sampler.verify_drafts applies both to every verification row: bad words after the history and the drafts
    before the row (SamplingRow.drafted), allowed_token_ids as one mask."""
    from voltllm.engine.speculative import spec_allowed

    bad = dict(bad_words=["x"], _bad_words_token_ids=((5,),))
    assert spec_allowed(_request(SamplingParams(max_tokens=50)), 4) == 4
    assert spec_allowed(_request(SamplingParams(max_tokens=50, **bad)), 4) == 4
    assert spec_allowed(_request(SamplingParams(max_tokens=50, temperature=0, **bad)), 4) == 4
    assert spec_allowed(_request(SamplingParams(max_tokens=50, allowed_token_ids=[1, 2])), 4) == 4


def test_verification_rows_ban_bad_words_completed_by_the_drafts_before_them():
    """A verification row bans a bad word's last token where the history and the drafts before the row end with
    the rest of it (SamplingRow.drafted); the rows before the prefix is complete do not."""
    sp = SamplingParams(temperature=0, max_tokens=50, bad_words=["x"], _bad_words_token_ids=((3, 7),))
    logits = torch.zeros(3, 10)
    logits[:, 7] = 5.0  # every row's argmax is the word's last token
    history = [1, 2]
    rows = [SamplingRow(sp, [], history, None, 2 + j, drafted) for j, drafted in enumerate([(), (3,), (3, 4)])]
    out = Sampler(torch.Generator().manual_seed(0)).verify_drafts(logits, rows, [3, 4, -1])
    tokens, accepted = out.to_host()
    assert tokens[1] != 7 and tokens[0] == 7 and tokens[2] == 7  # (row 1 follows the drafted 3: 7 banned there)
    assert accepted[:2] == [False, False]  # (drafts 3 and 4 are not the argmax 7)
    assert SamplingRow(sp, [], [1, 3], None, 2).generated == 2  # (history alone: no drafts)
