"""Beam search's own rules (engine/beam_search.py) on hand-made next-token logprobs, and the HTTP fields around it
(entrypoints/openai/beam_search.py): the score, the candidates, EOS, the answer's shape, the 400s."""
from __future__ import annotations

import math

import pytest

from voltllm.engine.beam_search import (BeamSearch, BeamSearchParams, BeamSearchParamsError, answer,
                                        answer_logprobs, beam_search_score)
from voltllm.engine.outputs import Logprob
from voltllm.entrypoints.openai.beam_search import beam_search_params
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

EOS = 9
PROMPT = [1, 2, 3]


def pos(*entries: tuple[int, float], sampled: tuple[int, float, int] = None) -> dict[int, Logprob]:
    """The engine's shape: the sampled token first (its own rank), then the given tokens ranked 1..k."""
    out: dict[int, Logprob] = {}
    if sampled is not None:
        out[sampled[0]] = Logprob(sampled[1], rank=sampled[2])
    for r, (t, lp) in enumerate(entries, 1):
        out[t] = Logprob(lp, rank=r)  # (a sampled token among them keeps its place, first, with its top rank)
    return out


def test_score_counts_the_prompt_and_not_a_final_eos():
    assert beam_search_score([1, 2, 3, 4], -2.0, [EOS], 1.0) == -0.5
    assert beam_search_score([1, 2, 3, EOS], -2.0, [EOS], 1.0) == pytest.approx(-2 / 3)
    assert beam_search_score([1, 2, 3, 4], -2.0, [EOS], 0.0) == -2.0
    assert beam_search_score([1, 2, 3, 4], -2.0, [EOS], 2.0) == -2.0 / 16


def test_candidates_are_the_top_2w_and_the_sampled_token():
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=1, max_tokens=3), [EOS, 8])
    # width 1: ranks 1..2 are candidates; rank 3 (an EOS) was asked only for the answer's logprobs; the step's
    # sample (another EOS, rank 40) is a candidate, as in vLLM (temperature above 0)
    search.advance([pos((10, -1.0), (11, -1.5), (EOS, -2.0), sampled=(8, -9.5, 40))])
    assert [b.tokens[-1] for b in search.live] == [10]
    assert [(c.tokens[-1], c.cum_logprob) for c in search.completed] == [(8, -9.5)]
    search.advance([pos((20, -3.0), (21, -3.1), sampled=(21, -3.1, 2))])  # a sample among the top: once
    assert [b.tokens for b in search.live] == [PROMPT + [10, 20]]
    assert search.live[0].cum_logprob == pytest.approx(-4.0) and len(search.live[0].logprobs) == 2


def test_eos_candidates_end_their_beams_and_the_rest_live_on():
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    search = BeamSearch(PROMPT, params, [EOS])
    search.advance([pos((EOS, -0.1), (10, -0.5), (11, -0.7), (12, -3.0))])
    assert [b.tokens[-1] for b in search.live] == [10, 11]  # the EOS candidate does not take a live slot
    assert [(c.tokens[-1], c.finish_reason, c.stop_reason) for c in search.completed] == [(EOS, "stop", EOS)]
    search.advance([pos((EOS, -2.0), (20, -2.1), (21, -2.2), (22, -2.3)),
                    pos((30, -0.2), (EOS, -0.3), (31, -4.0), (32, -4.1))])
    assert len(search.completed) == 3 and [b.tokens[-1] for b in search.live] == [30, 20]
    best = search.best()
    assert [b.tokens[-1] for b in best] == [EOS, 30]  # -0.1 over 3 tokens beats -0.9 over 5
    assert [b.finish_reason for b in best] == ["stop", "length"]


def test_ignore_eos_keeps_eos_beams_alive():
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True), [EOS])
    search.advance([pos((EOS, -0.1), (10, -0.5), (11, -0.7), (12, -3.0))])
    assert not search.completed and [b.tokens[-1] for b in search.live] == [EOS, 10]
    assert search.done and [b.finish_reason for b in search.best()] == ["length", "length"]


def test_length_penalty_changes_the_ranking():
    def finish(length_penalty: float) -> list[int]:
        search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=length_penalty),
                            [EOS])
        search.advance([pos((EOS, -1.0), (10, -1.2), (11, -3.0), (12, -3.1))])
        search.advance([pos((20, -0.3), (21, -4.0), (22, -5.0), (23, -6.0)),
                        pos((30, -2.0), (31, -2.1), (32, -7.0), (33, -8.0))])
        return [len(b.tokens) for b in search.best()]

    # the short complete beam: -1.0 over 3 tokens (its EOS not counted); the long live one: -1.5 over 5
    assert finish(0.0) == [4, 5]  # raw cumulative logprob: the shorter wins
    assert finish(0.5) == [4, 5]  # -1.0 / 3 ** 0.5 = -0.58 beats -1.5 / 5 ** 0.5 = -0.67
    assert finish(1.0) == [5, 4]  # -1.5 / 5 = -0.30 beats -1.0 / 3 = -0.33
    assert finish(2.0) == [5, 4]


def test_search_ends_when_no_beam_lives():
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=1, max_tokens=5), [EOS, 8])
    search.advance([pos((EOS, -0.1), (8, -0.2))])
    assert search.done and search.steps == 1 and not search.live
    assert [b.stop_reason for b in search.best()] == [EOS]


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" if i == EOS and not skip_special_tokens else ("" if i == EOS else f"t{i}")
                       for i in ids)


@pytest.mark.parametrize("include", [False, True])
def test_answer_shape(include):
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=2, include_stop_str_in_output=include),
                        [EOS])
    search.advance([pos((10, -0.5), (EOS, -0.6), (11, -0.7), (12, -3.0))])
    search.advance([pos((20, -0.1), (21, -2.0), (22, -5.0), (23, -6.0)),
                    pos((30, -2.0), (31, -2.1), (32, -7.0), (33, -8.0))])
    out = answer(search, "r1", "prompt", _Tok(), skip_special_tokens=False, num_logprobs=1, num_cached_tokens=2)
    assert out.finished and out.prompt_token_ids == PROMPT and out.num_cached_tokens == 2
    first, second = out.outputs
    assert (first.index, first.token_ids, first.text, first.finish_reason) == (0, [10, 20], "t10t20", "length")
    assert first.cumulative_logprob == pytest.approx(-0.6)
    assert second.finish_reason == "stop" and second.stop_reason == EOS and second.cumulative_logprob == -0.6
    assert second.token_ids == ([EOS] if include else []) and second.text == ("<9>" if include else "")
    # logprobs: the chosen token first, then the top 1 by rank (the engine's per-token shape)
    assert [list(p) for p in first.logprobs] == [[10], [20]]
    assert [list(p) for p in answer_logprobs(search.best()[0], [10, 20], 2)] == [[10, EOS], [20, 21]]
    assert len(second.logprobs) == len(second.token_ids)


@pytest.mark.parametrize("kwargs,field", [({"beam_width": 0}, "beam_width"), ({"beam_width": True}, "beam_width"),
                                          ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                                          ({"length_penalty": math.inf}, "length_penalty"),
                                          ({"structured_outputs": {"json": {}}}, "structured_outputs")])
def test_params_are_checked(kwargs, field):
    with pytest.raises(BeamSearchParamsError, match=field):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


def _requests(**fields):
    return (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields),
            CompletionRequest(prompt="x", **fields))


@pytest.mark.parametrize("field,value", [("stop", ["x"]), ("stop_token_ids", [3]), ("min_tokens", 2),
                                         ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                                         ("repetition_penalty", 1.2), ("logit_bias", {"3": 1}), ("top_p", 0.9),
                                         ("top_k", 5), ("min_p", 0.1), ("seed", 1), ("prompt_logprobs", 1),
                                         ("allowed_token_ids", [5, 6]), ("bad_words", ["x"]),
                                         ("response_format", {"type": "json_object"}), ("guided_regex", "a+")])
def test_fields_beam_search_cannot_honour_are_refused_by_name(field, value):
    for req in _requests(use_beam_search=True, n=2, **{field: value}):
        with pytest.raises(OpenAIError) as e:
            req.check()
        assert e.value.status == 400 and e.value.param == field, e.value.message


def test_more_refusals():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(OpenAIError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], use_beam_search=True, tools=tools,
                              tool_choice="required").check()
    assert e.value.param == "tool_choice"
    with pytest.raises(OpenAIError) as e:
        CompletionRequest(prompt="x", use_beam_search=True, echo=True, logprobs=0).check()
    assert e.value.param == "echo"
    for req in _requests(length_penalty=0.5):  # a beam-search setting without beam search
        with pytest.raises(OpenAIError) as e:
            req.check()
        assert e.value.param == "length_penalty" and "use_beam_search" in e.value.message
    for req in _requests(use_beam_search=True, early_stopping=True):
        with pytest.raises(OpenAIError) as e:
            req.check()
        assert e.value.param == "early_stopping" and e.value.code == "unsupported_parameter"


def test_neutral_values_and_compatible_fields_pass():
    for req in _requests(use_beam_search=True, n=3, length_penalty=0.5, temperature=0, top_p=1.0, top_k=-1,
                         min_p=0.0, repetition_penalty=1.0, stop=[], seed=None, early_stopping=False,
                         ignore_eos=True, include_stop_str_in_output=True, logit_bias={}):
        req.check()
    ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], use_beam_search=True, logprobs=True,
                          top_logprobs=2, echo=True, response_format={"type": "text"}).check()
    CompletionRequest(prompt="x", use_beam_search=True, logprobs=2).check()


def test_request_to_beam_search_params():
    req = CompletionRequest(prompt="x", use_beam_search=True, n=3, length_penalty=0.7, ignore_eos=True)
    p = beam_search_params(req, 12, {}, 20)
    assert (p.beam_width, p.max_tokens, p.temperature, p.length_penalty, p.ignore_eos) == (3, 12, 1.0, 0.7, True)
    assert beam_search_params(req, 12, {"temperature": 0.3}, 20).temperature == 0.3  # the model's default
    req.temperature = 0.0
    assert beam_search_params(req, 12, {"temperature": 0.3}, 20).temperature == 0.0
    with pytest.raises(OpenAIError) as e:  # 2 x n logprobs per step, within --max-logprobs (vLLM's limit)
        beam_search_params(CompletionRequest(prompt="x", use_beam_search=True, n=11), 4, {}, 20)
    assert e.value.param == "n"
    with pytest.raises(OpenAIError) as e:
        beam_search_params(CompletionRequest(prompt="x", use_beam_search=True, temperature=-1.0), 4, {}, 20)
    assert e.value.param == "temperature"


class _FakeEngine:
    def __init__(self):
        self._beam_searches = {}
        self.aborted = []

    def abort(self, request_id, reason=None):
        from voltllm.engine.async_llm import RequestAbortedError

        self.aborted.append(request_id)
        bs = self._beam_searches.pop(request_id, None)
        if bs is not None:
            bs.cancel(RequestAbortedError("aborted"))

    def _beam_search_ended(self):  # (AsyncLLM sends the adapter removals that waited for searches)
        self.ended = getattr(self, "ended", 0) + 1


def test_beam_search_stream_answers_once_and_aborts_its_task():
    import asyncio

    from voltllm.engine.async_beam_search import BeamSearchStream
    from voltllm.engine.async_llm import RequestAbortedError
    from voltllm.engine.outputs import RequestOutput

    async def main():
        engine = _FakeEngine()
        done = RequestOutput("a", None, [1], [], True)
        a = engine._beam_searches["a"] = BeamSearchStream(engine, "a")
        a.start(lambda: asyncio.sleep(0, done))
        assert [out async for out in a] == [done] and "a" not in engine._beam_searches
        assert engine.ended == 1  # the engine hears of every search's end
        a.close()
        assert engine.aborted == []  # finished: nothing to abort

        cancelled = asyncio.Event()

        async def forever():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()  # (where the search closes its step's requests)
                raise

        b = engine._beam_searches["b"] = BeamSearchStream(engine, "b")
        b.start(forever)
        await asyncio.sleep(0)
        engine.abort("b")  # a client gone: the consumer sees RequestAbortedError, the task is cancelled
        with pytest.raises(RequestAbortedError):
            await b.__anext__()
        await asyncio.wait_for(cancelled.wait(), 5)

        c = engine._beam_searches["c"] = BeamSearchStream(engine, "c")
        c.start(forever)
        await asyncio.sleep(0)
        c.close()  # the consumer stops listening: the search is aborted through the engine
        assert engine.aborted[-1] == "c" and "c" not in engine._beam_searches
        with pytest.raises(StopAsyncIteration):
            await c.__anext__()

        async def failing():
            raise ValueError("bad step")

        d = engine._beam_searches["d"] = BeamSearchStream(engine, "d")
        d.start(failing)
        with pytest.raises(ValueError, match="bad step"):
            await d.__anext__()

    asyncio.run(main())
