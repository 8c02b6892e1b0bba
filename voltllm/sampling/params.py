"""SamplingParams: what a request asks of the sampler, validated up front (vLLM field names)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from voltllm.sampling.repetition import RepetitionDetectionParams
    from voltllm.sampling.structured import StructuredOutputsParams

# OpenAI's logit_bias range; larger magnitudes are clamped to it (as vLLM does): +-100 already decides the token
LOGIT_BIAS_LIMIT = 100.0
# completions per request: each is a sequence the API process tracks (a huge n would exhaust its memory)
MAX_N = 1024
# seeds are int64 on the device (vLLM's bounds)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# bad_words' token sequences per request after tokenization (vLLM's default cap): each is checked per step
MAX_BAD_WORD_SEQUENCES = 128


class SamplingParamsError(ValueError):
    """Invalid sampling parameter; the message names the field (becomes an HTTP 400)."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # token id -> value added to its logit before sampling (OpenAI keys are strings of ids: both are accepted)
    logit_bias: Optional[dict[int, float]] = None
    # one output constraint (JSON schema, regex, choice, grammar, JSON object); a dict is taken as its fields
    structured_outputs: Optional["StructuredOutputsParams"] = None
    # only these token ids may be sampled (every other logit -inf); None: all
    allowed_token_ids: Optional[list[int]] = None
    # words never generated: each as written and with a leading space (Frontend turns them into token ids)
    bad_words: Optional[list[str]] = None
    # reasoning models: the most tokens the reasoning section (<think> ... </think>) may hold before its end is forced
    # (vLLM's; -1 means none, as None); needs --reasoning-parser or --reasoning-config (engine/reasoning_state.py)
    thinking_token_budget: Optional[int] = None
    # vLLM's: finish the request (finish_reason "repetition") when its output ends in a pattern of
    # min_pattern_size .. max_pattern_size tokens repeated min_count times; a dict is taken as its fields
    # (sampling/repetition.py)
    repetition_detection: Optional["RepetitionDetectionParams"] = None
    # vLLM's: keep the prompt's last k tokens (or embedding rows; -1: as many as the context holds; None: all), applied
    # by the Frontend (the server cuts its prompts itself, with the request's truncation_side)
    truncate_prompt_tokens: Optional[int] = None
    # vLLM's: free-form arguments for custom sampling code; no in-tree code reads them (vLLM's neither), so they are
    # kept as given and change nothing
    extra_args: Optional[dict[str, Any]] = None
    # Filled by the engine: token ids that end generation (EOS + generation_config's eos ids).
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    # Filled by the Frontend (it has the tokenizer): bad_words as token-id sequences; the sampler reads only these
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # Filled by the Frontend for requests with a thinking budget or structured outputs, when the server knows the
    # reasoning's delimiters: their token ids, and whether the grammar starts after the reasoning
    _reasoning_start_ids: tuple[int, ...] = field(default=(), repr=False)
    _reasoning_end_ids: tuple[int, ...] = field(default=(), repr=False)
    _grammar_after_reasoning: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, (list, tuple)) or self.bad_words is None:
            self.bad_words = list(self.bad_words or [])
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == 0 or (isinstance(self.top_k, int) and self.top_k >= 2**31):
            self.top_k = -1  # 0, or more tokens than any vocabulary has: all of them
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.structured_outputs = _structured(self.structured_outputs)
        self.repetition_detection = _repetition(self.repetition_detection)
        if type(self.thinking_token_budget) is int and self.thinking_token_budget == -1:
            self.thinking_token_budget = None  # vLLM's "unlimited"
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            bad("temperature", "must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            bad("repetition_penalty", "must be a finite number > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            bad("prompt_logprobs", "must be an integer >= 0")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", "must be an integer in [-2**63, 2**63 - 1]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be non-negative integers")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, list):
                bad("allowed_token_ids", "must be a list of token ids")
            if not allowed:  # (vLLM's rule: it would leave no token to sample)
                raise SamplingParamsError("allowed_token_ids must not be empty (null allows every token)")
            wrong = [t for t in allowed if not _is_token_id(t)]
            if wrong:
                raise SamplingParamsError(
                    f"allowed_token_ids must be token ids (non-negative integers), got {wrong[0]!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t == 0 or t < -1):
            bad("truncate_prompt_tokens", "must be an integer >= 1 (keep the prompt's last k tokens) or -1 (the "
                                          "context length)")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            bad("extra_args", "must be a dict")
        budget = self.thinking_token_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            bad("thinking_token_budget", "must be an integer >= 0, or -1 (no cap)")
        if not isinstance(self.bad_words, list):
            bad("bad_words", "must be a list of strings")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            bad("bad_words", "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing else to apply: no penalties, bias, logprobs, allowed_token_ids or bad words, and no
        stop token that min_tokens would have to ban. The sampler's answer is then the argmax of the logits as they
        are."""
        bans = self.min_tokens > 0 and bool(self.stop_token_ids or (not self.ignore_eos and self._eos_token_ids))
        return (self.greedy and not self.has_penalties and not self.logit_bias and self.logprobs is None
                and not bans and self.allowed_token_ids is None and not self.bad_words)

    @property
    def has_penalties(self) -> bool:
        """Repetition / frequency / presence penalties: sampling needs the ids of the earlier tokens."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)

    @property
    def bad_words_history(self) -> int:
        """How many of the latest generated tokens the bad-words check reads: the longest sequence's length - 1
        (0: single-token words only, banned at every step whatever came before)."""
        return max((len(w) for w in self._bad_words_token_ids), default=1) - 1

    def clone(self, **changes) -> "SamplingParams":
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data.update(changes)
        return SamplingParams(**data)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _structured(value) -> Optional["StructuredOutputsParams"]:
    """A StructuredOutputsParams (checked when it was made), or one made from a dict of its fields."""
    from voltllm.sampling.structured import StructuredOutputsParams

    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputsParams(**value)
        except TypeError as e:
            raise SamplingParamsError(f"structured_outputs has an unknown field: {e}") from None
    raise SamplingParamsError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {value!r}")


def _repetition(value) -> Optional["RepetitionDetectionParams"]:
    """The request's RepetitionDetectionParams (checked when made; a dict is taken as its fields); None when it asks
    for nothing (max_pattern_size 0), so the scheduler keeps no detector for it."""
    from voltllm.sampling.repetition import repetition_params

    params = repetition_params(value)
    return params if params is not None and params.active else None


def _normalise_logit_bias(bias: Optional[dict]) -> Optional[dict[int, float]]:
    """{token id: bias} with int keys and values clamped to +-LOGIT_BIAS_LIMIT; None when empty."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamsError(f"logit_bias must be an object mapping token ids to numbers, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        is_id = _is_token_id(key) or (isinstance(key, str) and key.strip().isdigit())
        if not is_id:
            raise SamplingParamsError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        tok = int(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SamplingParamsError(f"logit_bias values must be finite numbers, got {value!r} for token {tok}")
        out[tok] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
    return out
