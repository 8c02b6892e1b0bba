"""Request models for the Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) and their translation
into a chat-completions request, which the server's chat path (templating, tools, parsers) then serves.

Translation: `system` (a string or text blocks) -> a system message; `role: "system"` messages inside `messages`
(Claude Code sends them) join it when they open `messages`, later ones stay system turns in place or fold into a
neighbouring turn as the template allows (messages_inline_system.py, vLLM's placement); a user turn's `text`
blocks -> one user message (joined by newlines), its `tool_result` blocks -> tool messages (placed before that
text, in their order; an `is_error` result's text starts with "Error: "; the `tool_reference` blocks of Claude
Code's tool search -> a second tool message for that call, see _tool_reference_message); an assistant turn's
`text` blocks -> its content, its `tool_use` blocks -> tool_calls (same ids), its `thinking` blocks -> the message's
`reasoning` (joined, as vLLM's; the chat template gets it as `reasoning_content`), `redacted_thinking` blocks
dropped (opaque data, as vLLM). A last assistant turn is a prefill: the template continues it. `tools` -> functions
(`defer_loading` passed on for the template, as vLLM does); `tool_choice` auto / any / tool / none -> "auto" /
"required" / a named function / "none" (`disable_parallel_tool_use` -> parallel_tool_calls false); `thinking`
enabled / disabled -> the chat template kwarg `enable_thinking` (Qwen3's templates read it; `budget_tokens` ->
thinking_token_budget when the server knows the reasoning's delimiters, else ignored), adaptive -> nothing (the
template's default, as vLLM pins nothing for it); `output_config.effort` -> the template kwarg `reasoning_effort`;
`output_config.format` json_schema (or the older top-level `output_format`) -> a json_schema response_format
(structured outputs); `stop_sequences` -> stop strings.
`image` blocks in user turns (base64 or url sources) -> image_url parts, which the chat path takes or refuses.
Refused with a 400: document blocks (and any other block type, images inside tool results), server tools (a tool
with a `type` other than "custom"), `mcp_servers`, `container`, output formats other than json_schema, an output
format with a forced tool_choice (voltllm takes one output constraint per request), roles other than user /
assistant / system.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.entrypoints.openai.messages_inline_system import place_inline_system, system_text
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest
from voltllm.sampling.structured import StructuredOutputsError, StructuredOutputsParams

_THINKING_DISPLAY = (None, "summarized", "omitted", "updates")  # accepted, not applied: reasoning always returns
_EFFORTS = (None, "low", "medium", "high", "xhigh", "max")


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or "type" not in block:
        raise bad_request(f"{where} must be an object with a 'type'", "messages")
    if block["type"] != "text":
        raise bad_request(f"{where} has type {block['type']!r}: only text blocks are accepted here (images only as "
                          "image blocks of a user turn; no document input)", "messages")
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text must be a string", "messages")
    return block["text"]


def _texts(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", "messages")
    return "\n".join(_block_text(b, f"{where}[{j}]") for j, b in enumerate(content))


def _result_parts(content: Any, where: str) -> tuple[str, list[str]]:
    """A tool_result's text (its text blocks joined by newlines) and the tool names its tool_reference blocks
    name (Claude Code's tool search answers with them: the deferred tools it loaded)."""
    if not isinstance(content, list):
        return _texts(content, where), []
    texts: list[str] = []
    names: list[str] = []
    for j, item in enumerate(content):
        if isinstance(item, dict) and item.get("type") == "tool_reference":
            name = item.get("tool_name", item.get("name"))
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}[{j}] needs a tool_name (the tool it loads)", "messages")
            names.append(name)
        else:
            texts.append(_block_text(item, f"{where}[{j}]"))
    return "\n".join(texts), names


def _tool_reference_message(call_id: str, names: list[str]) -> dict:
    """vLLM gives the template, after the result's own tool message, a second tool message for the call whose
    content is the parts [{"type": "tool_reference", "name": N}, ...] (templates of models trained on tool search
    expand them). Messages reach voltllm's templates as text (normalize_messages), so the same list goes as its
    JSON text."""
    parts = [{"type": "tool_reference", "name": n} for n in names]
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(parts, ensure_ascii=False)}


def _user_turn(content: list, where: str, tool_names: dict[str, str]) -> list[dict]:
    tool_msgs: list[dict] = []
    texts: list[str] = []
    images: list[int] = []  # the indexes in texts that hold image URLs
    for j, block in enumerate(content):
        w = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{w}.tool_use_id must be a string", "messages")
            text, references = _result_parts(block.get("content", ""), f"{w}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            msgs = [{"role": "tool", "tool_call_id": call_id, "content": text}]
            if references:
                msgs.append(_tool_reference_message(call_id, references))
            for msg in msgs:
                if call_id in tool_names:
                    msg["name"] = tool_names[call_id]
            tool_msgs.extend(msgs)
        elif isinstance(block, dict) and block.get("type") == "image":
            images.append(len(texts))
            texts.append(_image_url(block, w))
        else:
            texts.append(_block_text(block, w))
    if images:  # (chat parts: the chat path takes or refuses the images as for /v1/chat/completions)
        parts = [{"type": "image_url", "image_url": {"url": t}} if i in images else {"type": "text", "text": t}
                 for i, t in enumerate(texts)]
        return tool_msgs + [{"role": "user", "content": parts}]
    return tool_msgs + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _image_url(block: dict, where: str) -> str:
    """An image block's source as a URL: base64 data as a data URL, a url source as itself."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(f"{where}: an image block's source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                      f"{{\"type\": \"url\", \"url\"}} (file sources need Anthropic's Files API, not built)",
                      "messages")


def _assistant_turn(content: list, where: str, tool_names: dict[str, str]) -> dict:
    texts: list[str] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for j, block in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "redacted_thinking":
            continue
        if kind == "thinking":
            thinking = block.get("thinking")
            if thinking is not None and not isinstance(thinking, str):
                raise bad_request(f"{w}.thinking must be a string", "messages")
            if thinking is not None:
                thoughts.append(thinking)
            continue
        if kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{w} needs a string 'id' and 'name'", "messages")
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{w}.input must be an object", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": args}})
            tool_names[block["id"]] = block["name"]
        else:
            texts.append(_block_text(block, w))
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        msg["reasoning"] = "".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


class CountTokensRequest(BaseModel):
    """The body of /v1/messages/count_tokens; MessagesRequest adds the generation fields."""
    model_config = ConfigDict(extra="allow")  # Anthropic clients send fields we do not use (e.g. metadata)

    model: str
    messages: list[dict[str, Any]]
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    output_format: Optional[dict[str, Any]] = None  # the older spelling of output_config.format
    mcp_servers: Optional[list[Any]] = None
    container: Optional[Any] = None

    def check(self) -> None:
        if self.mcp_servers:
            raise bad_request("mcp_servers is not supported: this server runs no MCP connector; call the tools "
                              "from the client", "mcp_servers")
        if self.container is not None:
            raise bad_request("container is not supported: this server runs no code-execution containers",
                              "container")
        if not self.messages:
            raise bad_request("messages must be a non-empty list", "messages")

    def chat_messages(self, inline_system: str = "preserve") -> list[dict]:
        """The chat messages; `inline_system` ("preserve" / "fold") places system messages found after the first
        other message (messages_inline_system.py)."""
        for i, m in enumerate(self.messages):
            if m.get("role") not in ("user", "assistant", "system"):
                raise bad_request(f"messages[{i}].role must be 'user', 'assistant' or 'system', got "
                                  f"{m.get('role')!r}", "messages")
        prompt = system_text(self.system, "system") if self.system is not None else ""
        leading, messages = place_inline_system(self.messages, prompt, inline_system)
        system = "\n\n".join(t for t in (prompt, leading) if t)
        out: list[dict] = [{"role": "system", "content": system}] if system else []
        tool_names: dict[str, str] = {}
        for i, m in messages:
            where = f"messages[{i}]" if i is not None else "messages"
            role = m.get("role")
            content = m.get("content")
            if role == "system":  # kept in place: place_inline_system made its content the text
                out.append({"role": "system", "content": content})
            elif isinstance(content, str):
                out.append({"role": role, "content": content})
            elif not isinstance(content, list):
                raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
            elif role == "user":
                out.extend(_user_turn(content, where, tool_names))
            else:
                out.append(_assistant_turn(content, where, tool_names))
        return out

    def chat_tools(self) -> Optional[list[dict]]:
        if not self.tools:
            return None
        out = []
        for i, t in enumerate(self.tools):
            kind = t.get("type")
            if kind not in (None, "custom"):
                raise bad_request(f"tools[{i}] has type {kind!r}: server tools (web search, code execution, ...) "
                                  "are not available on this server; give client tools {name, description, "
                                  "input_schema}", "tools")
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise bad_request(f"tools[{i}].name must be a non-empty string", "tools")
            schema = t.get("input_schema")
            if not isinstance(schema, dict):
                raise bad_request(f"tools[{i}].input_schema must be a JSON schema object", "tools")
            fn: dict[str, Any] = {"name": t["name"], "parameters": schema}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            if t.get("defer_loading") is True:  # for templates that leave such tools out until referenced
                fn["defer_loading"] = True
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> tuple[Any, bool]:
        """(chat tool_choice, parallel_tool_calls)."""
        tc = self.tool_choice
        if tc is None:
            return None, True
        parallel = not tc.get("disable_parallel_tool_use", False)
        kind = tc.get("type")
        if kind in ("auto", "none"):
            return kind, parallel
        if kind == "any":
            return "required", parallel
        if kind == "tool" and isinstance(tc.get("name"), str):
            return {"type": "function", "function": {"name": tc["name"]}}, parallel
        raise bad_request('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                          '{"type": "tool", "name": ...}', "tool_choice")

    def template_kwargs(self) -> Optional[dict]:
        """thinking enabled / disabled -> enable_thinking; adaptive (the model picks its depth) pins nothing, as in
        vLLM: the template's default applies, as without `thinking`. output_config.effort -> reasoning_effort, which
        vLLM's chat path hands the template too (templates that read it, e.g. gpt-oss's, set their depth by it); a
        disabled thinking wins over it, as in vLLM."""
        effort = (self.output_config or {}).get("effort")
        if effort not in _EFFORTS:
            raise bad_request(f"output_config.effort must be one of {', '.join(e for e in _EFFORTS if e)}, got "
                              f"{effort!r}", "output_config.effort")
        kind = None if self.thinking is None else self.thinking.get("type")
        if kind not in (None, "enabled", "disabled", "adaptive"):
            raise bad_request('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                              '{"type": "disabled"}', "thinking")
        if kind in ("enabled", "adaptive") and self.thinking.get("display") not in _THINKING_DISPLAY:
            raise bad_request("thinking.display must be 'summarized', 'omitted' or 'updates'", "thinking")
        kwargs: dict[str, Any] = {}
        if kind in ("enabled", "disabled"):
            kwargs["enable_thinking"] = kind == "enabled"
        if effort is not None and kind != "disabled":
            kwargs["reasoning_effort"] = effort
        return kwargs or None

    def response_format(self, forced_tool: bool) -> Optional[dict]:
        """output_config.format (or output_format) as the chat path's json_schema response_format."""
        if self.output_config is not None and self.output_format is not None:
            raise bad_request("give the output format once: output_config.format (output_format is its older "
                              "name)", "output_format")
        fmt = (self.output_config or {}).get("format") if self.output_format is None else self.output_format
        where = "output_config.format" if self.output_format is None else "output_format"
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise bad_request(f"{where}.type {kind!r} is not supported: the output formats are "
                              '{"type": "json_schema", "schema": {...}}', where)
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.schema must be a JSON schema object", where)
        if forced_tool:
            raise bad_request(f"{where} cannot be combined with tool_choice any or tool: both constrain the output "
                              "and this server applies one constraint per request", where)
        try:
            StructuredOutputsParams(json=schema)  # compiled (and cached) here so a bad schema names this field
        except StructuredOutputsError as e:
            raise bad_request(f"{where}.schema: {e}", where) from None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}

    def thinking_budget(self) -> Optional[int]:
        """thinking.budget_tokens of an enabled thinking: the most tokens the reasoning may take (a positive
        integer; Anthropic's own minimum, 1024, is not imposed on local models)."""
        if self.thinking is None or self.thinking.get("type") != "enabled" or "budget_tokens" not in self.thinking:
            return None
        budget = self.thinking["budget_tokens"]
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad_request(f"thinking.budget_tokens must be a positive integer, got {budget!r}",
                              "thinking.budget_tokens")
        return budget

    def chat_request(self, inline_system: str = "preserve", thinking_budgets: bool = False) -> ChatCompletionRequest:
        """The chat-completions request this one is served as. thinking_budgets: the server knows the reasoning's
        delimiters, so thinking.budget_tokens caps the reasoning (thinking_token_budget); without them it is ignored,
        as clients such as Claude Code send it on every request."""
        messages = self.chat_messages(inline_system)
        if not any(m["role"] != "system" for m in messages):
            raise bad_request("messages has no content to answer", "messages")
        prefill = messages[-1]["role"] == "assistant"
        tool_choice, parallel = self.chat_tool_choice()
        fields: dict[str, Any] = dict(
            model=self.model, messages=messages, tools=self.chat_tools(), tool_choice=tool_choice,
            parallel_tool_calls=parallel, chat_template_kwargs=self.template_kwargs(),
            add_generation_prompt=not prefill, continue_final_message=prefill,
            response_format=self.response_format(tool_choice not in (None, "auto", "none")))
        budget = self.thinking_budget()
        if budget is not None and thinking_budgets:
            fields["thinking_token_budget"] = budget
        fields.update(self._sampling())
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as e:
            raise bad_request(f"the request could not be served as a chat request: {e.errors()[0].get('msg')}")

    def _sampling(self) -> dict:
        return {}


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: StrictBool = False
    metadata: Optional[dict[str, Any]] = None  # accepted, ignored

    def _sampling(self) -> dict:
        return dict(max_tokens=self.max_tokens, stop=self.stop_sequences or None, temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k, stream=self.stream)
