"""POST /v1/chat/completions: messages -> chat template -> engine -> JSON or SSE chunks."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi.responses import JSONResponse

from voltllm.engine.outputs import CompletionOutput, RequestOutput
from voltllm.entrypoints.openai.beam_search import submit_beam_searches
from voltllm.entrypoints.openai.chat_images import prepare_chat_images
from voltllm.entrypoints.openai.errors import bad_request
from voltllm.entrypoints.openai.forced_calls import forced_calls
from voltllm.entrypoints.openai.parsers import (REASONING_PARSERS, TOOL_PARSERS, ReasoningParser, ToolParser,
                                                new_tool_call_id)
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest
from voltllm.entrypoints.openai.request_log import shown
from voltllm.entrypoints.openai.server_middleware import chosen_request_id, engine_request_id
from voltllm.entrypoints.openai.serving_common import (DisconnectWatcher, ServerState, chat_logprobs, collect_or_gone,
                                                       event_stream, make_params, merge_streams, message_text,
                                                       new_id, prompt_logprobs_json, render_chat,
                                                       request_trace_headers, sse, sse_body, submit, truncated, usage)
from voltllm.entrypoints.openai.stream_interval import stream_interval
from voltllm.entrypoints.openai.tool_choice import ForcedToolChoice, forced_tool_choice

logger = logging.getLogger("voltllm")


@dataclass
class ChatPlan:
    request_id: str
    model: str
    created: int
    prompt_text: str
    use_tools: bool  # parse tool calls out of free output (tool_choice "auto")
    forced: Optional[ForcedToolChoice]  # the output is constrained to tool calls (tool_choice "required" / named)
    n: int
    num_logprobs: Optional[int]
    echo_prefix: str = ""
    tokens_as_ids: bool = False  # logprob tokens as "token_id:N" (--return-tokens-as-token-ids)
    prompt_ids: list[int] = field(default_factory=list)  # (after truncate_prompt_tokens)
    include_reasoning: bool = True  # false: the reasoning is split off and dropped (vLLM's include_reasoning)


def tool_mode(state: ServerState, req: ChatCompletionRequest) -> tuple[bool, Optional[ForcedToolChoice]]:
    """(parse tool calls out of free output, the forced tool choice); refuses what cannot be honoured. A forced
    choice needs no parser: its grammar (req.constraint()) fixes the form of the output."""
    forced = forced_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls)
    if forced is not None or not req.tools or req.tool_choice == "none":
        return False, forced
    if not (state.enable_auto_tool_choice and state.tool_call_parser):
        raise bad_request('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                          "--tool-call-parser", "tool_choice")
    return True, None


class ChoiceView:
    """Turns one choice's cumulative text into (reasoning, content, tool calls) through the parsers."""

    def __init__(self, state: ServerState, plan: ChatPlan, tools: Optional[list], streaming: bool):
        self.streaming = streaming
        self.forced = plan.forced
        self.include_reasoning = plan.include_reasoning
        # a forced choice's grammar starts after the reasoning (its calls follow it), unless grammars constrain the
        # reasoning too (--structured-outputs-config enable_in_reasoning): then the JSON comes at once, no reasoning
        self.reasoning: Optional[ReasoningParser] = (
            REASONING_PARSERS[state.reasoning_parser](plan.prompt_text, *(state.reasoning_delimiters or ()))
            if state.reasoning_parser and (plan.forced is None or state.grammar_after_reasoning) else None)
        self.tools: Optional[ToolParser] = (
            TOOL_PARSERS[state.tool_call_parser](tools) if plan.use_tools else None)
        self.call_ids: list[str] = []

    def view(self, text: str, finished: bool) -> tuple[Optional[str], str, list[dict]]:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text, finished, self.streaming)
            if not self.include_reasoning:
                reasoning = None
        calls: list[dict] = []
        if self.forced is not None:
            calls = forced_calls(self.forced, text, finished)
            if calls or not finished:
                text = ""  # (output with no call in it at all, e.g. cut short at once, stays content)
        elif self.tools is not None:
            text, calls = self.tools.extract(text, finished)
        while len(self.call_ids) < len(calls):
            self.call_ids.append(new_tool_call_id())
        return reasoning, text, [
            {"id": self.call_ids[i], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for i, c in enumerate(calls)]


def _finish_reason(c: CompletionOutput, has_calls: bool) -> Optional[str]:
    if c.finish_reason == "stop" and has_calls:
        return "tool_calls"
    return c.finish_reason


async def start_chat(state: ServerState, req: ChatCompletionRequest, raw_request: Any,
                     request_id: Optional[str] = None) -> tuple[ChatPlan, list, DisconnectWatcher]:
    """Check, template and submit a chat request (shared with /v1/responses and /v1/messages): its plan, output
    streams and disconnect watcher (which the caller stops, through collect_or_gone or sse_body). Images are read
    and processed only for a request that has some."""
    req.check()
    interval = stream_interval(state.stream_interval, req)
    model = state.model_name(req.model)
    # --exclude-tools-when-tool-choice-none (vLLM's): the model is not shown tools it may not call
    template_tools = None if state.exclude_tools_when_tool_choice_none and req.tool_choice == "none" else req.tools
    image_urls: list[str] = []
    video_urls: list[str] = []
    messages = state.template_messages(req.messages, req.chat_template, template_tools, image_urls, video_urls)
    if (image_urls or video_urls) and req.use_beam_search:
        raise bad_request("use_beam_search does not take images or videos (beam search runs on text prompts)",
                          "use_beam_search")
    use_tools, forced = tool_mode(state, req)
    req.top_logprobs = state.check_logprobs(req.top_logprobs, "top_logprobs")
    req.prompt_logprobs = state.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    prompt_text = render_chat(state, messages, chat_template=req.chat_template, kwargs=req.template_kwargs(),
                              add_generation_prompt=req.add_generation_prompt,
                              continue_final_message=req.continue_final_message, tools=template_tools)
    ids = state.tokenizer.encode(prompt_text, add_special_tokens=req.add_special_tokens)
    multi_modal = None
    if image_urls or video_urls:  # (each image's / video's placeholder becomes its tokens; usage counts them)
        ids, multi_modal = await prepare_chat_images(state, ids, image_urls, video_urls)
    whole = len(ids)
    ids = truncated(ids, req.truncate_prompt_tokens, state.max_model_len, req.truncation_side)
    if multi_modal is not None and len(ids) != whole:
        raise bad_request(f"truncate_prompt_tokens would cut a prompt with images ({whole} tokens with the images' "
                          "tokens); leave it out or raise it", "truncate_prompt_tokens")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if not req.use_beam_search:
        params = make_params(lambda: req.sampling_params(max_tokens, req.num_logprobs, req.prompt_logprobs,
                                                         defaults=state.generation_defaults))
    # vLLM's ids: chatcmpl-<X-Request-Id header, else the body's request_id> (Responses / Messages bring theirs)
    chosen_id = None if request_id is not None else chosen_request_id(raw_request, req.request_id)
    response_id = request_id or (f"chatcmpl-{chosen_id}" if chosen_id is not None else new_id("chatcmpl"))
    engine_id = engine_request_id(response_id, chosen_id is not None)
    plan = ChatPlan(response_id, model, int(time.time()), prompt_text, use_tools, forced,
                    req.n, req.num_logprobs, tokens_as_ids=state.tokens_as_ids(req), prompt_ids=ids,
                    include_reasoning=req.include_reasoning)
    last = messages[-1]
    if req.echo and last.get("role") == state.response_role:
        plan.echo_prefix = message_text(last)
    prompt = {"prompt": prompt_text, "prompt_token_ids": ids}
    trace_headers = request_trace_headers(state, raw_request)
    if req.use_beam_search:  # n beams, answered when the search ends (beam_search.py)
        streams = submit_beam_searches(state, [engine_id], [prompt], req, max_tokens, req.num_logprobs,
                                        req.priority, model=model, trace_headers=trace_headers)
    else:
        streams = submit(state, [engine_id], [prompt], params, req.cache_salt, req.priority, model=model,
                         interval=interval, multi_modal=multi_modal, streamed=bool(req.stream),
                         trace_headers=trace_headers)
    if state.log_requests:
        logger.info("request %s: %d prompt tokens, n=%d, max_tokens=%s, stream=%s, beam search=%s, prompt: %s",
                    engine_id, len(ids), req.n, max_tokens, req.stream, bool(req.use_beam_search),
                    shown(prompt_text, state.max_log_len))
    return plan, streams, DisconnectWatcher(raw_request, state, [engine_id])


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw_request: Any):
    plan, streams, watcher = await start_chat(state, req, raw_request)
    if req.stream:
        return event_stream(sse_body(_stream(state, req, plan, streams), streams, watcher, plan.request_id))
    finals = await collect_or_gone(streams, watcher)
    if finals is None:
        return JSONResponse({}, status_code=499)
    return JSONResponse(_full_response(state, req, plan, finals[0]))


def _full_response(state: ServerState, req: ChatCompletionRequest, plan: ChatPlan, out: RequestOutput) -> dict:
    choices = []
    for c in out.outputs:
        view = ChoiceView(state, plan, req.tools, streaming=False)
        reasoning, content, calls = view.view(c.text, True)
        content = plan.echo_prefix + content
        message: dict[str, Any] = {"role": state.response_role, "content": content if (content or not calls) else None}
        if state.reasoning_parser:  # vLLM's newer name and its older one, which many clients still read
            message["reasoning"] = message["reasoning_content"] = reasoning or None
        message["tool_calls"] = calls
        choice = {"index": c.index, "message": message, "logprobs": None,
                  "finish_reason": _finish_reason(c, bool(calls)), "stop_reason": c.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        if plan.num_logprobs is not None and c.logprobs is not None:
            choice["logprobs"] = {"content": chat_logprobs(c.token_ids, c.logprobs, plan.num_logprobs,
                                                           state.tokenizer, plan.tokens_as_ids)}
        choices.append(choice)
    cached = out.num_cached_tokens if state.enable_prompt_tokens_details else None
    # (service_tier, system_fingerprint: vLLM's null keys; no fingerprint is made here)
    body = {"id": plan.request_id, "object": "chat.completion", "created": plan.created, "model": plan.model,
            "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), cached)}
    if req.return_prompt_text:
        body["prompt_text"] = plan.prompt_text
    if req.return_token_ids:
        body["prompt_token_ids"] = list(out.prompt_token_ids)
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs,
                                                       req.prompt_logprobs)
    return body


class _Sent:
    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self.args: list[int] = []  # per tool call sent: how much of its arguments
        self.tokens = 0
        self.done = False


def _delta(new: Optional[str], sent: str) -> str:
    if not new or len(new) <= len(sent):
        return ""
    return new[len(sent):]


def _call_deltas(calls: list[dict], sent: list[int]) -> list[dict]:
    """A new call goes whole (id, name, arguments so far); a call sent before, only its new arguments (a forced
    choice's, hermes' and qwen3_coder's arguments grow as they are generated; the llama parsers give complete calls)."""
    deltas = []
    for k, call in enumerate(calls):
        args = call["function"]["arguments"]
        if k == len(sent):
            deltas.append({"index": k, **call})
            sent.append(len(args))
        elif len(args) > sent[k]:
            deltas.append({"index": k, "function": {"arguments": args[sent[k]:]}})
            sent[k] = len(args)
    return deltas


async def _stream(state: ServerState, req: ChatCompletionRequest, plan: ChatPlan,
                  streams: list) -> AsyncIterator[str]:
    """The chunks of a streamed chat completion (sse_body adds [DONE] and the error handling)."""
    opts = req.stream_options
    include_usage = state.enable_force_include_usage or bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    base = {"id": plan.request_id, "object": "chat.completion.chunk", "created": plan.created, "model": plan.model}
    views = [ChoiceView(state, plan, req.tools, streaming=True) for _ in range(plan.n)]
    sent = [_Sent() for _ in range(plan.n)]
    prompt_tokens, completion_tokens, cached = len(plan.prompt_ids), 0, 0

    def chunk(choices: list, usage_now: Optional[dict] = None, extra: Optional[dict] = None) -> str:
        body = {**base, "choices": choices, **(extra or {})}
        if include_usage:
            body["usage"] = usage_now
        return sse(body)

    # as vLLM's: the first chunk of each choice carries the prompt's token ids (return_token_ids); continuous usage
    # counts, per chunk, the prompt and that choice's tokens so far
    first_extra = {"prompt_token_ids": list(plan.prompt_ids)} if req.return_token_ids else {}
    if req.return_prompt_text:
        first_extra["prompt_text"] = plan.prompt_text
    for i in range(plan.n):
        first = {"role": state.response_role, "content": plan.echo_prefix}
        if state.reasoning_parser:
            first["reasoning"] = first["reasoning_content"] = None
        yield chunk([{"index": i, "delta": first, "logprobs": None, "finish_reason": None}],
                    usage(prompt_tokens, 0) if continuous else None, first_extra)
    async for _, out in merge_streams(streams):
        prompt_tokens = len(out.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        cached = out.num_cached_tokens
        for c in out.outputs:
            s = sent[c.index]
            if s.done:
                continue
            done = c.finish_reason is not None
            reasoning, content, calls = views[c.index].view(c.text, done)
            delta: dict[str, Any] = {}
            if d := _delta(reasoning, s.reasoning):
                delta["reasoning"] = delta["reasoning_content"] = d
                s.reasoning = reasoning or ""
            if d := _delta(content, s.content):
                delta["content"] = d
                s.content = content
            if tool_deltas := _call_deltas(calls, s.args):
                delta["tool_calls"] = tool_deltas
            lps = None
            if plan.num_logprobs is not None and c.logprobs is not None and len(c.token_ids) > s.tokens:
                lps = {"content": chat_logprobs(c.token_ids[s.tokens:], c.logprobs[s.tokens:], plan.num_logprobs,
                                                state.tokenizer, plan.tokens_as_ids)}
            new_ids = list(c.token_ids[s.tokens:])
            s.tokens = len(c.token_ids)
            if not delta and not done and lps is None and not (req.return_token_ids and new_ids):
                continue
            choice: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": lps, "finish_reason": None}
            if done:
                s.done = True
                choice["finish_reason"] = _finish_reason(c, bool(s.args))
                choice["stop_reason"] = c.stop_reason
            if req.return_token_ids:
                choice["token_ids"] = new_ids
            yield chunk([choice], usage(prompt_tokens, len(c.token_ids)) if continuous else None)
    if include_usage:  # (the final usage with the prompt's cached tokens, as the non-streamed answer and vLLM's)
        yield chunk([], usage(prompt_tokens, completion_tokens, cached if state.enable_prompt_tokens_details else None))
