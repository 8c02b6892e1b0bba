"""Tool-call parsers for Llama models: `llama3_json` (also `llama4_json`) and `pythonic` (also `llama4_pythonic`).

These formats have no start tag: a call is where the output holds one.
- llama3_json: JSON objects {"name": ..., "parameters": {...}} ("arguments" is read too), one after another,
  separated by ";" and / or whitespace; a <|python_tag|> just before the first is dropped.
- pythonic: one Python list of calls [f(a=1), g(b="x")] with keyword arguments whose values are literals (strings,
  numbers, True / False / None, JSON's true / false / null, lists, tuples, dicts); <|python_start|> (or
  <|python_tag|>) before it and <|python_end|> after it are dropped.

Like parsers.py's they work on the cumulative text, so a stream and the whole text give the same calls and content.
The calls start at the first JSON object / list in the text that parses as calls; the text before it is content. An
object / list still being written that could become calls holds the text back from its start; one that cannot
(or that is complete and is not calls) is content, and the search goes on at the next "{" / "[". After the calls,
text that is not another call (its separator, an end marker) is content, raw. A stream sends each call whole once
it is complete (as the hermes parser does) and never takes back a call or content it has sent. (vLLM's llama3_json
drops all text when it finds a call, makes all of it content when any "{" in it is not a call, and while streaming
looks for calls only at the very start; its pythonic parser takes only output that is nothing but the list.)
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Optional


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_JSON = json.JSONDecoder(parse_constant=_no_constant)  # strict JSON: no NaN / Infinity, as _could_be_json reads it
_IDENT = re.compile(r"[^\W\d]\w*")
_JSON_STRING_BODY = re.compile(r'[^"\\]*(?:\\["\\/bfnrtu][^"\\]*)*')
_PY_STRING_BODY = {q: re.compile(rf"[^{q}\\]*(?:\\.[^{q}\\]*)*", re.S) for q in "'\""}
_CLOSERS = {")": "(", "]": "[", "}": "{"}


def _held_suffix(text: str, marks: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of marks."""
    best = 0
    for mark in marks:
        for k in range(min(len(mark) - 1, len(text)), best, -1):
            if text.endswith(mark[:k]):
                best = k
                break
    return best


def _arguments_text(args: Any) -> Optional[str]:
    """A call's arguments as JSON text: an object, or a string holding one (else not a call)."""
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        try:
            return args if isinstance(json.loads(args), dict) else None
        except json.JSONDecodeError:
            return None
    return None


class _ScannedToolParser:
    opener = ""  # the character a group of calls starts with
    marks_before: tuple[str, ...] = ()  # special tokens that may open the calls (seen with skip_special_tokens off)
    marks_after: tuple[str, ...] = ()  # ... and close them
    separators = ""  # characters allowed between groups; "" allows one group only

    def __init__(self, tools: Optional[list[dict]] = None):
        self.tools = tools
        # a stream's text only grows, and each "{" / "[" found not to start calls stays so: where the last look
        # got to (text, first undecided position) saves looking at them again on every token
        self._seen, self._undecided = "", 0

    def group(self, text: str, start: int, finished: bool) -> tuple[str, int, list[dict]]:
        """("calls", end, calls) for a complete group of calls at text[start], ("open", ...) for one that may still
        become one, ("no", ...) otherwise."""
        raise NotImplementedError

    def extract(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content, complete calls so far) of the cumulative text (module docstring)."""
        resume = self._undecided if text.startswith(self._seen) else 0
        start = text.find(self.opener, resume)
        while start >= 0:
            kind, end, calls = self.group(text, start, finished)
            if kind == "calls":
                break
            if kind == "open":
                self._remember(text, start, finished)
                return self._lead(text[:start], held=True), []
            start = text.find(self.opener, start + 1)
        else:
            self._remember(text, len(text), finished)
            return self._lead(text, held=not finished), []
        self._remember(text, start, finished)
        head = self._lead(text[:start], held=False, calls_follow=True)
        while True:
            pos = self._skip_between(text, end, finished)
            if pos is None or pos == len(text):  # (None: the start of an end marker)
                return head, calls
            if self.separators and text[pos] == self.opener:
                kind, next_end, more = self.group(text, pos, finished)
                if kind == "calls":
                    calls, end = calls + more, next_end
                    continue
                if kind == "open":
                    return head, calls
            return head + text[pos:], calls

    def _remember(self, text: str, undecided: int, finished: bool) -> None:
        if not finished:  # (a group still open when the text ends is "no" then, but not for a longer text)
            self._seen, self._undecided = text, undecided

    def _skip_between(self, text: str, pos: int, finished: bool) -> Optional[int]:
        """Past whitespace, separators and end markers after a group (None: the text, still coming, ends in the
        start of a marker)."""
        while pos < len(text):
            if text[pos].isspace() or text[pos] in self.separators:
                pos += 1
                continue
            mark = next((m for m in self.marks_after if text.startswith(m, pos)), None)
            if mark is not None:
                pos += len(mark)
                continue
            if not finished and any(m.startswith(text[pos:]) for m in self.marks_after):
                return None
            break
        return pos

    def _lead(self, text: str, held: bool, calls_follow: bool = False) -> str:
        """The content before the calls (or before what may still become them): a marker that opens them is
        dropped (and while text is still coming, held back, as is the start of one); content that is only
        whitespace counts as none until the text ends without calls."""
        if held or calls_follow:
            stripped = text.rstrip()
            mark = next((m for m in self.marks_before if stripped.endswith(m)), None)
            if mark is not None:
                text = stripped[: -len(mark)]
            elif held:
                text = text[: len(text) - _held_suffix(text, self.marks_before)]
            return text if text.strip() else ""
        return text


# -- llama3_json ------------------------------------------------------------------------------------------------
def _could_be_json(text: str, start: int) -> bool:
    """Whether text[start:] (a "{" and what follows) can still grow into JSON. Errs on the side of yes: only a
    definite no lets the stream send the text as content."""
    stack: list[str] = []
    expect = "value"  # value | value_or_close | key | key_or_close | colon | comma_or_close
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            i += 1
            continue
        if expect in ("value", "value_or_close"):
            if c == "]" and expect == "value_or_close":
                stack.pop()
                i += 1
            elif c in "{[":
                stack.append(c)
                expect = "key_or_close" if c == "{" else "value_or_close"
                i += 1
                continue
            elif c == '"':
                i = _string_end(text, i)
                if i < 0:
                    return i == -1
            elif c in "-0123456789":
                while i < n and text[i] in "+-0123456789.eE":
                    i += 1
            elif c in "tfn":
                j = i
                while j < n and text[j].isalpha():
                    j += 1
                word = text[i:j]
                if word not in ("true", "false", "null"):
                    return j == n and any(w.startswith(word) for w in ("true", "false", "null"))
                i = j
            else:
                return False
        elif expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                stack.pop()
                i += 1
            elif c == '"':
                i = _string_end(text, i)
                if i < 0:
                    return i == -1
                expect = "colon"
                continue
            else:
                return False
        elif expect == "colon":
            if c != ":":
                return False
            expect = "value"
            i += 1
            continue
        else:  # comma_or_close
            if c == ",":
                expect = "key" if stack[-1] == "{" else "value"
                i += 1
                continue
            if c not in "}]" or _CLOSERS[c] != stack[-1]:
                return False
            stack.pop()
            i += 1
        if not stack:
            return True  # complete (the caller decodes it)
        expect = "comma_or_close"
    return True


def _string_end(text: str, i: int) -> int:
    """Index past the JSON string opening at text[i]; -1 if the text ends inside it, -2 if it is not valid."""
    i = _JSON_STRING_BODY.match(text, i + 1).end()  # (the body's characters and valid escapes at once)
    if i == len(text) or (text[i] == "\\" and i + 1 == len(text)):
        return -1
    return i + 1 if text[i] == '"' else -2  # (else a backslash before a character JSON cannot escape)


class Llama3JsonToolParser(_ScannedToolParser):
    opener = "{"
    marks_before = ("<|python_tag|>",)
    marks_after = ("<|eom_id|>", "<|eot_id|>")
    separators = ";"

    def group(self, text: str, start: int, finished: bool) -> tuple[str, int, list[dict]]:
        try:
            obj, end = _JSON.raw_decode(text, start)
        except (ValueError, RecursionError):  # (JSONDecodeError is a ValueError)
            return ("open" if not finished and _could_be_json(text, start) else "no"), start, []
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not name:
            return "no", start, []
        args = _arguments_text(obj["arguments"] if "arguments" in obj else obj.get("parameters"))
        if args is None:
            return "no", start, []
        return "calls", end, [{"name": name, "arguments": args}]


# -- pythonic ---------------------------------------------------------------------------------------------------
def _call_list_end(text: str, start: int) -> tuple[str, int]:
    """("closed", index past the "]"), ("open", -1) while it may still become a list of calls, ("no", -1)."""
    stack = ["["]
    expect = "name_or_end"  # between calls, directly in the list: name_or_end | paren | comma_or_end
    quote = ""
    i, n = start + 1, len(text)
    while i < n:
        c = text[i]
        if quote:
            i = _PY_STRING_BODY[quote].match(text, i).end()  # to the closing quote, past escapes
            if i < len(text) and text[i] == quote:
                quote = ""
                i += 1
            else:
                return "open", -1
            continue
        if len(stack) == 1:
            if c.isspace():
                pass
            elif c == "]" and expect != "paren":
                return "closed", i + 1
            elif expect == "name_or_end":
                m = _IDENT.match(text, i)
                if m is None:
                    return "no", -1
                i, expect = m.end(), "paren"
                continue
            elif expect == "paren" and c == "(":
                stack.append(c)
            elif expect == "comma_or_end" and c == ",":
                expect = "name_or_end"
            else:
                return "no", -1
        elif c in "'\"":
            quote = c
        elif c in "([{":
            stack.append(c)
        elif c in ")]}":
            if stack[-1] != _CLOSERS[c]:
                return "no", -1
            stack.pop()
            if len(stack) == 1:
                expect = "comma_or_end"
        i += 1
    return "open", -1


class _NotLiteral(Exception):
    pass


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotLiteral
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return _literal(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:  # a model writing JSON's words
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise _NotLiteral
            out[key] = _literal(v)
        return out
    raise _NotLiteral


def _python_calls(source: str) -> Optional[list[dict]]:
    """The calls of a Python list of calls with keyword arguments only, or None."""
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for call in node.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            return None  # (positional arguments have no names to give them)
        try:
            args = {kw.arg: _literal(kw.value) for kw in call.keywords if kw.arg is not None}
        except (_NotLiteral, RecursionError):
            return None
        if len(args) != len(call.keywords):
            return None  # **kwargs
        calls.append({"name": call.func.id, "arguments": json.dumps(args, ensure_ascii=False)})
    return calls


class PythonicToolParser(_ScannedToolParser):
    opener = "["
    marks_before = ("<|python_start|>", "<|python_tag|>")
    marks_after = ("<|python_end|>", "<|eom_id|>", "<|eot_id|>")

    def group(self, text: str, start: int, finished: bool) -> tuple[str, int, list[dict]]:
        state, end = _call_list_end(text, start)
        if state == "closed":
            calls = _python_calls(text[start:end])
            return ("calls", end, calls) if calls else ("no", start, [])
        return ("open" if state == "open" and not finished else "no"), start, []
