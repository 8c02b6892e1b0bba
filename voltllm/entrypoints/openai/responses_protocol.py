"""POST /v1/responses: the request model, and its translation into a chat completion request.

A Responses request becomes chat messages (`instructions` first as a system message, then the conversation of
`previous_response_id`, then `input`), the chat tools shape (the Responses API's flat function tools), the chat
tool_choice and a response_format (`text.format`), so the chat path templates, samples and parses it. What this
server does not build is refused with a 400 naming its parameter; unknown fields are ignored.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    text: Optional[dict[str, Any]] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = True
    stream: StrictBool = False
    metadata: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None  # accepted and echoed; the model reasons (or not) as it does
    user: Optional[str] = None
    background: Optional[bool] = None  # runs on after the answer (responses_background.py); not with stream
    # not built: refused when set (check())
    conversation: Optional[Any] = None
    include: Optional[list[str]] = None
    truncation: Optional[str] = None
    prompt: Optional[Any] = None
    max_tool_calls: Optional[int] = None
    top_logprobs: Optional[int] = None
    n: Optional[int] = None
    # vLLM's sampling extras, as the chat request takes them
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Optional[str] = None

    def check(self) -> None:
        """400s for what this server does not build."""
        if self.background and self.store is False:
            raise bad_request("background responses must be stored: drop store: false", "store")
        if self.background and self.stream:
            raise bad_request("a background response cannot be streamed here; poll GET /v1/responses/{id}",
                              "stream", "unsupported_parameter")
        if self.conversation is not None:
            raise bad_request("conversation is not supported; continue a conversation with previous_response_id",
                              "conversation", "unsupported_parameter")
        if self.include:
            raise bad_request(f"include is not supported (got {', '.join(map(str, self.include))})", "include",
                              "unsupported_parameter")
        if self.truncation not in (None, "disabled"):
            raise bad_request(f"truncation {self.truncation!r} is not supported; only 'disabled'", "truncation",
                              "unsupported_parameter")
        if self.prompt is not None:
            raise bad_request("prompt templates are not supported", "prompt", "unsupported_parameter")
        if self.max_tool_calls is not None:
            raise bad_request("max_tool_calls is not supported", "max_tool_calls", "unsupported_parameter")
        if self.top_logprobs:
            raise bad_request("top_logprobs is not supported", "top_logprobs", "unsupported_parameter")
        if self.n not in (None, 1):
            raise bad_request("n is not a Responses API parameter; one response has one output", "n",
                              "unsupported_parameter")

    def chat_tools(self) -> Optional[list[dict]]:
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise bad_request(f"tools[{i}] has type {kind!r}: only function tools are supported (no built-in "
                                  "tools such as web_search, file_search, computer_use, code_interpreter, "
                                  "image_generation or mcp)", "tools", "unsupported_tool")
            if isinstance(tool.get("function"), dict):  # the chat shape, taken as well
                out.append({"type": "function", "function": tool["function"]})
                continue
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise bad_request(f"tools[{i}].name must be a non-empty string", "tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> Any:
        tc = self.tool_choice
        if tc is None or tc in ("auto", "none", "required"):
            return tc
        if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
            return {"type": "function", "function": {"name": tc["name"]}}
        raise bad_request('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                          "tool_choice", "unsupported_parameter")

    def response_format(self) -> Optional[dict]:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise bad_request("text.format json_schema needs a schema object", "text")
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"],
                                                           "strict": fmt.get("strict")}}
        raise bad_request(f"text.format type {kind!r} is not supported; use 'text', 'json_object' or "
                          "'json_schema'", "text", "unsupported_parameter")

    def to_chat(self, messages: list[dict]) -> ChatCompletionRequest:
        """The chat request this one runs as, over the given messages."""
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            cache_salt=self.cache_salt, stream=self.stream, tools=self.chat_tools(),
            tool_choice=self.chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.response_format(), user=self.user)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}].text must be a string", "input")
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind in _UNSUPPORTED_PARTS:
            raise bad_request(f"{where}.content[{j}] has type {kind!r}: this server serves a text-only model "
                              "(no image, file or audio input)", "input", "unsupported_content")
        else:
            raise bad_request(f"{where}.content[{j}] has unknown type {kind!r}", "input")
    return "\n".join(texts)


def call_ids(messages: list[dict]) -> set[str]:
    """The ids of the tool calls in chat messages (a stored conversation's assistant turns)."""
    return {c.get("id") for m in messages for c in (m.get("tool_calls") or []) if isinstance(c, dict)}


def input_messages(items: Union[str, list[dict]], prior_call_ids: Iterable[str] = ()) -> list[dict]:
    """The Responses API's input (a string, or message / function_call / function_call_output items) as chat
    messages. Consecutive function_call items join one assistant turn; reasoning items are dropped (the chat
    templates do not take them back). A function_call_output must answer a function_call made before it, in the
    input or among prior_call_ids (the previous_response_id conversation's): else a 400, as OpenAI's."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    known = set(prior_call_ids)
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r}", "input")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call item needs call_id and name", "input")
            args = item.get("arguments", "{}")
            args = args if isinstance(args, str) else json.dumps(args)
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}
            known.add(item["call_id"])
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output item needs call_id", "input")
            if item["call_id"] not in known:
                raise bad_request(f"No tool call found for function call output with call_id {item['call_id']}.",
                                  "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text_of(item.get("output", ""), where)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where} has type {kind!r}: input items may be messages, function_call, "
                              "function_call_output or reasoning", "input", "unsupported_parameter")
    return out
