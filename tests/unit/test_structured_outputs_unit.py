"""Structured outputs without an engine: the params' checks, the request-parameter mapping, the bitmask applied to
logits (every sampler path), the grammar's JSON strings, and structural tags' grammars."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

from structured_cases import CHOICES, LEGACY_TAG, REGEX, SCHEMA, TAG_SCHEMA, structural_tag
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from voltllm.sampling.bitmask import TokenBitmask, apply_token_bitmask_
from voltllm.sampling.params import SamplingParams, SamplingParamsError
from voltllm.sampling.sampler import Sampler, SamplingRow
from voltllm.sampling.structured import StructuredOutputsError, StructuredOutputsParams


def test_params_take_exactly_one_valid_constraint():
    # one key per schema however it is spaced (compiled grammars are cached by it)
    assert StructuredOutputsParams(json=SCHEMA).key == StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2)).key
    assert StructuredOutputsParams(choice=CHOICES).kind == "choice"
    for kwargs, field in [({}, "json"), ({"regex": REGEX, "choice": CHOICES}, "choice"),
                          ({"json": "{oops"}, "json"), ({"json": "[1]"}, "json"), ({"json": {"type": "nope"}}, "json"),
                          ({"regex": "(abc"}, "regex"), ({"grammar": "root ::= "}, "grammar"),
                          ({"choice": []}, "choice"), ({"choice": ["a", 3]}, "choice")]:
        with pytest.raises(StructuredOutputsError) as e:
            StructuredOutputsParams(**kwargs)
        assert e.value.field == field, (kwargs, e.value)
    assert isinstance(StructuredOutputsError("x", "y"), SamplingParamsError)


def test_sampling_params_field():
    sp = SamplingParams(structured_outputs={"regex": REGEX})
    assert isinstance(sp.structured_outputs, StructuredOutputsParams)
    assert sp.clone(n=2).structured_outputs.key == ("regex", REGEX)
    assert pickle.loads(pickle.dumps(sp)).structured_outputs.key == ("regex", REGEX)  # (crosses ZMQ pickled)
    with pytest.raises(SamplingParamsError):
        SamplingParams(structured_outputs={"pattern": REGEX})
    with pytest.raises(SamplingParamsError):
        SamplingParams(structured_outputs="json")


def test_request_parameters_map_to_one_constraint():
    def so(cls=CompletionRequest, **kw):
        req = cls(prompt="x", messages=[], **kw)
        req.check()
        return req.sampling_params(8, None).structured_outputs

    assert so(response_format={"type": "text"}) is None
    assert so(ChatCompletionRequest, response_format={"type": "json_object"}).kind == "json_object"
    assert so(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}).kind == "json"
    assert so(guided_json=SCHEMA).key == so(structured_outputs={"json": SCHEMA}).key
    assert so(guided_choice=CHOICES).key == ("choice", '["yes", "no", "maybe so"]')
    assert so(guided_regex=REGEX).kind == "regex"
    assert so(structured_outputs={"json_object": True, "regex": None}).kind == "json_object"
    for kw, param in [({"guided_regex": REGEX, "guided_choice": CHOICES}, "guided_choice"),
                      ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": REGEX}},
                       "structured_outputs"),
                      ({"guided_json": {"type": "nope"}}, "guided_json"),
                      ({"response_format": {"type": "xml"}}, "response_format"),
                      ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs")]:
        with pytest.raises(OpenAIError) as e:
            so(**kw)
        assert e.value.status == 400 and e.value.param == param, (kw, e.value.message)


def _random_bitmask(rows: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    allowed[:, 0] = True
    words = -(-vocab // 32)
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)  # as int32 words
    return allowed, packed


def test_bitmask_masks_exactly_the_disallowed_tokens():
    gen = torch.Generator().manual_seed(0)
    for vocab in (32, 100, 417):
        allowed, packed = _random_bitmask(3, vocab, gen)
        packed[1] = -1  # a row that allows everything
        allowed[1] = True
        logits = torch.randn(3, vocab, generator=gen)
        out = apply_token_bitmask_(logits.clone(), TokenBitmask(packed))
        assert torch.equal(out == float("-inf"), ~allowed)
        assert torch.equal(out[allowed], logits[allowed])
        # only some rows constrained: rows 3 and 0 of a batch of 5 take mask rows 0 and 2
        batch = torch.randn(5, vocab, generator=gen)
        out = apply_token_bitmask_(batch.clone(), TokenBitmask(packed[[0, 2]], torch.tensor([3, 0])))
        assert torch.equal(out[3] == float("-inf"), ~allowed[0]) and torch.equal(out[0] == float("-inf"), ~allowed[2])
        assert torch.equal(out[[1, 2, 4]], batch[[1, 2, 4]])


def test_sampler_applies_the_mask_before_every_path():
    gen = torch.Generator().manual_seed(1)
    vocab = 300
    allowed, packed = _random_bitmask(4, vocab, gen)
    logits = torch.randn(4, vocab, generator=gen).to(torch.float16)
    before = logits.clone()
    sampler = Sampler(torch.Generator().manual_seed(2))
    greedy = sampler.sample_argmax(logits, TokenBitmask(packed)).tokens
    assert torch.equal(logits, before)  # the caller's logits are left as they were
    assert all(allowed[i, t] for i, t in enumerate(greedy.tolist()))
    assert torch.equal(greedy, logits.float().masked_fill(~allowed, float("-inf")).argmax(-1))
    rows = [SamplingRow(SamplingParams(temperature=t, logprobs=3), (), (), None) for t in (0.0, 1.0, 1.5, 1.0)]
    for _ in range(5):
        out = sampler.sample(logits, rows, token_bitmask=TokenBitmask(packed))
        tokens, logprobs = out.to_host()
        assert all(allowed[i, t] for i, t in enumerate(tokens))
        for i, lp in enumerate(logprobs):  # logprobs after the mask: the allowed tokens' mass is 1
            top = [t for t, (v, _) in lp.items() if v > float("-inf")]
            assert all(allowed[i, t] for t in top)
    assert torch.equal(logits, before)


def test_json_strings_exclude_control_characters():
    """xgrammar 0.2.8 lets control characters into strings with maxLength; our grammar does not (valid JSON)."""
    from xgrammar.testing import _is_grammar_accept_string

    from voltllm.structured.grammar import grammar_for

    grammar = grammar_for(StructuredOutputsParams(json=SCHEMA).key)
    good = '{"name": "ab", "ok": true, "n": 3, "tags": ["a"]}'
    assert _is_grammar_accept_string(grammar, good)
    assert not _is_grammar_accept_string(grammar, good.replace("ab", "a\x16"))


def test_json_any_whitespace_grammars(tmp_path):
    """JSON grammars are compact by default; with any_whitespace (--structured-outputs-config disable_any_whitespace
    false) they take free whitespace between tokens, as vLLM's, in the grammar cache and the engine's compile alike.
    Other kinds do not change."""
    import xgrammar as xgr

    from tiny_models import make_tokenizer
    from voltllm.structured.grammar import grammar_for
    from voltllm.structured.matchers import GrammarMatchers

    spaced, compact = '{\n  "a" : [ 1 ,2 ]\n}', '{"a": [1, 2]}'
    for params in (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "array"}},
                                                 "required": ["a"]}), StructuredOutputsParams(json_object=True)):
        free, tight = grammar_for(params.key, True), grammar_for(params.key)
        assert free is not tight and grammar_for(params.key, False) is tight  # (cached by the setting too)
        assert xgr.testing._is_grammar_accept_string(free, spaced)
        assert xgr.testing._is_grammar_accept_string(free, compact)
        assert not xgr.testing._is_grammar_accept_string(tight, spaced)
        assert xgr.testing._is_grammar_accept_string(tight, compact)
    regex = StructuredOutputsParams(regex="a b").key
    assert str(grammar_for(regex, True)) == str(grammar_for(regex))
    tok = make_tokenizer(str(tmp_path))
    key = StructuredOutputsParams(json_object=True).key
    for any_whitespace, accepted in ((True, True), (False, False)):
        matchers = GrammarMatchers(lambda: tok, len(tok), json_any_whitespace=any_whitespace)
        assert xgr.GrammarMatcher(matchers._build(key)).accept_string('{\n "a" : 1 }') is accepted


def test_request_structured_outputs_options():
    """vLLM's structured_outputs options at what voltllm does are accepted (disable_fallback: xgrammar never falls
    back; disable_any_whitespace true: compact JSON), flexible whitespace and unknown fields are a 400 by name."""
    def constraint(so):
        return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], structured_outputs=so).constraint()

    got = constraint({"regex": "[ab]+", "disable_fallback": True, "disable_any_whitespace": True})
    assert got.key == ("regex", "[ab]+")
    for so, words in (({"regex": "a", "disable_any_whitespace": False}, "disable_any_whitespace false"),
                      ({"regex": "a", "whitespace_pattern": " "}, "unsupported fields: whitespace_pattern"),
                      ({"regex": "a", "disable_fallback": "yes"}, "disable_fallback must be true or false")):
        with pytest.raises(OpenAIError, match=words):
            constraint(so)


def test_structural_tag_params_and_key():
    """Both of vLLM's forms, as an object or its JSON text, give one key: xgrammar's form (the older one rewritten),
    which the grammar and its compile are cached by; a malformed tag names structural_tag."""
    legacy_as_new = structural_tag()
    legacy_as_new["format"]["tags"] = [{"begin": "<f>", "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
                                        "end": "</f>"}]
    key = StructuredOutputsParams(structural_tag=json.dumps(LEGACY_TAG)).key
    assert key[0] == "structural_tag" and json.loads(key[1])["format"]["type"] == "triggered_tags"
    assert StructuredOutputsParams(structural_tag=LEGACY_TAG).key == key
    assert (StructuredOutputsParams(structural_tag=json.dumps(structural_tag(), indent=2)).key ==
            StructuredOutputsParams(structural_tag=structural_tag()).key)
    assert pickle.loads(pickle.dumps(SamplingParams(structured_outputs={"structural_tag": LEGACY_TAG}))
                        ).structured_outputs.key == key
    bad_format = {"type": "structural_tag", "format": {"type": "nope"}}
    wrong_trigger = {**LEGACY_TAG, "triggers": ["<g"]}
    for tag, words in [("{oops", "not valid JSON"), ("[1]", "must be a JSON object"), (3, "JSON object or its JSON"),
                       ({"type": "structural_tag"}, "needs a format"),
                       ({**LEGACY_TAG, "format": {}}, "not both"),
                       ({**LEGACY_TAG, "at_least_one": True}, "structures and triggers only"),
                       ({**LEGACY_TAG, "structures": [{"begin": "<f>", "end": "</f>"}]}, "schema must be"),
                       ({**LEGACY_TAG, "triggers": []}, "triggers must be"),
                       (bad_format, "Format type not recognized: nope"),
                       (wrong_trigger, "does not match any trigger"),
                       (structural_tag() | {"format": {"type": "regex", "pattern": "(ab"}}, "Regex parsing error"),
                       ({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": "nope"}}},
                        "Unsupported type")]:
        with pytest.raises(StructuredOutputsError, match=words) as e:
            StructuredOutputsParams(structural_tag=tag)
        assert e.value.field == "structural_tag" and "invalid structural tag" in str(e.value), (tag, e.value)
        assert "[" not in str(e.value).split(":")[0] and "Invalid structural tag error" not in str(e.value)
    with pytest.raises(StructuredOutputsError, match="exactly one of .*structural_tag"):
        StructuredOutputsParams(regex=REGEX, structural_tag=LEGACY_TAG)


def test_structural_tag_grammar_free_text_and_tags():
    """Outside a trigger the text is free; from a trigger on, a tag's begin, JSON following its schema, its end; then
    free text again. The older form allows xgrammar's free JSON whitespace, the newer one what its format says."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from voltllm.structured.grammar import grammar_for

    legacy = grammar_for(StructuredOutputsParams(structural_tag=LEGACY_TAG).key)
    new = grammar_for(StructuredOutputsParams(structural_tag=structural_tag()).key)
    forced = grammar_for(StructuredOutputsParams(structural_tag=structural_tag(at_least_one=True,
                                                                               stop_after_first=True)).key)
    tag = '<f>{"n": 7, "ok": true}</f>'
    for g in (legacy, new):
        assert accepts(g, "any text at all, {not json} f> ]")
        assert accepts(g, "free " + tag + " free again " + tag)
        assert not accepts(g, "free <g>")  # the trigger "<" leads to "<f>" only
        assert not accepts(g, '<f>{"n": 7}</f>')  # the schema's required key
        assert not accepts(g, '<f>{"n": 100, "ok": true}</f>')
        assert not accepts(g, '<f>{"n": 7, "ok": true} and on')  # its end
    assert accepts(legacy, '<f>{\n   "n":  7, "ok": true}</f>') and not accepts(new, '<f>{  "n": 7, "ok": true}</f>')
    assert accepts(forced, tag) and not accepts(forced, "x" + tag) and not accepts(forced, tag + "x")
    # a token named by its text is resolved against the vocabulary: only the engine's compile can build it
    token_tag = {"type": "structural_tag", "format": {"type": "token", "token": "<|im_end|>"}}
    assert grammar_for(StructuredOutputsParams(structural_tag=token_tag).key) is None


def test_structural_tag_request_parameters():
    """response_format {"type": "structural_tag", ...} (either form) and structured_outputs.structural_tag (JSON
    text) map to one constraint; a malformed tag is a 400 naming the parameter."""
    def so(**kw):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw)
        req.check()
        return req.sampling_params(8, None).structured_outputs

    key = StructuredOutputsParams(structural_tag=LEGACY_TAG).key
    assert so(response_format=LEGACY_TAG).key == key
    assert so(structured_outputs={"structural_tag": json.dumps(LEGACY_TAG)}).key == key
    assert so(response_format=structural_tag()).key == so(structured_outputs={
        "structural_tag": json.dumps(structural_tag())}).key
    assert CompletionRequest(prompt="x", response_format=LEGACY_TAG).constraint().key == key
    for kw, param, words in [
            ({"response_format": {"type": "structural_tag"}}, "response_format", "needs a format"),
            ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format", "nope"),
            ({"response_format": {**LEGACY_TAG, "triggers": ["<g"]}}, "response_format", "any trigger"),
            ({"structured_outputs": {"structural_tag": "{oops"}}, "structured_outputs", "not valid JSON"),
            ({"structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG), "regex": "a"}}, "structured_outputs",
             "one structured-output constraint"),
            ({"response_format": LEGACY_TAG, "guided_regex": "a"}, "guided_regex", "one structured-output")]:
        with pytest.raises(OpenAIError, match=words) as e:
            so(**kw)
        assert e.value.status == 400 and e.value.param == param, (kw, e.value.message)


def test_draft_masks_follow_the_drafts_and_leave_the_matcher_as_it_was(tmp_path):
    """A verification's masks (GrammarMasks.verification, draft_masks): row j is what the grammar allows after the
    drafts before it, as a matcher advanced by hand gives; from a refused draft on the rows allow everything (never
    emitted); valid_drafts keeps the accepted prefix; the matcher is where it was afterwards."""
    import xgrammar as xgr

    from tiny_models import make_tokenizer
    from voltllm.structured.matchers import GrammarMasks, GrammarMatchers, valid_drafts

    tok = make_tokenizer(str(tmp_path))
    words = (len(tok) + 31) // 32
    compiled = GrammarMatchers(lambda: tok, len(tok))._build(StructuredOutputsParams(regex="ab(cd|ce)f").key)
    ids = [tok.encode(c, add_special_tokens=False)[0] for c in "abcdfx"]
    a, b, c, d, f, x = ids
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_token(a)

    def mask_after(tokens):
        probe = xgr.GrammarMatcher(compiled)
        for t in [a, *tokens]:
            assert probe.accept_token(t)
        row = torch.zeros(1, words, dtype=torch.int32)
        probe.fill_next_token_bitmask(row)
        return row[0]

    class Req:
        grammar = matcher

    masks = GrammarMasks({}, torch.zeros(0, words, dtype=torch.int32), {"r": Req()})
    dst, rows = masks.verification([("free", [7, 8]), ("r", [b, c, x, d])])
    assert dst == list(range(3, 8))  # (the unconstrained request's three rows come first)
    for j, before in enumerate([[], [b], [b, c]]):
        assert torch.equal(rows[j], mask_after(before)), j
    assert (rows[3:] == -1).all()  # after the refused x
    assert valid_drafts(matcher, [b, c, d, f]) == [b, c, d, f] and valid_drafts(matcher, [b, x, c]) == [b]
    assert torch.equal(GrammarMasks({}, rows[:0], {"r": Req()}).verification([("r", [])])[1][0], mask_after([]))
    assert masks.verification([("free", [1])]) is None
