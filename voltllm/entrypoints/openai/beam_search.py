"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: `n` is the beam width, `length_penalty`,
`temperature`, `ignore_eos`, `include_stop_str_in_output` its settings (engine/beam_search.py). The fields a beam
search cannot honour are refused by name (vLLM drops them silently); the answer's choices are the n best beams, best
first, and a stream carries them only at the end (the beams are ranked when the search ends)."""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Optional

from voltllm.engine.beam_search import BeamSearchParams, BeamSearchParamsError
from voltllm.entrypoints.openai.errors import bad_request

# field -> (its value asks for nothing, why beam search refuses it)
_NOT_WITH_BEAM_SEARCH = {
    "stop": (lambda v: not v, "the beams end only on EOS or max_tokens (stop strings are not applied)"),
    "stop_token_ids": (lambda v: not v, "the beams end only on EOS or max_tokens (stop_token_ids are not applied)"),
    "min_tokens": (lambda v: not v, "min_tokens is not applied to the beams"),
    "presence_penalty": (lambda v: not v, "penalties are not applied to the beams' logprobs"),
    "frequency_penalty": (lambda v: not v, "penalties are not applied to the beams' logprobs"),
    "repetition_penalty": (lambda v: v is None or v == 1.0, "penalties are not applied to the beams' logprobs"),
    "logit_bias": (lambda v: not v, "logit_bias is not applied to the beams' logprobs"),
    "allowed_token_ids": (lambda v: v is None, "the beams are ranked over the whole vocabulary (no allowed_token_ids)"),
    "bad_words": (lambda v: not v, "bad words are not banned from the beams"),
    "top_p": (lambda v: v is None or v == 1.0, "the beams are ranked over the whole vocabulary (no top_p)"),
    "top_k": (lambda v: v is None or v in (0, -1), "the beams are ranked over the whole vocabulary (no top_k)"),
    "min_p": (lambda v: v is None or v == 0.0, "the beams are ranked over the whole vocabulary (no min_p)"),
    "seed": (lambda v: v is None, "a seed is not applied to the steps' samples (use temperature 0 for a "
                                  "deterministic search)"),
    "prompt_logprobs": (lambda v: v is None, "beam search computes no prompt logprobs"),
    "thinking_token_budget": (lambda v: v is None or v == -1, "the thinking budget's forced end is not applied to "
                                                               "the beams"),
    "repetition_detection": (lambda v: not v or not v.get("max_pattern_size"), "the beams end only on EOS or "
                                                                              "max_tokens (no repetition check)"),
    "max_repetition_pattern_size": (lambda v: not v, "the beams end only on EOS or max_tokens (no repetition check)"),
}
_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                      "structured_outputs")


def _constraint_field(req: Any) -> str:
    """The field that set the request's output constraint (else a forcing tool_choice did)."""
    for name in _CONSTRAINT_FIELDS:
        value = getattr(req, name, None)
        if value is not None and not (name == "response_format" and isinstance(value, dict)
                                      and value.get("type") == "text"):
            return name
    return "tool_choice"


def check_beam_search(req: Any) -> None:
    """400s for the beam-search fields: early_stopping (vLLM's older field; the search always runs every beam to
    EOS or max_tokens), length_penalty without beam search, and with it every field it cannot honour."""
    if req.early_stopping not in (None, False):
        raise bad_request("early_stopping: the beam search runs every beam to EOS or max_tokens (as vLLM's); "
                          "early stopping is not built", "early_stopping", "unsupported_parameter")
    if not req.use_beam_search:
        if req.length_penalty is not None and req.length_penalty != 1.0:
            raise bad_request("length_penalty applies to beam search only: set use_beam_search to true",
                              "length_penalty")
        return
    for name, (nothing, why) in _NOT_WITH_BEAM_SEARCH.items():
        if not nothing(getattr(req, name, None)):
            raise bad_request(f"{name} cannot be combined with use_beam_search: {why}", name)
    if req.constraint() is not None:
        named = _constraint_field(req)
        raise bad_request(f"{named}: structured outputs cannot be combined with use_beam_search (the grammar would "
                          "have to follow each beam)", named)
    asked = getattr(req, "logprobs", None)
    completion_logprobs = isinstance(asked, int) and not isinstance(asked, bool)  # (chat's logprobs is a flag)
    if getattr(req, "echo", False) and completion_logprobs:
        raise bad_request("echo with logprobs cannot be combined with use_beam_search: beam search computes no "
                          "prompt logprobs", "echo")
    if req.length_penalty is not None and not math.isfinite(req.length_penalty):
        raise bad_request(f"length_penalty must be a finite number, got {req.length_penalty}", "length_penalty")


def beam_search_params(req: Any, max_tokens: int, defaults: dict, max_logprobs: int) -> BeamSearchParams:
    """The request's BeamSearchParams (vLLM's to_beam_search_params): beam width n, temperature the request's, else
    the model's generation default, else 1.0 (vLLM's; above 0 the steps' samples join the candidates). 2 x n logprobs
    per step must fit --max-logprobs, as in vLLM."""
    if max_logprobs != -1 and 2 * req.n > max_logprobs:  # (-1: no limit)
        raise bad_request(f"n {req.n}: beam search asks each step for 2 x n = {2 * req.n} logprobs, more than this "
                          f"server's --max-logprobs ({max_logprobs})", "n")
    temperature = req.temperature if req.temperature is not None else defaults.get("temperature", 1.0)
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                temperature=temperature,
                                length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except BeamSearchParamsError as e:
        name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), {"beam_width": "n"}.get(name, name))


def submit_beam_searches(state: Any, request_ids: list[str], prompts: list[Any], req: Any,
                         max_tokens: Optional[int], num_logprobs: Optional[int], priority: int = 0,
                         model: Optional[str] = None, trace_headers: Optional[Mapping[str, str]] = None) -> list[Any]:
    """Start one beam search per prompt (a dict with prompt_token_ids), with the adapter `model` names if it is a
    --lora-modules one; max_tokens None: up to the context length. On a failure the searches already started are
    aborted and a 400 raised, as serving_common.submit does. trace_headers: its step requests' spans' parent."""
    from voltllm.entrypoints.openai.serving_common import start_streams

    lora = state.lora_request(model)

    def start(rid: str, prompt: Any) -> Any:
        most = max_tokens
        if most is None:  # (chat: the prompt's token ids)
            most = max(state.max_model_len - len(prompt["prompt_token_ids"]), 1)
        params = beam_search_params(req, most, state.generation_defaults, state.max_logprobs)
        return state.engine.beam_search(rid, prompt, params, req.cache_salt, num_logprobs=num_logprobs,
                                        skip_special_tokens=req.skip_special_tokens, priority=priority,
                                        lora_request=lora, trace_headers=trace_headers)

    return start_streams(state, (functools.partial(start, rid, prompt) for rid, prompt in zip(request_ids, prompts)))
