"""Request models for the Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) and their translation
into a chat-completions request, which the server's chat path (templating, tools, parsers) then serves.

Translation: `system` (a string or text blocks) -> a system message; a user turn's `text` blocks -> one user
message (joined by newlines), its `tool_result` blocks -> tool messages (placed before that text, in their order;
an `is_error` result's text starts with "Error: "); an assistant turn's `text` blocks -> its content, its
`tool_use` blocks -> tool_calls (same ids), `thinking` / `redacted_thinking` blocks dropped. A last assistant
turn is a prefill: the template continues it. `tools` -> functions; `tool_choice` auto / any / tool / none ->
"auto" / "required" / a named function / "none" (`disable_parallel_tool_use` -> parallel_tool_calls false);
`thinking` enabled / disabled -> the chat template kwarg `enable_thinking` (Qwen3's templates read it; the
budget is not enforced); `stop_sequences` -> stop strings. Refused with a 400: image and document blocks (and any
other block type), server tools (a tool with a `type` other than "custom"), `mcp_servers`, `container`.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest

_DROPPED = {"thinking", "redacted_thinking"}


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or "type" not in block:
        raise bad_request(f"{where} must be an object with a 'type'", "messages")
    if block["type"] != "text":
        raise bad_request(f"{where} has type {block['type']!r}: only text blocks are accepted here (this server "
                          "serves a text-only model: no image or document input)", "messages")
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


def _user_turn(content: list, where: str, tool_names: dict[str, str]) -> list[dict]:
    tool_msgs: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        w = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{w}.tool_use_id must be a string", "messages")
            text = _texts(block.get("content", ""), f"{w}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            msg = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in tool_names:
                msg["name"] = tool_names[call_id]
            tool_msgs.append(msg)
        else:
            texts.append(_block_text(block, w))
    return tool_msgs + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_turn(content: list, where: str, tool_names: dict[str, str]) -> dict:
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _DROPPED:
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

    def chat_messages(self) -> list[dict]:
        out: list[dict] = []
        if self.system is not None:
            system = _texts(self.system, "system")
            if system:
                out.append({"role": "system", "content": system})
        tool_names: dict[str, str] = {}
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            role = m.get("role")
            if role not in ("user", "assistant"):
                raise bad_request(f"{where}.role must be 'user' or 'assistant', got {role!r}", "messages")
            content = m.get("content")
            if isinstance(content, str):
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
        if self.thinking is None:
            return None
        kind = self.thinking.get("type")
        if kind in ("enabled", "disabled"):
            return {"enable_thinking": kind == "enabled"}
        raise bad_request('thinking must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}',
                          "thinking")

    def chat_request(self) -> ChatCompletionRequest:
        """The chat-completions request this one is served as."""
        messages = self.chat_messages()
        if not any(m["role"] != "system" for m in messages):
            raise bad_request("messages has no content to answer", "messages")
        prefill = messages[-1]["role"] == "assistant"
        tool_choice, parallel = self.chat_tool_choice()
        fields: dict[str, Any] = dict(
            model=self.model, messages=messages, tools=self.chat_tools(), tool_choice=tool_choice,
            parallel_tool_calls=parallel, chat_template_kwargs=self.template_kwargs(),
            add_generation_prompt=not prefill, continue_final_message=prefill)
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
