"""Tool-call parsers for Llama models: `llama3_json` (also `llama4_json`) and `pythonic` (also `llama4_pythonic`).

These formats have no start tag: a call is where the output holds one.
- llama3_json: JSON objects {"name": ..., "parameters": {...}} ("arguments" is read too), one after another,
  separated by ";" and / or whitespace; a <|python_tag|> just before the first is dropped. An object's first key
  must be one of CALL_FIRST_KEYS (Llama's templates write "name" first), else it is not a call (vLLM's takes the
  keys in any order, beside any others): a JSON answer is content as soon as its first key is.
- pythonic: one Python list of calls [f(a=1), g(b="x")] with keyword arguments whose values are literals (strings,
  numbers, True / False / None, JSON's true / false / null, lists, tuples, dicts); <|python_start|> (or
  <|python_tag|>) before it and <|python_end|> after it are dropped.

Like parsers.py's they work on the cumulative text, so a stream and the whole text give the same calls and content.
The calls start at the first JSON object / list in the text that parses as calls; the text before it is content. An
object / list still being written that could become calls holds the text back from its start; one that cannot
(or that is complete and is not calls) is content, and the search goes on at the next "{" / "[". After the calls,
text that is not another call (its separator, an end marker) is content, raw. A stream sends each call whole once
it is complete (as the hermes parser does) and never takes back a call or content it has sent. The text only grows,
so each "{" / "[" is scanned on from where the last token stopped (_JsonScan, _CallListScan): a stream's work is
about its length, not its length times its tokens. (vLLM's llama3_json
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


_JSON = json.JSONDecoder(parse_constant=_no_constant)  # strict JSON: no NaN / Infinity, as _JsonScan reads it
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
        # A stream's text only grows, so nothing is looked at twice: what the last call saw, the first "{" / "["
        # not yet found to be no calls (those before it stay so), and each group looked at, by its start: its
        # verdict once final ("calls" / "no"), else its scanner, which goes on where it stopped.
        self._seen, self._undecided = "", 0
        self._groups: dict[int, Any] = {}
        self.chars_scanned = 0  # characters the group scanners examined: the work of a stream (tests bound it)

    def _scanner(self, start: int) -> Any:
        """A scanner of the group at text[start] (advance(text) -> "open" / "closed" / "no"; pos; examined)."""
        raise NotImplementedError

    def _decide(self, text: str, start: int, end: int) -> tuple[str, int, list[dict]]:
        """("calls", end, calls) or ("no", start, []) for the group text[start:end] its scanner found closed."""
        raise NotImplementedError

    def group(self, text: str, start: int, finished: bool) -> tuple[str, int, list[dict]]:
        """("calls", end, calls) for a complete group of calls at text[start], ("open", ...) for one that may still
        become one, ("no", ...) otherwise."""
        known = self._groups.get(start)
        if isinstance(known, tuple):
            return known
        scan = known if known is not None else self._scanner(start)
        before = scan.examined
        verdict = scan.advance(text)
        self.chars_scanned += scan.examined - before
        if verdict == "open":
            self._groups[start] = scan  # (open at the end of a finished text is "no" now, not for a longer one)
            return ("no" if finished else "open"), start, []
        result = self._decide(text, start, scan.pos) if verdict == "closed" else ("no", start, [])
        self._groups[start] = result
        return result

    def extract(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content, complete calls so far) of the cumulative text (module docstring)."""
        if not text.startswith(self._seen):  # (not a continuation: look again from the start)
            self._undecided, self._groups = 0, {}
        self._seen = text
        start = text.find(self.opener, self._undecided)
        while start >= 0:
            kind, end, calls = self.group(text, start, finished)
            if kind == "calls":
                break
            if kind == "open":
                self._remember(start, finished)
                return self._lead(text[:start], held=True), []
            start = text.find(self.opener, start + 1)
        else:
            self._remember(len(text), finished)
            return self._lead(text, held=not finished), []
        self._remember(start, finished)
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

    def _remember(self, undecided: int, finished: bool) -> None:
        # (a group still open when the text ends is "no" then, but not for a longer text)
        if not finished and undecided > self._undecided:
            self._undecided = undecided
            self._groups = {k: v for k, v in self._groups.items() if k >= undecided}

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
# The keys a call's object may start with: Llama 3.1 / 3.2 / 3.3's templates and prompt formats write "name" first
# (Meta's Llama 3.1 docs also show `"type": "function"` before it); the arguments first are taken too. An object that
# starts with any other key is content as soon as that key is complete, so a JSON answer streams at once.
CALL_FIRST_KEYS = frozenset({"name", "type", "parameters", "arguments"})
_NUMBER_CHARS = frozenset("+-0123456789.eE")


class _Scan:
    """A held-back group's scanner: it walks the text from where its last advance stopped (the text only grows)."""

    pos: int
    examined: int

    def advance(self, text: str) -> str:
        """"open" while the group may still become calls, "closed" (pos: past its last bracket) or "no"."""
        entry = self.pos
        verdict, stop = self._walk(text)
        self.examined += max(stop - entry, 0)
        return verdict

    def _walk(self, text: str) -> tuple[str, int]:
        raise NotImplementedError


class _JsonScan(_Scan):
    """Whether the "{" at `start` and what follows can still grow into JSON, read as the text grows: each advance
    goes on where the last stopped (inside a string too), so a stream reads each character about once. Errs on the
    side of yes (the closed object is decoded after), except that an object whose first key is not one of
    first_keys is a no."""

    def __init__(self, start: int, first_keys: Optional[frozenset] = None):
        self.pos = start  # where the next advance reads: a token's start, or inside a string's body
        self.stack: list[str] = []
        self.expect = "value"  # value | value_or_close | key | key_or_close | colon | comma_or_close
        self.string_from = -1  # the opening quote of the string pos is inside (-1: none)
        self.first_keys = first_keys
        self.examined = 0  # characters looked at, over all advances (a token cut by the text's end counts again)


    def _walk(self, text: str) -> tuple[str, int]:
        stack = self.stack
        i, n = self.pos, len(text)
        while i < n:
            if self.string_from >= 0:
                j = _JSON_STRING_BODY.match(text, i).end()  # (the body's characters and valid escapes at once)
                if j == n or (text[j] == "\\" and j + 1 == n):
                    self.pos = j  # (a boundary between the body's pieces: the next advance goes on from here)
                    return "open", n
                if text[j] != '"':
                    return "no", j  # (a backslash before a character JSON cannot escape)
                opened, self.string_from = self.string_from, -1
                i = self.pos = j + 1
                if self.expect == "colon" and len(stack) == 1 and self.first_keys is not None:  # the first key
                    try:
                        key = json.loads(text[opened:i])
                    except ValueError:
                        return "no", i
                    if key not in self.first_keys:
                        return "no", i
                    self.first_keys = None
                continue
            c = text[i]
            if c in " \t\r\n":
                i = self.pos = i + 1
                continue
            expect = self.expect
            if expect in ("value", "value_or_close"):
                if c == "]" and expect == "value_or_close":
                    stack.pop()
                    i += 1
                elif c in "{[":
                    stack.append(c)
                    self.expect = "key_or_close" if c == "{" else "value_or_close"
                    i = self.pos = i + 1
                    continue
                elif c == '"':
                    self.string_from, self.expect = i, "comma_or_close"
                    i = self.pos = i + 1
                    continue
                elif c in "-0123456789":
                    j = i
                    while j < n and text[j] in _NUMBER_CHARS:
                        j += 1
                    if j == n:
                        return "open", n  # (it may still grow: read again from its start)
                    i = j
                elif c in "tfn":
                    j = i
                    while j < n and text[j].isalpha():
                        j += 1
                    word = text[i:j]
                    if j == n and any(w.startswith(word) for w in ("true", "false", "null")):
                        return "open", n  # (likewise; "true" may still become "truex")
                    if word not in ("true", "false", "null"):
                        return "no", j
                    i = j
                else:
                    return "no", i
            elif expect in ("key", "key_or_close"):
                if c == "}" and expect == "key_or_close":
                    stack.pop()
                    i += 1
                elif c == '"':
                    self.string_from, self.expect = i, "colon"
                    i = self.pos = i + 1
                    continue
                else:
                    return "no", i
            elif expect == "colon":
                if c != ":":
                    return "no", i
                self.expect = "value"
                i = self.pos = i + 1
                continue
            else:  # comma_or_close
                if c == ",":
                    self.expect = "key" if stack[-1] == "{" else "value"
                    i = self.pos = i + 1
                    continue
                if c not in "}]" or _CLOSERS[c] != stack[-1]:
                    return "no", i
                stack.pop()
                i += 1
            # a value ended (a number, a word, a closed object or array)
            self.pos = i
            if not stack:
                return "closed", i
            self.expect = "comma_or_close"
        return "open", n


class Llama3JsonToolParser(_ScannedToolParser):
    opener = "{"
    marks_before = ("<|python_tag|>",)
    marks_after = ("<|eom_id|>", "<|eot_id|>")
    separators = ";"

    def _scanner(self, start: int) -> _JsonScan:
        return _JsonScan(start, CALL_FIRST_KEYS)

    def _decide(self, text: str, start: int, end: int) -> tuple[str, int, list[dict]]:
        try:
            obj, end = _JSON.raw_decode(text, start)  # (strict JSON: what the scanner let through may not be)
        except (ValueError, RecursionError):  # (JSONDecodeError is a ValueError)
            return "no", start, []
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not name:
            return "no", start, []
        args = _arguments_text(obj["arguments"] if "arguments" in obj else obj.get("parameters"))
        if args is None:
            return "no", start, []
        return "calls", end, [{"name": name, "arguments": args}]


# -- pythonic ---------------------------------------------------------------------------------------------------
class _CallListScan(_Scan):
    """Whether the "[" at `start` and what follows can still grow into a list of calls, read as the text grows (each
    advance goes on where the last stopped, inside a string too); the closed list is parsed after."""

    def __init__(self, start: int):
        self.pos = start + 1  # where the next advance reads: a token's start, or inside a string's body
        self.stack = ["["]
        self.expect = "name_or_end"  # between calls, directly in the list: name_or_end | paren | comma_or_end
        self.quote = ""  # the quote of the string pos is inside
        self.examined = 0  # characters looked at, over all advances (a name cut by the text's end counts again)


    def _walk(self, text: str) -> tuple[str, int]:
        stack = self.stack
        i, n = self.pos, len(text)
        while i < n:
            if self.quote:
                j = _PY_STRING_BODY[self.quote].match(text, i).end()  # to the closing quote, past escapes
                if j < n and text[j] == self.quote:
                    self.quote = ""
                    i = self.pos = j + 1
                    continue
                self.pos = j  # (the text ends in the string, or in a backslash: go on from here)
                return "open", n
            c = text[i]
            if len(stack) == 1:
                if c.isspace():
                    pass
                elif c == "]" and self.expect != "paren":
                    self.pos = i + 1
                    return "closed", i + 1
                elif self.expect == "name_or_end":
                    m = _IDENT.match(text, i)
                    if m is None:
                        return "no", i
                    if m.end() == n:
                        return "open", n  # (the name may still grow: read again from its start)
                    i, self.expect = m.end(), "paren"
                    self.pos = i
                    continue
                elif self.expect == "paren" and c == "(":
                    stack.append(c)
                elif self.expect == "comma_or_end" and c == ",":
                    self.expect = "name_or_end"
                else:
                    return "no", i
            elif c in "'\"":
                self.quote = c
            elif c in "([{":
                stack.append(c)
            elif c in ")]}":
                if stack[-1] != _CLOSERS[c]:
                    return "no", i
                stack.pop()
                if len(stack) == 1:
                    self.expect = "comma_or_end"
            i = self.pos = i + 1
        return "open", n


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

    def _scanner(self, start: int) -> _CallListScan:
        return _CallListScan(start)

    def _decide(self, text: str, start: int, end: int) -> tuple[str, int, list[dict]]:
        calls = _python_calls(text[start:end])
        return ("calls", end, calls) if calls else ("no", start, [])
