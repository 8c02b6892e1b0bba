"""POST /v1/responses: the request model, and its translation into a chat completion request.

A Responses request becomes chat messages (`instructions` first as a system message, then the conversation of
`previous_response_id`, then `input`), the chat tools shape (the Responses API's flat function tools), the chat
tool_choice and a response_format (`text.format`; vLLM's `structured_outputs` as chat takes it), so the chat path
templates, samples and parses it. What this
server does not build is refused with a 400 naming its parameter; unknown fields are ignored.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Literal, Optional, Union

from pydantic import ConfigDict, StrictBool

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest, NullMeansDefault

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_UNSUPPORTED_PARTS = ("input_file", "input_audio")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values with nothing to add here: no encrypted reasoning is made (reasoning items come back as plain text),
# and the others name outputs of OpenAI's built-in tools, which are not built
_NOTHING_TO_INCLUDE = ("reasoning.encrypted_content", "web_search_call.action.sources", "web_search_call.results",
                       "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                       "file_search_call.results", "message.input_image.image_url")


class ResponsesRequest(NullMeansDefault):
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
    # echoed; its effort goes to the chat template as chat's reasoning_effort (vLLM's), "none" turning thinking off
    reasoning: Optional[dict[str, Any]] = None
    logit_bias: Optional[dict[str, Any]] = None  # as chat's (token id -> bias)
    request_id: Optional[str] = None  # vLLM's: the response's id (default resp_<uuid>)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"  # echoed (vLLM's default: auto)
    user: Optional[str] = None
    background: Optional[bool] = None  # runs on after the answer (responses_background.py); not with stream
    include: Optional[list[str]] = None  # LOGPROBS_INCLUDE, and _NOTHING_TO_INCLUDE (nothing to add)
    top_logprobs: Optional[int] = None  # with LOGPROBS_INCLUDE
    truncation: Optional[str] = None  # "disabled", or "auto": nothing is cut here (input over the context: 400)
    max_tool_calls: Optional[int] = None  # bounds built-in tool calls, of which there are none here
    # not built: refused when set (check())
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
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
    priority: int = 0  # vLLM's: as in chat (lower first under --scheduling-policy priority)
    # vLLM's structured outputs object (json, regex, choice, grammar, json_object, structural_tag), as in chat: its
    # Responses API takes a structural tag only here (text.format is OpenAI's: text, json_object, json_schema)
    structured_outputs: Optional[dict[str, Any]] = None

    def check(self) -> None:
        """400s for what this server does not build."""
        if self.reasoning is not None and not isinstance(self.reasoning.get("effort", None), (str, type(None))):
            raise bad_request("reasoning.effort must be a string, e.g. \"low\", \"medium\", \"high\" or \"none\"",
                              "reasoning")
        if self.request_id is not None and not self.request_id:
            raise bad_request("request_id must be a non-empty string", "request_id")
        if self.background and self.store is False:
            raise bad_request("background responses must be stored: drop store: false", "store")
        if self.background and self.stream:
            raise bad_request("a background response cannot be streamed here; poll GET /v1/responses/{id}",
                              "stream", "unsupported_parameter")
        if self.conversation is not None:
            raise bad_request("conversation is not supported; continue a conversation with previous_response_id",
                              "conversation", "unsupported_parameter")
        for value in self.include or []:
            if value != LOGPROBS_INCLUDE and value not in _NOTHING_TO_INCLUDE:
                raise bad_request(f"include {value!r} is not supported (supported: {LOGPROBS_INCLUDE}, "
                                  f"{', '.join(_NOTHING_TO_INCLUDE)})", "include", "unsupported_parameter")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be between 0 and 20, got {self.top_logprobs}", "top_logprobs")
        if self.truncation not in (None, "disabled", "auto"):
            raise bad_request(f"truncation must be 'auto' or 'disabled', got {self.truncation!r}", "truncation")
        if self.max_tool_calls is not None and self.max_tool_calls < 0:
            raise bad_request(f"max_tool_calls must be >= 0, got {self.max_tool_calls}", "max_tool_calls")
        if self.prompt is not None:
            raise bad_request("prompt templates are not supported", "prompt", "unsupported_parameter")
        if self.n not in (None, 1):
            raise bad_request("n is not a Responses API parameter; one response has one output", "n",
                              "unsupported_parameter")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def chat_tools(self) -> Optional[list[dict]]:
        """The function tools in the chat shape (only those tool_choice's allowed_tools lists, when it does). Tools
        of other types (OpenAI's built-in web_search, file_search, code_interpreter, ..., Codex's local_shell and
        custom tools) are left out: nothing here runs them, and the chat templates show function tools only."""
        if not self.tools:
            return None
        allowed = self._allowed_tool_names()
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                if kind is None:
                    raise bad_request(f"tools[{i}] must be an object with a 'type'", "tools")
                continue
            if isinstance(tool.get("function"), dict):  # the chat shape, taken as well
                if allowed is not None and tool["function"].get("name") not in allowed:
                    continue
                out.append({"type": "function", "function": tool["function"]})
                continue
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise bad_request(f"tools[{i}].name must be a non-empty string", "tools")
            if allowed is not None and tool["name"] not in allowed:
                continue
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        return out or None

    def _allowed_tool_names(self) -> Optional[set]:
        """tool_choice {"type": "allowed_tools", "mode": ..., "tools": [{"type": "function", "name": ...}]}: the
        function names it allows (None: no such tool_choice)."""
        tc = self.tool_choice
        if not (isinstance(tc, dict) and tc.get("type") == "allowed_tools"):
            return None
        tools = tc.get("tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad_request("tool_choice allowed_tools needs a list of tools", "tool_choice")
        return {t.get("name") or (t.get("function") or {}).get("name") for t in tools if t.get("type") == "function"}

    def chat_tool_choice(self) -> Any:
        tc = self.tool_choice
        if tc is None or tc in ("auto", "none", "required"):
            return tc
        if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
            return {"type": "function", "function": {"name": tc["name"]}}
        if isinstance(tc, dict) and tc.get("type") == "allowed_tools":
            mode = tc.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise bad_request(f"tool_choice allowed_tools mode must be 'auto' or 'required', got {mode!r}",
                                  "tool_choice")
            return mode
        raise bad_request('tool_choice must be "auto", "none", "required", {"type": "function", "name": ...} or '
                          '{"type": "allowed_tools", ...}', "tool_choice", "unsupported_parameter")

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
        if kind == "structural_tag":  # (vLLM's text.format is OpenAI's type, which has no structural tag either)
            raise bad_request("text.format type 'structural_tag' is not a Responses API format (text, json_object, "
                              "json_schema); give the tag as structured_outputs.structural_tag (its JSON text), as "
                              "vLLM's Responses API takes it", "text", "unsupported_parameter")
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
            cache_salt=self.cache_salt, priority=self.priority, stream=self.stream, tools=self.chat_tools(),
            reasoning_effort=(self.reasoning or {}).get("effort"), logit_bias=self.logit_bias,
            tool_choice=self.chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.response_format(), structured_outputs=self.structured_outputs, user=self.user,
            logprobs=self.wants_logprobs, top_logprobs=self.top_logprobs if self.wants_logprobs else None)


def _text_of(content: Any, where: str) -> Union[str, list[dict]]:
    """A message's content for the chat request: its text, or, when it holds input_image parts, chat parts (text and
    image_url, in order; the chat path takes or refuses the images as for /v1/chat/completions)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{j}].text must be a string", "input")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise bad_request(f"{where}.content[{j}]: an input_image needs an image_url (a URL or a data URL); "
                                  "file_id images need OpenAI's Files API, which is not built", "input",
                                  "unsupported_content")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind in _UNSUPPORTED_PARTS:
            raise bad_request(f"{where}.content[{j}] has type {kind!r}: this server takes no file or audio input",
                              "input", "unsupported_content")
        else:
            raise bad_request(f"{where}.content[{j}] has unknown type {kind!r}", "input")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _reasoning_of(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content (what this server and vLLM output), else its summary
    (what OpenAI returns), its parts joined (vLLM reads the first part only). Encrypted reasoning cannot be read
    here: a 400, as vLLM's."""
    if item.get("encrypted_content"):
        raise bad_request(f"{where}: encrypted reasoning content is not supported; resend the reasoning as content "
                          '[{"type": "reasoning_text", "text": ...}]', "input", "unsupported_parameter")
    for field in ("content", "summary"):
        parts = item.get(field)
        if not parts:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise bad_request(f"{where}.{field} must be a list of parts with a text string", "input")
        return ("" if field == "content" else "\n\n").join(p["text"] for p in parts)
    return ""


def call_ids(messages: list[dict]) -> set[str]:
    """The ids of the tool calls in chat messages (a stored conversation's assistant turns)."""
    return {c.get("id") for m in messages for c in (m.get("tool_calls") or []) if isinstance(c, dict)}


def input_messages(items: Union[str, list[dict]], prior_call_ids: Iterable[str] = ()) -> list[dict]:
    """The Responses API's input (a string, or message / reasoning / function_call / function_call_output items) as
    chat messages. As vLLM: a reasoning item becomes the `reasoning` of an assistant turn (the one before it when
    that has none yet, else a new turn), and the assistant message and function_call items after it join that turn,
    so a resent output (reasoning, message, calls) is one turn again and the template shows the earlier reasoning
    (normalize_messages hands it over as reasoning_content too). A function_call_output must answer a function_call
    made before it, in the input or among prior_call_ids (the previous_response_id conversation's): else a 400, as
    OpenAI's."""
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
            text = _text_of(item.get("content"), where)
            last = out[-1] if out else None
            if role == "assistant" and last is not None and last["role"] == "assistant" and last["content"] is None:
                last["content"] = text  # the text of a turn its reasoning (or calls) opened, as vLLM joins them
            else:
                out.append({"role": role, "content": text})
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
            reasoning = _reasoning_of(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("reasoning") is None:
                last["reasoning"] = reasoning
            else:
                out.append({"role": "assistant", "content": None, "reasoning": reasoning})
        else:
            raise bad_request(f"{where} has type {kind!r}: input items may be messages, function_call, "
                              "function_call_output or reasoning", "input", "unsupported_parameter")
    return out
