"""Reasoning and tool-call parsers for chat output (--reasoning-parser, --tool-call-parser).

Both work on the cumulative generated text (what the engine hands us), so streaming and non-streaming
share one code path: the streaming side diffs successive results. While a stream runs, text that could
still become a tag (a trailing "</thi" or "<tool_ca") is held back until the next tokens decide it.

- reasoning `qwen3` (also `deepseek_r1`): "<think>...</think>" -> reasoning_content; the rest is content.
  A template that opens "<think>" itself (the prompt ends with it) starts the output inside reasoning.
  Without any "<think>", a streamed answer is all content; a non-streamed one is split at "</think>".
  `qwen3` only: inside the reasoning, a "<tool_call>" followed by "<function" (a qwen3_coder call Qwen3.5 opened
  before closing its thinking) also ends it, as in vLLM; the call is content, for the tool parser.
- tools `hermes`: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of them. A block that does
  not parse ends the calls: it and the text after it are content (ToolParser.extract), streamed or not.
- tools `qwen3_coder` (also `qwen3_xml`): <tool_call><function=NAME><parameter=P>value</parameter>...
  </function></tool_call>; values are converted with the request's JSON schema types. A stream sends the call once
  its name is complete, then its arguments a parameter at a time (parse_open_block).
- tools `llama3_json` (also `llama4_json`) and `pythonic` (also `llama4_pythonic`): calls without a start tag, a
  JSON object per call or a Python list of calls (llama_tool_parsers.py).
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional

from voltllm.entrypoints.openai.llama_tool_parsers import Llama3JsonToolParser, PythonicToolParser

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (text to hold back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Splits "<think>...</think>" off the text; start / end: other delimiters (--reasoning-config's strings, which
    the engine also uses for thinking_token_budget and grammars after the reasoning: voltllm/reasoning_config.py)."""

    start_str, end_str = THINK_START, THINK_END
    ends_at_tool_call = False  # a "<tool_call>" followed by "<function" also ends an open reasoning (Qwen3.5)

    def __init__(self, prompt_text: str = "", start: Optional[str] = None, end: Optional[str] = None):
        self.start = start or self.start_str
        self.end = end or self.end_str
        self.opened_by_prompt = prompt_text.rstrip().endswith(self.start)

    def split(self, text: str, finished: bool, streaming: bool) -> tuple[Optional[str], str]:
        """(reasoning so far or None, content so far) for the cumulative text."""
        start, end_tag = self.start, self.end
        started = self.opened_by_prompt
        t = text
        stripped = t.lstrip()
        if stripped.startswith(start):
            started, t = True, stripped[len(start):]
        elif not finished and stripped and start.startswith(stripped):
            return None, ""  # could still become the start
        if not started and streaming:
            return None, text
        end = t.find(end_tag)
        if started and self.ends_at_tool_call:
            call, pending = _tool_call_in_reasoning(t, end if end >= 0 else len(t), finished)
            if call >= 0:  # the call is content, so the tool parser sees it
                return t[:call].lstrip(), t[call:]
        else:
            pending = len(t)
        if end >= 0:
            return t[:end].lstrip(), t[end + len(end_tag):].lstrip()
        if not started:
            return None, text
        if finished:
            return t.lstrip(), ""  # reasoning cut short (max_tokens)
        return t[: min(pending, len(t) - _partial_suffix(t, end_tag))].lstrip(), ""


_FUNCTION_OPEN = re.compile(r"\s*<function[\s=]")


def _tool_call_in_reasoning(t: str, limit: int, finished: bool) -> tuple[int, int]:
    """(where the first "<tool_call>" before limit that opens a qwen3_coder call starts, or -1; where the text that may
    still become one starts, len(t) if none). As vLLM's qwen3 parser: a "<tool_call>" ends the reasoning only when
    "<function=" follows it (a model that writes the tag in its thoughts keeps thinking)."""
    at = t.find(TOOL_START)
    while 0 <= at < limit:
        after = t[at + len(TOOL_START):]
        if _FUNCTION_OPEN.match(after):
            return at, len(t)
        rest = after.lstrip()
        if not finished and (not rest or "<function".startswith(rest)):
            return -1, at  # "<tool_call>\n<func": not decided yet
        at = t.find(TOOL_START, at + 1)
    if finished:
        return -1, len(t)
    return -1, len(t) - _partial_suffix(t, TOOL_START)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3.5 sometimes opens its tool call before closing the thinking: the call ends the reasoning (vLLM's)."""
    ends_at_tool_call = True


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": ReasoningParser}


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """Base: finds <tool_call>...</tool_call> blocks; subclasses parse one block's body."""

    def __init__(self, tools: Optional[list[dict]] = None):
        self.schemas: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                self.schemas[fn["name"]] = fn.get("parameters") or {}

    def parse_block(self, body: str) -> Optional[dict]:
        raise NotImplementedError

    def parse_open_block(self, body: str) -> Optional[dict]:
        """A call still being written, while a stream runs: its name and a prefix of its final arguments, or None
        (then the call goes once its block is complete). A parser that gives one must make the finished block
        parse to the same name and to arguments that start with that prefix (a stream never takes back)."""
        return None

    def extract(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content, complete calls so far) of the cumulative text. The calls are the blocks that parse, up to the
        first one that does not; the content is the text before the first block, and from a block that does not
        parse on, the raw text (that block and all after it). So a stream never takes back a call it has sent,
        nothing the model wrote is lost, and the streamed and the whole text give the same result. (vLLM's hermes
        parser makes all of such an output content when not streaming, while its stream has sent the calls.) Text
        between and after parsed blocks is dropped, as vLLM's; a block still open is held back until the text
        finishes, then parsed as it stands (output cut by max_tokens, or a model that omits the end tag)."""
        first = text.find(TOOL_START)
        if first < 0:
            hold = 0 if finished else _partial_suffix(text, TOOL_START)
            return text[: len(text) - hold], []
        calls: list[dict] = []
        start = first
        while start >= 0:
            end = text.find(TOOL_END, start)
            if end < 0 and not finished:  # still being written
                partial = self.parse_open_block(text[start + len(TOOL_START):])
                if partial is not None:
                    calls.append(partial)
                break
            body = text[start + len(TOOL_START): end if end >= 0 else len(text)]
            call = self.parse_block(body)
            if call is None:
                return text[:first] + text[start:], calls
            calls.append(call)
            if end < 0:
                break
            start = text.find(TOOL_START, end + len(TOOL_END))
        return text[:first], calls


class HermesToolParser(ToolParser):
    def parse_block(self, body: str) -> Optional[dict]:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return {"name": obj["name"],
                "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


_FUNC = re.compile(r"<function=([^>\s]+)\s*>(.*?)(?:</function>|$)", re.S)
_PARAM = re.compile(r"<parameter=([^>\s]+)\s*>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


class Qwen3CoderToolParser(ToolParser):
    def _convert(self, func: str, name: str, raw: str) -> Any:
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        prop = (self.schemas.get(func, {}).get("properties") or {}).get(name) or {}
        kind = prop.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), None)
        if kind == "string":
            return value
        if value.strip().lower() == "null":
            return None
        try:
            if kind == "integer":
                return int(value.strip())
            if kind == "number":
                v = float(value.strip())
                return int(v) if v.is_integer() and "." not in value else v
            if kind == "boolean":
                return value.strip().lower() == "true"
            return json.loads(value)
        except (ValueError, json.JSONDecodeError):
            return value

    def parse_block(self, body: str) -> Optional[dict]:
        m = _FUNC.search(body)
        if not m:
            return None
        func = m.group(1).strip()
        args = {p.group(1).strip(): self._convert(func, p.group(1).strip(), p.group(2))
                for p in _PARAM.finditer(m.group(2))}
        return {"name": func, "arguments": json.dumps(args, ensure_ascii=False)}

    def parse_open_block(self, body: str) -> Optional[dict]:
        """The name once "<function=NAME>" is complete, then the arguments grow by one parameter as each one is
        complete (its "</parameter>", the next "<parameter=" or the "</function>" written), as vLLM streams them:
        "{", then '"p": value' pieces joined by ", ", the "}" when the block ends. These are json.dumps's own
        separators, so the pieces add up to parse_block's arguments."""
        m = _FUNC.search(body)
        if not m:
            return None
        func, params = m.group(1).strip(), m.group(2)
        closed = m.group(0).endswith("</function>")
        pieces: list[str] = []
        seen: set[str] = set()
        for p in _PARAM.finditer(params):
            name = p.group(1).strip()
            complete = closed or p.group(0).endswith("</parameter>") or params.startswith("<parameter=", p.end())
            if not complete or name in seen:  # (a repeated name would change an earlier value: wait for the end)
                closed = False
                break
            seen.add(name)
            value = json.dumps(self._convert(func, name, p.group(2)), ensure_ascii=False)
            pieces.append(f"{json.dumps(name, ensure_ascii=False)}: {value}")
        return {"name": func, "arguments": "{" + ", ".join(pieces) + ("}" if closed else "")}


TOOL_PARSERS = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser, "qwen3_xml": Qwen3CoderToolParser,
                "llama3_json": Llama3JsonToolParser, "llama4_json": Llama3JsonToolParser,
                "pythonic": PythonicToolParser, "llama4_pythonic": PythonicToolParser}
