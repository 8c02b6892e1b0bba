"""Beam search above the engine, as vLLM builds it (its BeamSearchParams / BeamSearchSequence / BeamSearchOutput names).

Each step every live beam is one engine request for one token with the top 2 x beam_width logprobs (the engine's
sampled token comes with them: at temperature 0 the argmax, otherwise a draw that joins the candidates even when it
ranks lower, as in vLLM). Every candidate that is an EOS token ends its beam, which is set aside as complete; of the
others the beam_width with the highest cumulative logprob live on. The search ends after max_tokens steps or when no
beam lives; the complete and live beams are then ranked by cumulative logprob / length ** length_penalty, where the
length counts the prompt's tokens too and not a final EOS (vLLM's and transformers' rule), and the best beam_width are
the answer. The engine core knows nothing of it: the offline LLM (entrypoints/llm.py) and AsyncLLM drive the steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from voltllm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from voltllm.sampling.params import MAX_N


class BeamSearchParamsError(ValueError):
    """An invalid beam-search parameter; the message names it (an HTTP 400)."""


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None  # vLLM's newer field: not built here (the grammar would have to follow each beam)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise BeamSearchParamsError(f"{name} {why}, got {getattr(self, name)!r}")

        if self.structured_outputs is not None:
            bad("structured_outputs", "with beam search is not built in voltllm (must be None)")

        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_N:
            bad("beam_width", f"must be an integer in [1, {MAX_N}]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            bad("temperature", "must be a finite number >= 0")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            bad("length_penalty", "must be a finite number")

    @property
    def num_candidates(self) -> int:
        """Candidates per beam and step: the top 2 x beam_width tokens (transformers' and vLLM's choice)."""
        return 2 * self.beam_width


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ones (vLLM's offline shape), `logprobs` one dict per
    generated token (the step's candidates: the engine's sampled token first, then the top tokens by rank)."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop" (an EOS token) or "length" (max_tokens)
    stop_reason: Union[int, str, None] = None  # the EOS token id that ended it


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""
    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: Sequence[int], cum_logprob: float, eos_ids: Sequence[int],
                      length_penalty: float = 1.0) -> float:
    """cum_logprob / length ** length_penalty; the length counts the prompt's tokens, not a final EOS (vLLM's)."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0)
    return cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search: `live` are the beams to expand next (each one engine request of one token), `advance`
    takes their next-token logprobs, `best()` the answer once `done`."""

    def __init__(self, prompt_ids: Sequence[int], params: BeamSearchParams, eos_ids: Sequence[int]):
        self.params = params
        self.eos_ids = frozenset(eos_ids)
        self.prompt_ids = list(prompt_ids)
        self.num_prompt_tokens = len(self.prompt_ids)
        self.live = [BeamSearchSequence(list(self.prompt_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not self.live

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos_ids, self.params.length_penalty)

    def advance(self, positions: Sequence[dict[int, Logprob]]) -> None:
        """positions[i]: live beam i's next-token logprobs as the engine gives them (the sampled token first, then
        the top tokens ranked 1..k; k may exceed num_candidates when the caller asked more, for the answer's
        logprobs: only the sampled token and the ranks up to num_candidates are candidates)."""
        if len(positions) != len(self.live):
            raise ValueError(f"{len(self.live)} live beams but {len(positions)} positions")
        top = self.params.num_candidates
        stop_on_eos = not self.params.ignore_eos
        candidates: list[BeamSearchSequence] = []
        for beam, pos in zip(self.live, positions):
            for j, (tid, lp) in enumerate(pos.items()):
                if j > 0 and (lp.rank is None or lp.rank > top):
                    continue
                seq = BeamSearchSequence(beam.tokens + [tid], beam.logprobs + [pos], beam.cum_logprob + lp.logprob)
                if stop_on_eos and tid in self.eos_ids:
                    seq.finish_reason, seq.stop_reason = "stop", tid
                    self.completed.append(seq)
                else:
                    candidates.append(seq)
        # beams of one step are all as long: the cumulative logprob ranks them as the length-penalised score would
        candidates.sort(key=lambda s: s.cum_logprob, reverse=True)
        self.live = candidates[:self.params.beam_width]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The best beam_width of the complete and live beams by score (live ones end by length), best first."""
        for beam in self.live:
            beam.finish_reason = "length"
        return sorted(self.completed + self.live, key=self.score, reverse=True)[:self.params.beam_width]

    def output_ids(self, beam: BeamSearchSequence) -> list[int]:
        """The beam's generated tokens as the API answers them (vLLM's server): a final EOS only with
        include_stop_str_in_output."""
        ids = beam.tokens[self.num_prompt_tokens:]
        if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            ids = ids[:-1]
        return ids


def answer_logprobs(beam: BeamSearchSequence, ids: Sequence[int], top_n: int) -> list[dict[int, Logprob]]:
    """The beam's logprobs in the engine's per-token shape for `ids` (its output ids): the chosen token first, then
    the top_n by rank, so the HTTP logprobs read them as those of a sampled request."""
    out = []
    for tid, pos in zip(ids, beam.logprobs):
        entry = {tid: pos[tid]}
        for t, lp in sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else math.inf):
            if t != tid and lp.rank is not None and lp.rank <= top_n:
                entry[t] = lp
        out.append(entry)
    return out


def answer(search: BeamSearch, request_id: str, prompt: Optional[str], tokenizer: Any,
           skip_special_tokens: bool = True, num_logprobs: Optional[int] = None,
           num_cached_tokens: int = 0) -> RequestOutput:
    """The finished search as one RequestOutput for the HTTP API: choice i is the i-th best beam, its text the
    decoded output (an EOS's text only with include_stop_str_in_output, as in voltllm's other answers)."""
    outputs = []
    for i, beam in enumerate(search.best()):
        ids = search.output_ids(beam)
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""
        outputs.append(CompletionOutput(
            index=i, text=text, token_ids=ids, cumulative_logprob=beam.cum_logprob,
            logprobs=answer_logprobs(beam, ids, num_logprobs) if num_logprobs is not None else None,
            finish_reason=beam.finish_reason, stop_reason=beam.stop_reason))
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(search.prompt_ids),
                         outputs=outputs, finished=True, num_cached_tokens=num_cached_tokens)
