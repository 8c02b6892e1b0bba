"""The tool calls in output constrained by a forced tool_choice (tool_choice.py), from a growing or finished text.

Named function: the whole output is the arguments of its one call. "required": the output is a JSON array
[{"name": "f", "parameters": {...}}, ...] (the grammar fixes that key order and allows no other keys); each
element is a call whose arguments are the text of its "parameters" value as generated, not re-serialized, so the
arguments of a call only ever grow while the text grows and streamed deltas add up to the final arguments. A call
is listed once its name and the start of its arguments are in the text. Text cut short by max_tokens gives the
calls as far as they got (their arguments then are not complete JSON), as a stream would have sent them.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from voltllm.entrypoints.openai.tool_choice import ForcedToolChoice

# the head of one array element, up to where its arguments begin
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


def _elements(text: str) -> list[tuple[int, Optional[int]]]:
    """(start, end or None while open) of each container directly inside the top-level array of text."""
    spans: list[tuple[int, Optional[int]]] = []
    depth, start, in_str, esc = 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth == 2:
                start = i
        elif ch in "]}":
            if depth == 2:
                spans.append((start, i))
            depth -= 1
    if depth >= 2:
        spans.append((start, None))
    return spans


def required_calls(text: str) -> list[dict]:
    if not text.lstrip().startswith("["):
        return []
    calls = []
    for start, end in _elements(text):
        m = _CALL_HEAD.match(text, start)
        if m is None:
            break  # not a call, or its head is not all there yet
        try:
            name = json.loads(m.group(1))
        except ValueError:
            break
        calls.append({"name": name, "arguments": text[m.end(): len(text) if end is None else end]})
    return calls


def forced_calls(forced: ForcedToolChoice, text: str, finished: bool) -> list[dict]:
    """[{"name", "arguments"}, ...] so far in text; a named function's call shows once there is text (or at the
    end, whatever the text)."""
    if forced.mode == "named":
        return [{"name": forced.name, "arguments": text}] if (text or finished) else []
    return required_calls(text)
