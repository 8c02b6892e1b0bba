"""What a request must satisfy before it is queued, shared by the engine core (in-process LLM, engine process) and
the API process (AsyncLLM): one error type, an HTTP 400, and the checks against the model's vocabulary."""
from __future__ import annotations

import numbers
from typing import Optional, Sequence

from voltllm.sampling.params import SamplingParams


class InvalidRequestError(ValueError):
    """A request the engine cannot take (empty, too long for the context, bad token ids); an HTTP 400. `param`:
    the request field at fault, when known."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def context_length_message(max_model_len: int, prompt_tokens: int, output_tokens: Optional[int]) -> str:
    """A request too long for the context, in the words of vLLM's (and OpenAI's) error, which clients match to tell
    it from other 400s (LiteLLM's ContextWindowExceededError: "This model's maximum context length is"), then what
    to do. output_tokens: the tokens asked to generate (None: an input to embed or score, which needs no room)."""
    if output_tokens is None:
        return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_tokens} tokens in the input. Please reduce the length of the input")
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + output_tokens} tokens ({prompt_tokens} in the prompt, {output_tokens} in the "
            "completion). Please reduce the length of the prompt or the completion (max_tokens).")


def kept_prompt(ids: list[int], keep: Optional[int], max_model_len: int, side: Optional[str] = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context length; None: all of them), or
    with its truncation_side "right" the first ones ("left", the default, cuts the start); a size over the context
    length is an error naming the field."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens ({keep}) is greater than this model's maximum context "
                                  f"length ({max_model_len}); choose a smaller truncation size",
                                  "truncate_prompt_tokens")
    if side == "right":
        return ids[:keep] if keep else ids  # (0 keeps all, as the left side's ids[-0:] does)
    return ids[-keep:]


def check_priority(priority: object, policy: str) -> None:
    """A request's `priority` (vLLM's: lower is served first) is taken under --scheduling-policy priority; under fcfs
    only 0 (the message starts as vLLM's, which clients match)."""
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):  # (numpy integers too)
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
    if priority != 0 and policy != "priority":
        raise InvalidRequestError(f"Got priority {priority} but Priority scheduling is not enabled: the engine runs "
                                  "--scheduling-policy fcfs; start it with --scheduling-policy priority, or send "
                                  "priority 0", "priority")


def check_vocab(prompt_ids: Sequence[int], sp: Optional[SamplingParams], vocab_size: int) -> None:
    """Raise InvalidRequestError when the request's token ids do not fit a vocabulary of `vocab_size`. Stop token
    ids, logit_bias keys, allowed_token_ids and bad words' ids are checked too: the sampler indexes the logits with
    them on the device (bans, biases, the allowed mask), where an id past the vocabulary would be an out-of-bounds
    index. sp None: a pooling request (its prompt only)."""
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if sp is None:
        return
    if sp.stop_token_ids and max(sp.stop_token_ids) >= vocab_size:
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    if sp.logit_bias and max(sp.logit_bias) >= vocab_size:
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
    if sp.allowed_token_ids and max(sp.allowed_token_ids) >= vocab_size:
        raise InvalidRequestError(f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids")
    if sp.bad_words and not sp._bad_words_token_ids:
        raise InvalidRequestError("bad_words reached the engine without their token ids (the Frontend tokenizes "
                                  "them)", "bad_words")
    if any(t >= vocab_size for seq in sp._bad_words_token_ids for t in seq):
        raise InvalidRequestError(f"bad_words tokenize to ids outside the model's vocabulary [0, {vocab_size})",
                                  "bad_words")
    if sp.logprobs is not None and sp.logprobs > vocab_size:
        raise InvalidRequestError(f"logprobs must be <= the vocabulary size ({vocab_size})", "logprobs")
    if sp.prompt_logprobs is not None and sp.prompt_logprobs > vocab_size:
        raise InvalidRequestError(f"prompt_logprobs must be <= the vocabulary size ({vocab_size})", "prompt_logprobs")


def runner_mismatch(runner: str) -> str:
    """Why a request of the other kind cannot run on an engine of `runner` (vLLM runs one runner per engine)."""
    if runner == "pooling":
        return ("this engine runs a pooling (embedding) model (--runner pooling): it generates nothing; ask it for "
                "embeddings")
    return ("this engine runs a generative model: it computes no embeddings; start one with --runner pooling for "
            "them")
