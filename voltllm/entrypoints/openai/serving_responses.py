"""POST /v1/responses and GET /v1/responses/{id}: the OpenAI Responses API on top of the chat path (background
responses, their cancel and DELETE: responses_background.py).

The request becomes a chat completion request (responses_protocol.py), which serving_chat.start_chat checks,
templates and submits; the chat parsers (ChoiceView: reasoning, tool calls, forced tool choices) split the output,
which is shaped here as Response output items: a `reasoning` item, a `message` item with one `output_text` part,
`function_call` items. Streamed, the same items are sent as the Responses API's typed SSE events (no [DONE]).
Stored responses (store, the default) keep their conversation for `previous_response_id` (responses_store.py).
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi.responses import JSONResponse

from voltllm.engine.outputs import RequestOutput
from voltllm.entrypoints.openai.errors import OpenAIError, bad_request
from voltllm.entrypoints.openai.responses_background import BackgroundRuns
from voltllm.entrypoints.openai.responses_protocol import ResponsesRequest, call_ids, input_messages
from voltllm.entrypoints.openai.responses_store import ResponseStore
from voltllm.entrypoints.openai.serving_chat import ChatPlan, ChoiceView, start_chat
from voltllm.entrypoints.openai.serving_common import (ServerState, chat_logprobs, collect_or_gone, event_stream,
                                                       merge_streams, sse_body)

# chat-request parameters named as the Responses API names them, for the 400s start_chat raises
_PARAMS = {"response_format": "text", "max_tokens": "max_output_tokens", "messages": "input"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- output items -------------------------------------------------------------------------------------
def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: Optional[str], status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(reasoning: Optional[str], content: str, calls: list[dict], status: str = "completed") -> list[dict]:
    """A finished output, split by the chat parsers (ChoiceView.view), as Response output items: reasoning first,
    then the message (left out when the output is only tool calls), then one function_call item per call."""
    items = []
    if reasoning:
        items.append(reasoning_item(_id("rs"), reasoning, status))
    if content or not calls:
        items.append(message_item(_id("msg"), content, status))
    for c in calls:
        items.append(call_item(_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], status))
    return items


def assistant_turn(items: list[dict]) -> dict:
    """Output items back as one chat assistant message (for the conversation a stored response keeps)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _reasoning_text(items: list[dict]) -> str:
    return "".join(p["text"] for it in items if it["type"] == "reasoning" for p in it["content"])


# -- the response object ------------------------------------------------------------------------------
class _Run:
    """One Responses request as it runs: what it echoes, and its conversation so far (for the store)."""

    def __init__(self, state: ServerState, store: ResponseStore, req: ResponsesRequest, plan: ChatPlan,
                 conversation: list[dict]):
        self.state, self.store, self.req, self.plan = state, store, req, plan
        self.conversation = conversation
        defaults = state.generation_defaults
        r = req
        self.base = {
            "id": plan.request_id, "object": "response", "created_at": plan.created, "model": plan.model,
            "status": "in_progress", "background": False, "error": None, "incomplete_details": None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {}, "output": [], "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id, "reasoning": r.reasoning,
            "store": r.store is not False,
            "temperature": r.temperature if r.temperature is not None else defaults.get("temperature", 1.0),
            "text": r.text or {"format": {"type": "text"}}, "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [], "top_p": r.top_p if r.top_p is not None else defaults.get("top_p", 1.0),
            "truncation": r.truncation or "disabled", "usage": None, "user": r.user,
            "top_logprobs": r.top_logprobs, "max_tool_calls": r.max_tool_calls, "service_tier": r.service_tier,
        }

    def finish(self, items: list[dict], out: RequestOutput) -> dict:
        """The finished response (stored unless store is false)."""
        c = out.outputs[0]
        if self.req.wants_logprobs and c.logprobs is not None:  # (include message.output_text.logprobs)
            lps = chat_logprobs(c.token_ids, c.logprobs, self.req.top_logprobs or 0, self.state.tokenizer,
                                self.plan.tokens_as_ids)
            for it in items:
                if it["type"] == "message" and it["content"]:
                    it["content"][0]["logprobs"] = lps
        resp = dict(self.base, output=items, completed_at=int(time.time()))
        if c.finish_reason == "length":
            resp["status"] = "incomplete"
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            resp["status"] = "completed"
        reasoning = _reasoning_text(items)
        output_tokens = len(c.token_ids)
        reasoning_tokens = (min(output_tokens, len(self.state.tokenizer.encode(reasoning, add_special_tokens=False)))
                            if reasoning else 0)
        input_tokens = len(out.prompt_token_ids)
        resp["usage"] = {"input_tokens": input_tokens,
                         "input_tokens_details": {"cached_tokens": out.num_cached_tokens or 0},
                         "output_tokens": output_tokens,
                         "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                         "total_tokens": input_tokens + output_tokens}
        if self.req.store is not False:
            self.store.put(resp["id"], resp, self.conversation + [assistant_turn(items)])
        return resp


async def create_response(state: ServerState, store: ResponseStore, req: ResponsesRequest, raw_request: Any,
                          background: Optional[BackgroundRuns] = None):
    req.check()
    history: list[dict] = []
    if req.previous_response_id is not None:
        found = store.conversation(req.previous_response_id)
        if found is None:
            raise OpenAIError(f"Previous response with id '{req.previous_response_id}' not found.", 400,
                              "previous_response_id", "previous_response_not_found")
        history = found
    conversation = history + input_messages(req.input, call_ids(history))
    if not conversation:
        raise bad_request("input must not be empty", "input")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    try:
        chat = req.to_chat(messages)
        plan, streams, watcher = await start_chat(state, chat, raw_request,
                                                  request_id=req.request_id or _id("resp"))
    except OpenAIError as e:
        if e.param in _PARAMS:
            e.message = e.message.replace(e.param, _PARAMS[e.param])
            e.param = _PARAMS[e.param]
        e.message = e.message.replace("response_format", "text.format")  # named in others' messages too
        raise
    run = _Run(state, store, req, plan, conversation)
    view = ChoiceView(state, plan, chat.tools, streaming=req.stream)
    if req.background and background is not None:
        watcher.stop()  # it outlives this HTTP request
        run.base["background"] = True
        return JSONResponse(background.start(run.base, streams, lambda out: _final(run, view, out)))
    if req.stream:
        events = _Events()
        return event_stream(sse_body(_stream(run, view, streams, events), streams, watcher, plan.request_id,
                                          done=None, error_event=events.error))
    finals = await collect_or_gone(streams, watcher)
    if finals is None:
        return JSONResponse({}, status_code=499)
    return JSONResponse(_final(run, view, finals[0]))


def _final(run: _Run, view: ChoiceView, out: RequestOutput) -> dict:
    """The finished response of a request not streamed (stored unless store is false)."""
    c = out.outputs[0]
    reasoning, content, calls = view.view(c.text, True)
    status = "incomplete" if c.finish_reason == "length" else "completed"
    return run.finish(output_items(reasoning, content, calls, status), out)


def get_response(store: ResponseStore, response_id: str) -> dict:
    resp = store.response(response_id)
    if resp is None:
        raise OpenAIError(f"Response with id '{response_id}' not found.", 404, "response_id", "not_found",
                          "invalid_request_error")
    return resp


# -- streaming ----------------------------------------------------------------------------------------
class _Events:
    """Typed SSE events with an increasing sequence_number (shared with the in-band error event)."""

    def __init__(self) -> None:
        self._seq = itertools.count()

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": next(self._seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def error(self, err: OpenAIError) -> str:
        return self("error", code=err.code, message=err.message, param=err.param)


async def _stream(run: _Run, view: ChoiceView, streams: list, ev: _Events) -> AsyncIterator[str]:
    """response.created / in_progress, each output item as it grows (added, deltas, done), then
    response.completed (or response.incomplete when cut by max_output_tokens)."""
    yield ev("response.created", response=dict(run.base))
    yield ev("response.in_progress", response=dict(run.base))
    items: list[dict] = []  # as they stand
    open_: list[int] = []  # output indexes not yet done
    reasoning_at: Optional[int] = None
    message_at: Optional[int] = None
    calls_at: list[int] = []

    def add(item: dict) -> str:
        items.append(item)
        open_.append(len(items) - 1)
        return ev("response.output_item.added", output_index=len(items) - 1, item=json.loads(json.dumps(item)))

    def close(i: int, status: str) -> list[str]:
        open_.remove(i)
        item = items[i]
        item["status"] = status
        if item["type"] == "reasoning":
            part = item["content"][0]
            out = [ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                      text=part["text"]),
                   ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)]
        elif item["type"] == "message":
            part = item["content"][0]
            out = [ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                      text=part["text"], logprobs=[]),
                   ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)]
        else:
            out = [ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                      arguments=item["arguments"])]
        return out + [ev("response.output_item.done", output_index=i, item=item)]

    def open_message() -> list[str]:
        nonlocal message_at
        item = message_item(_id("msg"), "", "in_progress")
        part = item["content"][0]
        item["content"] = []
        out = [add(item)]
        message_at = len(items) - 1
        item["content"].append(part)
        out.append(ev("response.content_part.added", item_id=item["id"], output_index=message_at, content_index=0,
                      part=dict(part)))
        return out

    final: Optional[RequestOutput] = None
    async for _, out in merge_streams(streams):
        final = out
        c = out.outputs[0]
        reasoning, content, calls = view.view(c.text, c.finish_reason is not None)
        if reasoning and (reasoning_at is None or len(reasoning) > len(items[reasoning_at]["content"][0]["text"])):
            if reasoning_at is None:
                item = reasoning_item(_id("rs"), "", "in_progress")
                part = item["content"][0]
                item["content"] = []
                yield add(item)
                reasoning_at = len(items) - 1
                item["content"].append(part)
                yield ev("response.content_part.added", item_id=item["id"], output_index=reasoning_at,
                         content_index=0, part=dict(part))
            part = items[reasoning_at]["content"][0]
            delta, part["text"] = reasoning[len(part["text"]):], reasoning
            yield ev("response.reasoning_text.delta", item_id=items[reasoning_at]["id"], output_index=reasoning_at,
                     content_index=0, delta=delta)
        if (content or calls) and reasoning_at in open_:
            for e in close(reasoning_at, "completed"):
                yield e
        if content and (message_at is None or len(content) > len(items[message_at]["content"][0]["text"])):
            if message_at is None:
                for e in open_message():
                    yield e
            part = items[message_at]["content"][0]
            delta, part["text"] = content[len(part["text"]):], content
            yield ev("response.output_text.delta", item_id=items[message_at]["id"], output_index=message_at,
                     content_index=0, delta=delta, logprobs=[])
        for k, call in enumerate(calls):
            args = call["function"]["arguments"]
            if k == len(calls_at):
                yield add(call_item(_id("fc"), call["id"], call["function"]["name"], "", "in_progress"))
                calls_at.append(len(items) - 1)
            item = items[calls_at[k]]
            if len(args) > len(item["arguments"]):
                delta, item["arguments"] = args[len(item["arguments"]):], args
                yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=calls_at[k],
                         delta=delta)
    if final is None:
        raise OpenAIError("the request ended without output", 503, code="request_aborted")
    if message_at is None and not calls_at:  # an empty answer is still a message, as when not streamed
        for e in open_message():
            yield e
    status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
    for i in list(open_):
        for e in close(i, status):
            yield e
    resp = run.finish(items, final)
    yield ev("response.incomplete" if status == "incomplete" else "response.completed", response=resp)
