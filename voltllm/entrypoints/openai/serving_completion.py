"""POST /v1/completions: prompt(s) -> engine -> JSON or SSE chunks (echo, logprobs, n, batches of prompts)."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Optional

from fastapi.responses import JSONResponse

from voltllm.engine.frontend import InvalidPromptError
from voltllm.engine.outputs import CompletionOutput, RequestOutput
from voltllm.engine.prompt_embeds import decode_base64_embeds
from voltllm.entrypoints.openai.beam_search import submit_beam_searches
from voltllm.entrypoints.openai.errors import bad_request
from voltllm.entrypoints.openai.protocol import CompletionRequest
from voltllm.entrypoints.openai.request_log import shown
from voltllm.entrypoints.openai.server_middleware import chosen_request_id, engine_request_id
from voltllm.entrypoints.openai.stream_interval import stream_interval
from voltllm.entrypoints.openai.serving_common import (DisconnectWatcher, ServerState, collect_or_gone,
                                                       completion_logprobs, event_stream, make_params, merge_streams,
                                                       new_id, prompt_logprobs_json, request_trace_headers, sse,
                                                       sse_body, submit, truncated, usage)

logger = logging.getLogger("voltllm")


def _prompt_text(state: ServerState, out: RequestOutput) -> str:
    return out.prompt if out.prompt is not None else state.tokenizer.decode(out.prompt_token_ids)


def _logprobs(state: ServerState, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, echo: bool,
              start_token: int = 0, text_offset: int = 0) -> dict:
    ids: list[int] = []
    lps: list[Optional[dict]] = []
    if echo and start_token == 0:
        ids = list(out.prompt_token_ids)
        lps = list(out.prompt_logprobs) if out.prompt_logprobs is not None else [None] * len(ids)
        lps = (lps + [None] * len(ids))[: len(ids)]
    ids += c.token_ids[start_token:]
    lps += list((c.logprobs or [])[start_token:])
    return completion_logprobs(ids, lps, req.logprobs, state.tokenizer, text_offset, state.tokens_as_ids(req))


def _engine_prompt(state: ServerState, req: CompletionRequest, prompt: Any) -> Any:
    """A prompt as the engine takes it: text tokenized with the request's add_special_tokens, then cut to its
    truncate_prompt_tokens from its truncation_side (the text is dropped when cut, so echo shows the tokens that were
    used)."""
    if isinstance(prompt, str):
        if state.tokenizer is None or not prompt:
            return prompt  # (the engine refuses these with its own message)
        ids = state.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
    else:
        ids = prompt
    kept = truncated(ids, req.truncate_prompt_tokens, state.max_model_len, req.truncation_side)
    text = prompt if isinstance(prompt, str) and len(kept) == len(ids) else None
    return {"prompt": text, "prompt_token_ids": kept} if text is not None else {"prompt_token_ids": kept}


def _embeds_prompts(state: ServerState, req: CompletionRequest) -> list[dict]:
    """prompt_embeds as engine prompts: each base64 text decoded (only with --enable-prompt-embeds: torch.load is not
    run on a request's data otherwise), then cut to truncate_prompt_tokens from its truncation_side as token prompts
    are."""
    if req.prompt_embeds is None:
        return []
    if not state.enable_prompt_embeds:
        raise bad_request("prompt_embeds need the server started with --enable-prompt-embeds", "prompt_embeds")
    for field, on in (("echo", req.echo), ("prompt_logprobs", req.prompt_logprobs is not None),
                      ("use_beam_search", bool(req.use_beam_search))):
        if on:  # (a prompt of embeddings has no token ids to show, score or extend)
            raise bad_request(f"{field} is not supported with prompt_embeds", field, "unsupported_parameter")
    values = req.prompt_embeds if isinstance(req.prompt_embeds, list) else [req.prompt_embeds]
    if not values:
        raise bad_request("prompt_embeds must not be an empty list", "prompt_embeds")
    out = []
    for value in values:
        try:
            embeds = decode_base64_embeds(value)
        except InvalidPromptError as e:
            raise bad_request(str(e), "prompt_embeds") from None
        rows = embeds.shape[-2] if embeds.dim() >= 2 else 0  # (the Frontend refuses other shapes)
        keep = truncated(list(range(rows)), req.truncate_prompt_tokens, state.max_model_len, req.truncation_side)
        if 0 < len(keep) < rows:
            embeds = embeds[..., keep[0]:keep[-1] + 1, :]
        out.append({"prompt_embeds": embeds})
    return out


async def create_completion(state: ServerState, req: CompletionRequest, raw_request: Any):
    req.check()
    interval = stream_interval(state.stream_interval, req)
    model = state.model_name(req.model)
    embeds_prompts = _embeds_prompts(state, req)
    prompts = req.prompts()
    req.logprobs = state.check_logprobs(req.logprobs, "logprobs")
    req.prompt_logprobs = state.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    # vLLM's echo with max_tokens 0: the prompt alone (scoring its logprobs); one token is generated and dropped
    echo_only = req.echo and max_tokens == 0
    max_tokens = max_tokens or (1 if echo_only else 0)
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    prompt_logprobs = max(asked) if asked else None  # echo's logprobs and prompt_logprobs share one pass
    n = req.n
    chosen_id = chosen_request_id(raw_request, req.request_id)  # vLLM's: cmpl-<X-Request-Id, else request_id>
    base_id = f"cmpl-{chosen_id}" if chosen_id is not None else new_id("cmpl")
    engine_base = engine_request_id(base_id, chosen_id is not None)
    engine_prompts = embeds_prompts + [_engine_prompt(state, req, p) for p in prompts]
    prompts = [f"<prompt_embeds {list(p['prompt_embeds'].shape)}>" for p in embeds_prompts] + prompts  # (the log's)
    rids = [engine_base if len(prompts) == 1 else f"{engine_base}-{i}" for i in range(len(prompts))]
    trace_headers = request_trace_headers(state, raw_request)
    if req.use_beam_search:  # n beams per prompt, answered when each search ends (beam_search.py)
        streams = submit_beam_searches(state, rids, engine_prompts, req, max_tokens, req.logprobs, req.priority,
                                       model=model, trace_headers=trace_headers)
    else:
        params = make_params(lambda: req.sampling_params(max_tokens, req.logprobs, prompt_logprobs,
                                                         defaults=state.generation_defaults))
        streams = submit(state, rids, engine_prompts, params, req.cache_salt, req.priority, model=model,
                         interval=interval, streamed=bool(req.stream), trace_headers=trace_headers)
    if state.log_requests:
        logger.info("request %s: %d prompt(s), n=%d, max_tokens=%d, stream=%s, beam search=%s, prompt%s: %s",
                    engine_base, len(prompts), n, max_tokens, req.stream, bool(req.use_beam_search),
                    "s" if len(prompts) > 1 else "", ", ".join(shown(p, state.max_log_len) for p in prompts))
    created = int(time.time())
    watcher = DisconnectWatcher(raw_request, state, rids)
    if req.stream:
        return event_stream(sse_body(_stream(state, req, base_id, model, created, n, streams, echo_only),
                                     streams, watcher, base_id))
    finals = await collect_or_gone(streams, watcher)
    if finals is None:
        return JSONResponse({}, status_code=499)
    if echo_only:
        finals = [_without_generation(out) for out in finals]
    choices = []
    prompt_tokens = completion_tokens = cached = 0
    for p, out in enumerate(finals):
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        prefix = _prompt_text(state, out) if req.echo else ""
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choice = {"index": p * n + c.index, "text": prefix + c.text, "logprobs": None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.logprobs is not None:
                choice["logprobs"] = _logprobs(state, req, out, c, req.echo)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs,
                                                                 req.prompt_logprobs)
            if req.return_token_ids:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
    body = {"id": base_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "service_tier": None, "system_fingerprint": None,  # (vLLM's null keys)
            "usage": usage(prompt_tokens, completion_tokens, cached if state.enable_prompt_tokens_details else None)}
    return JSONResponse(body)


class _Sent:
    def __init__(self) -> None:
        self.text = ""  # generated text already sent
        self.tokens = 0  # generated tokens already sent (with their logprobs)
        self.done = False
        self.echoed = False
        self.offset = 0  # text offset of the next logprob token
        self.sent_prompt_ids = False  # (return_token_ids)


def _without_generation(out: RequestOutput) -> RequestOutput:
    """The output as if nothing had been generated (echo with max_tokens 0): the prompt's, finished by length."""
    empty = [replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None, cumulative_logprob=None,
                     finish_reason="length" if c.finish_reason is not None else None, stop_reason=None)
             for c in out.outputs]
    return replace(out, outputs=empty)


async def _stream(state: ServerState, req: CompletionRequest, base_id: str, model: str, created: int, n: int,
                  streams: list, echo_only: bool = False) -> AsyncIterator[str]:
    """The chunks of a streamed completion (sse_body adds [DONE] and the error handling)."""
    opts = req.stream_options
    include_usage = state.enable_force_include_usage or bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    base = {"id": base_id, "object": "text_completion", "created": created, "model": model}
    sent: dict[int, _Sent] = {}
    prompt_tokens: dict[int, int] = {}
    completion_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}

    def chunk(choices: list, usage_now: Optional[dict]) -> str:
        body = {**base, "choices": choices}
        if include_usage:
            body["usage"] = usage_now
        return sse(body)

    async for p, out in merge_streams(streams):
        if echo_only:
            out = _without_generation(out)
        prompt_tokens[p] = len(out.prompt_token_ids)
        completion_tokens[p] = sum(len(c.token_ids) for c in out.outputs)
        cached[p] = out.num_cached_tokens
        for c in out.outputs:
            idx = p * n + c.index
            s = sent.setdefault(idx, _Sent())
            if s.done:
                continue
            done = c.finish_reason is not None
            echo_now = req.echo and not s.echoed
            text = _prompt_text(state, out) if echo_now else ""
            s.echoed = True
            text += c.text[len(s.text):] if len(c.text) > len(s.text) else ""
            lps = None
            if req.logprobs is not None and (len(c.token_ids) > s.tokens or echo_now):
                lps = _logprobs(state, req, out, c, echo_now, s.tokens, s.offset)
                if lps["tokens"]:
                    s.offset = lps["text_offset"][-1] + len(lps["tokens"][-1])
            s.text = c.text
            new_ids = list(c.token_ids[s.tokens:])
            s.tokens = len(c.token_ids)
            first_ids = req.return_token_ids and not s.sent_prompt_ids
            if not text and not done and lps is None and not (req.return_token_ids and (new_ids or first_ids)):
                continue
            choice: dict[str, Any] = {"index": idx, "text": text, "logprobs": lps, "finish_reason": None}
            if done:
                s.done = True
                choice["finish_reason"] = c.finish_reason
                choice["stop_reason"] = c.stop_reason
            if req.return_token_ids:  # as vLLM's: the prompt's ids in a choice's first chunk, then each delta's
                if first_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    s.sent_prompt_ids = True
                choice["token_ids"] = new_ids
            # continuous usage, as vLLM's: this choice's prompt and its tokens so far
            yield chunk([choice], usage(prompt_tokens[p], len(c.token_ids)) if continuous else None)
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(
            sum(prompt_tokens.values()), sum(completion_tokens.values()),
            sum(cached.values()) if state.enable_prompt_tokens_details else None)})
