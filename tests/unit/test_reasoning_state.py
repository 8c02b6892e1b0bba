"""The engine's reasoning state (thinking_token_budget, grammars after the reasoning) on hand-made token ids, its
allowed-token rows, the speculation limits, the Frontend's request fields and --reasoning-config."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from voltllm.config import ConfigError
from voltllm.engine.reasoning_state import ON, OPEN, WAIT, ReasoningState
from voltllm.engine.request_checks import InvalidRequestError
from voltllm.reasoning_config import ReasoningConfig, resolve_reasoning
from voltllm.sampling.params import SamplingParams, SamplingParamsError

S, E = 90, 91  # single-token <think>, </think>
S3, E3 = (80, 81, 82), (83, 81, 82)  # multi-token ones ("<" "think" ">", "</" "think" ">")


def feed(st: ReasoningState, tokens) -> list:
    """Append tokens as a sampler obeying the state would: each free token as given, a forced position's token as
    forced. Returns the tokens appended and, per token, whether it went to the grammar."""
    out, grammar = [], []
    for t in tokens:
        f = st.forced()
        tok = f if f is not None else t
        out.append(tok)
        grammar.append(st.accept(tok))
    return out, grammar


def test_prompt_inside_reasoning_counts_its_tokens_and_forces_the_end_at_the_budget():
    st = ReasoningState((S,), (E,), budget=5, grammar=False, prompt=[1, 2, S, 3, 4])  # 2 reasoning tokens
    assert st.inside and st.count == 2 and st.forced() is None
    out, _ = feed(st, [7, 7, 7, 7, 7, 7])
    assert out == [7, 7, 7, E, 7, 7]  # 2 + 3 = 5 reasoning tokens, then the end, then free
    assert not st.inside and st.forced() is None


def test_budget_zero_forces_the_end_at_once_and_prompt_outside_reasoning_forces_nothing():
    st = ReasoningState((S,), (E,), budget=0, grammar=False, prompt=[1, S])
    assert st.forced() == E
    assert feed(st, [5, 6])[0] == [E, 6]
    closed = ReasoningState((S,), (E,), budget=0, grammar=False, prompt=[S, 4, E, 1])  # an earlier, closed block
    assert not closed.inside and closed.forced() is None


def test_the_model_opening_its_reasoning_counts_from_its_start_and_again_after_a_natural_end():
    st = ReasoningState((S,), (E,), budget=2, grammar=False, prompt=[1, 2])
    out, _ = feed(st, [5, S, 6, E, 7, S, 8, 9, 10, 11])
    # a natural end (after 1 token) stops the count; the second block is cut at 2 tokens
    assert out == [5, S, 6, E, 7, S, 8, 9, E, 11]


def test_multi_token_delimiters_are_matched_and_forced_one_token_at_a_time():
    st = ReasoningState(S3, E3, budget=3, grammar=False, prompt=[1, *S3])
    out, _ = feed(st, [5, 6, 7, 8, 8, 8, 9])
    assert out == [5, 6, 7, *E3, 9]
    # a start written over several tokens by the model, then a partial end at the budget: forcing goes on from it
    st = ReasoningState(S3, E3, budget=2, grammar=False, prompt=[1])
    out, _ = feed(st, [*S3, 5, E3[0], 0, 0, 9])
    assert out == [*S3, 5, E3[0], E3[1], E3[2], 9]


def test_grammar_waits_for_the_end_of_reasoning_then_takes_every_token():
    st = ReasoningState((S,), (E,), budget=None, grammar=True, prompt=[1, S])
    assert st.grammar == WAIT and st.forced() is None
    out, grammar = feed(st, [4, 5, E, 6, S, 7])
    assert grammar == [False, False, False, True, True, True]  # a later <think> is the grammar's business
    assert st.grammar == ON and st.forced() is None


def test_the_first_token_may_open_the_reasoning_or_start_the_grammar():
    st = ReasoningState((S,), (E,), budget=None, grammar=True, prompt=[1, 2])
    assert st.grammar == OPEN
    assert feed(st, [4, 5])[1] == [True, True] and st.grammar == ON
    st = ReasoningState((S,), (E,), budget=1, grammar=True, prompt=[1, 2])
    out, grammar = feed(st, [S, 5, 0, 7])  # the start opens the reasoning: the budget, its forced end, the grammar
    assert out == [S, 5, E, 7] and grammar == [False] * 3 + [True]


def test_the_grammar_applies_at_once_after_a_closed_reasoning_or_with_a_start_of_several_tokens():
    """Qwen3 with thinking off writes `<think>\n\n</think>` in the prompt: the reasoning has ended (vLLM reads it
    so), no first-token union; a start of several tokens could begin with the grammar's own text ("<"): no union."""
    closed = ReasoningState((S,), (E,), budget=None, grammar=True, prompt=[1, S, 3, E, 3])
    assert closed.grammar == ON and feed(closed, [S, 4])[1] == [True, True]
    multi = ReasoningState(S3, E3, budget=1, grammar=True, prompt=[1, 2])
    assert multi.grammar == ON and feed(multi, [S3[0], 4])[1] == [True, True]
    unopened = ReasoningState((S,), (E,), budget=None, grammar=True, prompt=[1, 2])
    assert unopened.grammar == OPEN


def test_speculative_rounds_append_several_tokens_and_take_only_safe_drafts():
    st = ReasoningState((S,), (E,), budget=6, grammar=False, prompt=[S, 1])  # count 1
    assert st.max_drafts() == 4  # the bonus token at count 5 is the last free one
    for t in [2, 3, 4, 5, 6]:  # one round's accepted drafts and bonus
        st.accept(t)
    assert st.count == 6 and st.max_drafts() == 0 and st.forced() == E
    st.accept(E)
    assert st.max_drafts() == 6  # outside: a start at the first token leaves the budget's positions free
    waiting = ReasoningState((S,), (E,), budget=None, grammar=True, prompt=[S])
    assert waiting.max_drafts() is None and waiting.drafts_must_be_known
    assert waiting.cut_drafts([3, 4, E, 5]) == [3, 4]  # the end may be the step's last token, not a draft before it
    assert ReasoningState((S,), (E,), None, True, [1]).max_drafts() == 0  # (OPEN: the first token is masked)


def test_may_constrain_keeps_budget_requests_on_the_fast_path_until_near_the_budget():
    st = ReasoningState((S,), (E,), budget=10, grammar=False, prompt=[S, 1, 2])  # count 2
    assert not st.may_constrain(0) and not st.may_constrain(1)
    for t in range(7):
        st.accept(t)
    assert st.count == 9 and not st.may_constrain(0) and st.may_constrain(1)
    outside = ReasoningState((S,), (E,), budget=0, grammar=False, prompt=[1])
    assert not outside.may_constrain(0) and outside.may_constrain(1)  # the unknown token may be <think>
    assert not ReasoningState((S,), (E,), 1, False, [1]).may_constrain(1)
    assert ReasoningState((S,), (E,), None, True, [S]).may_constrain(1)  # an unknown token may end it


def _scheduled(rid, reasoning, grammar=None):
    return SimpleNamespace(samples=True, spec_tokens=(),
                           request=SimpleNamespace(request_id=rid, reasoning=reasoning, grammar=grammar))


def test_masks_give_a_forced_token_a_one_token_row_and_free_reasoning_none():
    from voltllm.sampling.bitmask import TokenBitmask, apply_token_bitmask_
    from voltllm.structured.matchers import GrammarMatchers

    import torch

    g = GrammarMatchers(None, 100)
    forced = ReasoningState((S,), (E3[0],), 0, False, [S])  # (an end token past the first 32: another word)
    free = ReasoningState((S,), (E,), 5, False, [S])
    masks = g.masks([_scheduled("a", free), _scheduled("b", forced)])
    assert list(masks.rows) == ["b"]
    logits = torch.zeros(1, 100)
    apply_token_bitmask_(logits, TokenBitmask(masks.bitmask))
    assert (logits[0] == 0).nonzero().flatten().tolist() == [E3[0]]
    assert g.masks([_scheduled("a", free)]) is None


def test_spec_allowed_caps_drafts_by_the_budget():
    from voltllm.engine.speculative import spec_allowed

    sp = SamplingParams(max_tokens=100, temperature=0, thinking_token_budget=6)
    req = SimpleNamespace(sampling_params=sp, num_pending=0, needs_host_history=False, num_output_tokens=1,
                          max_tokens=100, reasoning=ReasoningState((S,), (E,), 6, False, [S, 1]))
    assert spec_allowed(req, 8) == 4
    grammar = SamplingParams(max_tokens=100, temperature=0, structured_outputs={"regex": "a+"})
    req.sampling_params, req.reasoning = grammar, ReasoningState((S,), (E,), None, True, [S])
    assert spec_allowed(req, 8) == 8  # inside the reasoning no mask applies
    req.reasoning = None
    assert spec_allowed(req, 8) == 8  # the grammar governs: its masks follow the drafts (GrammarMasks.verification)
    req.reasoning = ReasoningState((S,), (E,), None, True, [1, 2])  # the first token may open the reasoning
    assert spec_allowed(req, 8) == 0
    req.reasoning.accept(7)  # (not the start: the grammar governs from here)
    assert spec_allowed(req, 8) == 8


def test_sampling_params_take_vllms_values():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    for bad in (-2, 1.5, True):
        with pytest.raises(SamplingParamsError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)


class _Tok:
    def encode(self, text, add_special_tokens=True):
        return {"<think>": [S], "</think>": [E], "<t>": [*S3]}.get(text, [])


def test_reasoning_config_from_the_parser_or_the_flag():
    r = resolve_reasoning("qwen3", None, False, False, _Tok)
    assert (r.start_ids, r.end_ids, r.grammar_after_reasoning) == ((S,), (E,), True)
    r = resolve_reasoning(None, '{"reasoning_start_str": "<t>", "reasoning_end_str": "</think>"}', False, False, _Tok)
    assert r.start_ids == S3 and not r.grammar_after_reasoning  # (vLLM: without a parser grammars start at once)
    assert not resolve_reasoning("qwen3", None, True, False, _Tok).grammar_after_reasoning  # enable_in_reasoning
    assert resolve_reasoning(None, None, False, False, _Tok) is None
    for value, words in [({"think_start": "x"}, "think_start: not a key"),
                         ({"reasoning_start_str": "<think>"}, "needs reasoning_end_str"),
                         ({"reasoning_start_str": "<think>", "reasoning_end_str": "??"}, "tokenizes to no token"),
                         ({"reasoning_parser": "qwen3"}, "give it as --reasoning-parser"),
                         ("[1]", "must be a JSON object")]:
        with pytest.raises(ConfigError, match=words):
            resolve_reasoning(None, value, False, False, _Tok)
    with pytest.raises(ConfigError, match="not built"):
        resolve_reasoning("granite", None, False, False, _Tok)


def test_the_frontend_fills_the_delimiters_or_refuses_the_budget():
    from voltllm.engine.frontend import Frontend

    plain = Frontend(None, "/nonexistent", 64)
    with pytest.raises(InvalidRequestError, match="--reasoning-parser") as e:
        plain.make_requests("a", [1, 2], SamplingParams(thinking_token_budget=4))
    assert e.value.param == "thinking_token_budget"
    cfg = ReasoningConfig("<think>", "</think>", (S,), (E,), grammar_after_reasoning=True)
    fe = Frontend(None, "/nonexistent", 64, reasoning=cfg)
    sp = fe.make_requests("b", [1, 2], SamplingParams(thinking_token_budget=4))[0].sampling_params
    assert (sp._reasoning_start_ids, sp._reasoning_end_ids, sp._grammar_after_reasoning) == ((S,), (E,), False)
    sp = fe.make_requests("c", [1], SamplingParams(structured_outputs={"regex": "a"}))[0].sampling_params
    assert sp._grammar_after_reasoning and sp._reasoning_end_ids == (E,)
    assert not fe.make_requests("d", [1], SamplingParams())[0].sampling_params._reasoning_end_ids
    inside = Frontend(None, "/nonexistent", 64, reasoning=ReasoningConfig("<think>", "</think>", (S,), (E,)))
    with pytest.raises(InvalidRequestError, match="enable_in_reasoning"):
        inside.make_requests("e", [1], SamplingParams(thinking_token_budget=4, structured_outputs={"regex": "a"}))
