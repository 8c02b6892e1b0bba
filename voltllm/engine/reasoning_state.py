"""Where a request stands in its reasoning (<think> ... </think>): the engine core's per-request state for
`thinking_token_budget` and for structured outputs that start after the reasoning.

The Frontend, which has the tokenizer, gives each request that needs it the token ids of the reasoning's start and
end (SamplingParams._reasoning_start_ids / _end_ids, from --reasoning-parser or --reasoning-config). The state starts
from the prompt (inside reasoning when its last start comes after its last end; the reasoning tokens already there
count against the budget, as vLLM counts them) and follows every token the scheduler appends (a speculative step
appends several). It decides, per sampled position:

- a forced token: once the reasoning section holds `thinking_token_budget` tokens, the end sequence, one token at a
  time (a one-token allowed mask), then generation goes on freely; a natural end stops the count, a later start
  counts again from 0 (vLLM counts from the last start);
- the grammar's phase (requests whose grammar starts after the reasoning): "wait" while inside reasoning (no mask,
  the matcher is not advanced), "open" at the first output token of a prompt that holds no reasoning (the grammar's
  tokens or the start token, when the start is one token), "on" from the first token after the end sequence (or
  when the first token was the grammar's; at once after a prompt that closed its reasoning, or with a start of
  several tokens).

Masks are built from this in GrammarMatchers.masks; Scheduler.update feeds tokens through `accept`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

WAIT, OPEN, ON = "wait", "open", "on"


def _last_index(tokens: Sequence[int], seq: Sequence[int]) -> int:
    """Index of the last occurrence of seq in tokens, -1 when none."""
    n = len(seq)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i] == seq[0] and list(tokens[i:i + n]) == list(seq):
            return i
    return -1


class ReasoningState:
    """One request's reasoning state. budget: thinking_token_budget (None: no cap); grammar: the request's grammar
    starts after the reasoning."""

    def __init__(self, start: Sequence[int], end: Sequence[int], budget: Optional[int], grammar: bool,
                 prompt: Sequence[int]):
        self.start, self.end = tuple(start), tuple(end)
        self.budget = budget
        self.keep = max(len(self.start), len(self.end))  # the tail that sequence matches need
        last_start, last_end = _last_index(prompt, self.start), _last_index(prompt, self.end)
        self.inside = last_start > last_end
        # tokens since the last start (the prompt's own reasoning tokens count): the reasoning section's length
        self.count = len(prompt) - (last_start + len(self.start)) if self.inside else 0
        self.tail: list[int] = list(prompt[-self.keep:])
        # a grammar waits while the prompt is inside the reasoning; it applies at once after a reasoning the prompt
        # closed (Qwen3's enable_thinking=false writes "<think>\n\n</think>": no new reasoning, as vLLM reads it), or
        # when the start is several tokens (its first could be the grammar's own text); else the first token may
        # open the reasoning (a single special token beside the grammar's: OPEN)
        closed = 0 <= last_start < last_end
        self.grammar = None if not grammar else (
            WAIT if self.inside else ON if closed or len(self.start) > 1 else OPEN)

    # -- what the next position must be -------------------------------------------------------
    def _end_matched(self) -> int:
        """How much of the end sequence the reasoning section ends with (a partial end being written)."""
        for k in range(min(len(self.end) - 1, self.count), 0, -1):
            if tuple(self.tail[-k:]) == self.end[:k]:
                return k
        return 0

    @property
    def tracking(self) -> bool:
        """Reasoning still matters: once a grammar has started it governs every token (no more forcing)."""
        return self.grammar != ON

    def forced(self) -> Optional[int]:
        """The token the next position must be, or None."""
        if self.inside and self.budget is not None and self.count >= self.budget and self.tracking:
            return self.end[self._end_matched()]
        return None

    def may_constrain(self, unknown: int) -> bool:
        """Whether the next position may get a mask while `unknown` earlier tokens are not known yet (async
        scheduling: the step in flight's). False keeps the request on the unconstrained fast path."""
        if self.grammar in (OPEN, ON):
            return True
        if self.grammar == WAIT and unknown:
            return True  # an unknown token may end the reasoning: the grammar then starts
        if self.budget is None or not self.tracking:
            return False
        if self.inside:
            return self.count + unknown >= self.budget
        # a start completed by the j-th unknown token leaves unknown - 1 - j reasoning tokens before this position
        return unknown > 0 and self.budget <= unknown - 1

    def max_drafts(self) -> Optional[int]:
        """Speculation: the most drafts this request may take with no mask needed on any of the step's positions
        but its grammar's (None: no limit from its reasoning). A draft verified without the mask it needed would
        break the budget or the grammar. Once the grammar governs (ON) its masks follow the drafts in the
        verification (GrammarMasks.verification); at OPEN the first token may still open the reasoning instead."""
        if self.grammar == ON:
            return None
        if self.grammar == OPEN or self.forced() is not None:
            return 0
        if self.budget is None or not self.tracking:
            return None
        # the k drafts and the bonus token are sampled with count .. count + k reasoning tokens before them
        return self.budget - self.count - 1 if self.inside else self.budget

    @property
    def drafts_must_be_known(self) -> bool:
        """A grammar waiting for the end of reasoning takes only drafts it can check first (cut_drafts): n-gram
        ones, not a drafter's, which are made on the device."""
        return self.grammar == WAIT

    def cut_drafts(self, drafts: list[int]) -> list[int]:
        """Known drafts (n-gram) of a grammar request waiting for the end of reasoning: those before the one that
        would complete the end sequence (tokens after it would need the grammar's mask). The model's own token after
        the kept drafts may end the reasoning: the grammar starts at the next step."""
        if self.grammar != WAIT:
            return drafts
        probe = _Probe(self)
        for i, tok in enumerate(drafts):
            if probe.ends_with(tok):
                return drafts[:i]
        return drafts

    # -- following the tokens -----------------------------------------------------------------
    def accept(self, token: int) -> bool:
        """Advance by an appended token. True when the token is the grammar's (its matcher accepts it)."""
        if self.grammar == ON:
            return True
        if self.grammar == OPEN:
            if token != self.start[0]:
                self.grammar = ON
                return True
            self.grammar = WAIT  # the first token (the one-token start) opened the reasoning
            self._push(token)
            self._opened()
            return False
        self._push(token)
        if self.inside:
            self.count += 1
            if self.count >= len(self.end) and tuple(self.tail[-len(self.end):]) == self.end:
                self.inside, self.count = False, 0
                if self.grammar == WAIT:
                    self.grammar = ON  # the grammar starts with the next token
        elif tuple(self.tail[-len(self.start):]) == self.start:
            self._opened()
        return False

    def _opened(self) -> None:
        self.inside, self.count = True, 0

    def _push(self, token: int) -> None:
        self.tail.append(token)
        if len(self.tail) > self.keep:
            del self.tail[0]


class _Probe:
    """A copy of a waiting state's end-sequence matching, advanced over drafts that are not appended."""

    def __init__(self, st: ReasoningState):
        self.end, self.inside, self.count = st.end, st.inside, st.count
        self.tail = list(st.tail)
        self.start = st.start

    def ends_with(self, token: int) -> bool:
        self.tail = (self.tail + [token])[-max(len(self.start), len(self.end)):]
        if self.inside:
            self.count += 1
            return self.count >= len(self.end) and tuple(self.tail[-len(self.end):]) == self.end
        if tuple(self.tail[-len(self.start):]) == self.start:
            self.inside, self.count = True, 0
        return False


def wants_state(sp: Any) -> bool:
    """Whether a request's params need a reasoning state: a thinking budget, or a grammar that starts after the
    reasoning (the Frontend filled the start / end ids for either)."""
    return bool(sp._reasoning_end_ids) and (sp.thinking_token_budget is not None or sp._grammar_after_reasoning)


class ReasoningStates:
    """The live requests' reasoning states (a request holds its own as Request.reasoning); released when the request
    finishes or is aborted (EngineCore.check_integrity checks that none outlives its request)."""

    def __init__(self) -> None:
        self.live: dict[str, ReasoningState] = {}

    def __len__(self) -> int:
        return len(self.live)

    def attach(self, req: Any) -> None:
        sp = req.sampling_params
        if not wants_state(sp):
            return
        req.reasoning = self.live[req.request_id] = ReasoningState(
            sp._reasoning_start_ids, sp._reasoning_end_ids, sp.thinking_token_budget,
            sp._grammar_after_reasoning and sp.structured_outputs is not None, req.prompt_token_ids)

    def release(self, req: Any) -> None:
        if req.reasoning is not None:
            req.reasoning = None
            self.live.pop(req.request_id, None)
