"""Reasoning and tool-call parsers for chat output (--reasoning-parser, --tool-call-parser).

Both work on the cumulative generated text (what the engine hands us), so streaming and non-streaming
share one code path: the streaming side diffs successive results. While a stream runs, text that could
still become a tag (a trailing "</thi" or "<tool_ca") is held back until the next tokens decide it.

- reasoning `qwen3` (also `deepseek_r1`): "<think>...</think>" -> reasoning_content; the rest is content.
  A template that opens "<think>" itself (the prompt ends with it) starts the output inside reasoning.
  Without any "<think>", a streamed answer is all content; a non-streamed one is split at "</think>".
  `qwen3` only: inside the reasoning, a "<tool_call>" followed by "<function" (a qwen3_coder call Qwen3.5 opened
  before closing its thinking) also ends it, as in vLLM; the call is content, for the tool parser.
- tools `hermes`: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of them. A block is a call
  once its name string is complete; a stream sends it then, and its arguments as they are written (hermes_reader.py).
  A block with no name string ends the calls: it and the text after it are content (ToolParser.extract).
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

from voltllm.entrypoints.openai.hermes_reader import HermesCallReader
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

    def read_block(self, text: str, start: int, finished: bool) -> tuple[Optional[dict], int, bool]:
        """The block whose "<tool_call>" is at text[start]: (its call or None, where its end tag starts or -1,
        decided). While not decided the call is the one still being written (parse_open_block) or None; decided,
        a None call makes the block content."""
        body = start + len(TOOL_START)
        end = text.find(TOOL_END, body)
        if end < 0 and not finished:  # still being written
            return self.parse_open_block(text[body:]), -1, False
        return self.parse_block(text[body: end if end >= 0 else len(text)]), end, True

    def extract(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content, calls so far) of the cumulative text. The calls are the blocks that parse, up to the
        first one that does not; the content is the text before the first block, and from a block that does not
        parse on, the raw text (that block and all after it). So a stream never takes back a call it has sent,
        nothing the model wrote is lost, and the streamed and the whole text give the same result. (vLLM's hermes
        parser makes all of such an output content when not streaming, while its stream has sent the calls.) Text
        between and after parsed blocks is dropped, as vLLM's; a block still open is parsed as it stands once the
        text finishes (output cut by max_tokens, or a model that omits the end tag)."""
        first = text.find(TOOL_START)
        if first < 0:
            hold = 0 if finished else _partial_suffix(text, TOOL_START)
            return text[: len(text) - hold], []
        calls: list[dict] = []
        start = first
        while start >= 0:
            call, end, decided = self.read_block(text, start, finished)
            if not decided:
                if call is not None:
                    calls.append(call)
                break
            if call is None:
                return text[:first] + text[start:], calls
            calls.append(call)
            if end < 0:
                break
            start = text.find(TOOL_START, end + len(TOOL_END))
        return text[:first], calls


class HermesToolParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>. A block is a call once its name is complete (what a
    stream sends first); its arguments stream as they are written, re-serialized as json.dumps writes them
    (hermes_reader.py). The block ends at the first "</tool_call>" after its JSON object (one inside a JSON string
    is text of the arguments). Arguments that do not end as JSON (cut short, or not JSON from some point on) are
    the re-serialized part, then the rest of the block as written, so the stream can have sent the first part."""

    def __init__(self, tools: Optional[list[dict]] = None):
        super().__init__(tools)
        self._seen = ""  # the text of the last extract: a stream's next text continues it
        self._readers: dict[int, HermesCallReader] = {}  # by the block's start: read on where they stopped

    def extract(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        if not text.startswith(self._seen):  # (not a continuation: read again from the start)
            self._readers = {}
        self._seen = text
        return super().extract(text, finished)

    def read_block(self, text: str, start: int, finished: bool) -> tuple[Optional[dict], int, bool]:
        body = start + len(TOOL_START)
        reader = self._readers.setdefault(start, HermesCallReader())
        reader.read(text, body)
        end = text.find(TOOL_END, body + reader.pos) if reader.stopped else -1
        decided = end >= 0 or finished
        if reader.name is None:
            return None, end, decided
        if reader.args_state == "done":
            args = reader.arguments()
        elif reader.args_state == "none":
            args = "{}" if decided or reader.stopped else ""  # (as json.loads read: no arguments, none)
        elif decided:  # the JSON stops inside the arguments: the rest of the block as written follows
            args = reader.arguments() + text[body + reader.args_mark: end if end >= 0 else len(text)].strip()
        else:
            args = reader.arguments()
        return {"name": reader.name, "arguments": args}, end, decided


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
