"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API served through the chat path.

messages_protocol.py turns the request into a ChatCompletionRequest (system messages inside `messages` placed as
this server's template allows: messages_system_probe.py); from there it is templated and submitted as
a chat completion with n=1 (serving_chat.start_chat) and parsed by serving_chat's ChoiceView (reasoning parser,
"auto" tool parser, forced tool choice). The output is shaped the Anthropic way: content blocks (thinking, text,
tool_use), stop_reason end_turn / max_tokens / stop_sequence / tool_use, and, streamed, named SSE events (message_start,
content_block_start / _delta / _stop, message_delta, message_stop; an error after the start as `event: error`).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi.responses import JSONResponse

from voltllm.engine.async_llm import RequestAbortedError
from voltllm.engine.outputs import CompletionOutput, RequestOutput
from voltllm.entrypoints.openai.chat_images import prepare_chat_images
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.messages_errors import anthropic_sse_error
from voltllm.entrypoints.openai.messages_inline_system import has_inline_system
from voltllm.entrypoints.openai.messages_protocol import CountTokensRequest, MessagesRequest
from voltllm.entrypoints.openai.messages_system_probe import inline_system_mode
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest
from voltllm.entrypoints.openai.serving_chat import ChatPlan, ChoiceView, start_chat
from voltllm.entrypoints.openai.serving_common import (ServerState, collect_or_gone, event_stream, merge_streams,
                                                       render_chat, sse_body)


def served_model(state: ServerState, requested: str) -> str:
    """The model name; a 404 (Anthropic's not_found_error) for one this server does not serve."""
    if state.serves(requested):
        return requested
    raise OpenAIError(f"model: {requested!r} is not served here; this server serves "
                      f"{', '.join(repr(n) for n in [*state.served_model_names, *state.lora_modules])}", 404, "model",
                      "model_not_found")


def _chat(state: ServerState, req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat-completions request this one is served as, with the request's refusals checked first. System
    messages after the first turn stay in place or fold into a neighbour as this server's template allows."""
    req.check()
    served_model(state, req.model)
    mode = inline_system_mode(state) if has_inline_system(req.messages) else "preserve"
    chat = req.chat_request(mode, thinking_budgets=state.thinking_budgets)
    chat.check()
    return chat


async def count_message_tokens(state: ServerState, req: CountTokensRequest) -> dict:
    chat = _chat(state, req)
    image_urls: list[str] = []  # (images count as the tokens /v1/messages would run them with)
    prompt_text = render_chat(state, state.template_messages(chat.messages, None, chat.tools, image_urls),
                              chat_template=None, kwargs=chat.chat_template_kwargs,
                              add_generation_prompt=chat.add_generation_prompt,
                              continue_final_message=chat.continue_final_message, tools=chat.tools)
    ids = state.tokenizer.encode(prompt_text, add_special_tokens=False)
    if image_urls:
        ids, _ = await prepare_chat_images(state, ids, image_urls)
    return {"input_tokens": len(ids)}


# -- output shapes ------------------------------------------------------------------------------------
def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.split("_", 1)[-1]


def tool_input(arguments: Any) -> dict:
    """A call's arguments as the tool_use input object; arguments that are not a JSON object (output cut short
    by max_tokens) give {}."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(reasoning: Optional[str], text: str, calls: list[dict]) -> list[dict]:
    blocks: list[dict] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text:
        blocks.append({"type": "text", "text": text})
    for call in calls:
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"],
                       "input": tool_input(fn["arguments"])})
    return blocks


def stop_reason(c: CompletionOutput, has_calls: bool) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) from the engine's finish reason and the matched stop (a string for a stop
    string; a token id or None for EOS / a stop token)."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str) and c.finish_reason == "stop":  # (not repetition's "repetition_detected")
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def message_usage(state: ServerState, out: RequestOutput) -> dict:
    """Anthropic's usage: with --enable-prompt-tokens-details, prefix-cache hits are cache_read_input_tokens and
    input_tokens are the rest of the prompt (Anthropic's split); otherwise input_tokens is the whole prompt."""
    prompt = len(out.prompt_token_ids)
    generated = sum(len(c.token_ids) for c in out.outputs)
    if not state.enable_prompt_tokens_details:
        return {"input_tokens": prompt, "output_tokens": generated}
    cached = min(out.num_cached_tokens, prompt)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": generated}


def _message(plan: ChatPlan, content: list[dict], stop: Optional[str], seq: Optional[str], use: dict) -> dict:
    return {"id": plan.request_id, "type": "message", "role": "assistant", "model": plan.model, "content": content,
            "stop_reason": stop, "stop_sequence": seq, "usage": use}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class BlockStreamer:
    """Turns the growing (reasoning, text, tool calls) of one output into content-block events, as
    (event name, data) pairs: one block open at a time, in the order thinking, text, tool_use..., each started,
    grown by deltas and stopped. Text that would come back to an earlier kind (it does not, from the parsers) is
    not sent. A call's arguments go as input_json_delta pieces that add up to its arguments."""

    def __init__(self) -> None:
        self.index = -1
        self.open: Optional[str] = None
        self.phase = 0  # 0 thinking, 1 text, 2 tool_use: what may still be opened
        self.reasoning = ""
        self.text = ""
        self.args: list[int] = []  # per call started: how much of its arguments went out

    def _start(self, block: dict, phase: int) -> list[tuple[str, dict]]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        self.phase = phase
        return events + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def update(self, reasoning: Optional[str], text: str, calls: list[dict]) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if reasoning and len(reasoning) > len(self.reasoning) and self.phase == 0:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""}, 0)
            events.append(self._delta({"type": "thinking_delta", "thinking": reasoning[len(self.reasoning):]}))
            self.reasoning = reasoning
        if text and len(text) > len(self.text) and self.phase <= 1:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""}, 1)
            events.append(self._delta({"type": "text_delta", "text": text[len(self.text):]}))
            self.text = text
        for k, call in enumerate(calls):
            args = call["function"]["arguments"]
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            if k == len(self.args):
                events += self._start({"type": "tool_use", "id": tool_use_id(call["id"]),
                                       "name": call["function"]["name"], "input": {}}, 2)
                self.args.append(0)
            if k == len(self.args) - 1 and len(args) > self.args[k]:
                events.append(self._delta({"type": "input_json_delta", "partial_json": args[self.args[k]:]}))
                self.args[k] = len(args)
        return events


# -- serving ------------------------------------------------------------------------------------------
async def create_message(state: ServerState, req: MessagesRequest, raw_request: Any):
    chat = _chat(state, req)
    chat.max_tokens, chat.stream = req.max_tokens, req.stream
    plan, streams, watcher = await start_chat(state, chat, raw_request, request_id=f"msg_{uuid.uuid4().hex}")
    if req.stream:
        return event_stream(sse_body(_events(state, chat, plan, streams), streams, watcher, plan.request_id,
                                          done=None, error_event=anthropic_sse_error))
    finals = await collect_or_gone(streams, watcher)
    if finals is None:
        return JSONResponse({}, status_code=499)
    out = finals[0]
    c = out.outputs[0]
    reasoning, text, calls = ChoiceView(state, plan, chat.tools, streaming=False).view(c.text, True)
    stop, seq = stop_reason(c, bool(calls))
    return JSONResponse(_message(plan, content_blocks(reasoning, text, calls), stop, seq, message_usage(state, out)))


async def _events(state: ServerState, chat: ChatCompletionRequest, plan: ChatPlan,
                  streams: list) -> AsyncIterator[str]:
    """message_start (once the first output is there: its usage has the prompt's cache hits), ping, the blocks,
    message_delta, message_stop."""
    view = ChoiceView(state, plan, chat.tools, streaming=True)
    blocks = BlockStreamer()
    last: Optional[tuple[RequestOutput, CompletionOutput, list]] = None
    async for _, out in merge_streams(streams):
        c = out.outputs[0]
        if last is None:
            start_usage = {**message_usage(state, out), "output_tokens": 0}
            yield event("message_start", {"type": "message_start",
                                          "message": _message(plan, [], None, None, start_usage)})
            yield event("ping", {"type": "ping"})
        reasoning, text, calls = view.view(c.text, c.finish_reason is not None)
        for name, data in blocks.update(reasoning, text, calls):
            yield event(name, data)
        last = (out, c, calls)
    if last is None:
        raise RequestAbortedError("the request ended without output")
    out, c, calls = last
    for name, data in blocks.close():
        yield event(name, data)
    stop, seq = stop_reason(c, bool(calls))
    yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": seq},
                                  "usage": {"output_tokens": len(c.token_ids)}})
    yield event("message_stop", {"type": "message_stop"})
