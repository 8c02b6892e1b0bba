"""The token-id checks a request must pass against the model's vocabulary, shared by the engine core (in-process
LLM) and the API process (AsyncLLM), which each raise their own InvalidRequestError (an HTTP 400)."""
from __future__ import annotations

from typing import Optional, Sequence

from voltllm.sampling.params import SamplingParams


def vocab_problem(prompt_ids: Sequence[int], sp: SamplingParams, vocab_size: int) -> Optional[tuple[str, str]]:
    """(why, which request field) when the request's token ids do not fit a vocabulary of `vocab_size`, else None.
    Stop token ids are checked too: under min_tokens the sampler masks them in the logits, where an id past the
    vocabulary would be an out-of-bounds index on the device."""
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        return f"prompt token ids must be in [0, {vocab_size})", "prompt"
    if sp.stop_token_ids and max(sp.stop_token_ids) >= vocab_size:
        return f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids"
    if sp.logprobs is not None and sp.logprobs > vocab_size:
        return f"logprobs must be <= the vocabulary size ({vocab_size})", "logprobs"
    return None
