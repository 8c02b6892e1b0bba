"""Reads one hermes tool call's JSON object ({"name": ..., "arguments": {...}}) as it is written, for streaming.

HermesCallReader goes through the body of a <tool_call> block token by token, carrying its state from one call of
read() to the next (a stream's text only grows, so each character is looked at about once). It keeps:
- the call's name, once the top-level "name" string is complete (the first such key);
- the arguments (the value of the first top-level "arguments" or "parameters" key) re-serialized as
  json.dumps(value, ensure_ascii=False) writes them, growing as the value is written. Only text that no later
  token can change is written: a number or a literal waits until it ends, a string's escape until it is complete
  (a high surrogate until the next escape shows whether it pairs), so what has been given out is always a prefix of
  the final arguments. An arguments value that is a string gives its decoded text (the string is the arguments).
- where it stopped: after the top-level object closes, or at the first character that is not JSON (a
  "</tool_call>" outside any string, a missing brace, ...). A "</tool_call>" inside a string is string content.

The JSON is read as json.loads(strict=False) reads it (NaN / Infinity taken, raw control characters in strings
taken and written escaped); two differences no client can see through json.loads: a key written twice in the
arguments stays twice, in its order, and the first "name" / "arguments" key is the one that counts, since a
stream may already have sent it.
"""
from __future__ import annotations

import json
import re
from typing import Optional

_WS = re.compile(r"[ \t\n\r]*")
_STR_RUN = re.compile(r'[^"\\]+')
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
ARGUMENT_KEYS = ("arguments", "parameters")

# string roles: what a string's decoded text is for
_KEY, _NAME, _SKIP, _ESCAPED, _RAW = "key", "name", "skip", "escaped", "raw"


class _Pending(Exception):
    """The token at the end of the text is not complete yet."""


class _NotJson(Exception):
    """The text stops being JSON here."""


class HermesCallReader:
    def __init__(self) -> None:
        self.pos = 0  # next body character to read
        self.stack: list[list[str]] = []  # open containers: [bracket, state]
        self.state = "start"  # "start", "open", "closed" (the top object ended) or "error" (not JSON from pos on)
        self.key: Optional[str] = None  # the top-level key whose value comes next
        self.name: Optional[str] = None
        self.args: list[str] = []  # the arguments so far, re-serialized, in pieces
        self._joined, self._pieces_joined = "", 0  # "".join(self.args[:_pieces_joined]), kept between reads
        self.args_state = "none"  # "none" (not begun), "reading", "done"
        self.args_mark = 0  # body offset up to which self.args accounts for the text (while "reading")
        self._string: Optional[dict] = None  # the open string: role, decoded text kept (keys, the name)

    @property
    def stopped(self) -> bool:
        return self.state in ("closed", "error")

    def arguments(self) -> str:
        if self._pieces_joined < len(self.args):  # (join only the new pieces: a stream asks after every token)
            self._joined += "".join(self.args[self._pieces_joined:])
            self._pieces_joined = len(self.args)
        return self._joined

    def read(self, text: str, base: int) -> None:
        """Read on in text[base + self.pos:] (text[base:] is the block's body, and only grows between calls)."""
        i = base + self.pos
        try:
            while not self.stopped:
                if self._string is not None:
                    i = self._read_string(text, i, base)
                    continue
                i = _WS.match(text, i).end()
                if i >= len(text):
                    break
                i = self._read_token(text, i)
                self.pos = i - base
                if self.args_state == "reading":
                    self.args_mark = self.pos
        except _Pending:
            pass
        except _NotJson:
            self.state = "error"

    # --- structure -------------------------------------------------------------------------------------------

    def _read_token(self, text: str, i: int) -> int:
        c = text[i]
        if self.state == "start":
            if c != "{":
                raise _NotJson
            self.state = "open"
            self.stack.append(["{", "key_or_end"])
            return i + 1
        frame = self.stack[-1]
        bracket, where = frame
        if where == "key_or_end" and c == "}" or where == "value_or_end" and c == "]":
            return self._close(i)
        if where in ("key_or_end", "key"):
            if c != '"':
                raise _NotJson
            frame[1] = "colon"
            inside = self.args_state == "reading"
            top = len(self.stack) == 1
            return self._open_string(i, _ESCAPED if inside else (_KEY if top else _SKIP), is_key=True)
        if where == "colon":
            if c != ":":
                raise _NotJson
            frame[1] = "value"
            self._emit(": ")
            return i + 1
        if where == "comma_or_end":
            if c == ",":
                frame[1] = "key" if bracket == "{" else "value"
                self._emit(", ")
                return i + 1
            if c == ("}" if bracket == "{" else "]"):
                return self._close(i)
            raise _NotJson
        return self._read_value(text, i)  # "value", "value_or_end"

    def _read_value(self, text: str, i: int) -> int:
        if len(self.stack) == 1 and self.args_state == "none" and self.key in ARGUMENT_KEYS:
            self.args_state, self.args_mark = "reading", self.pos
        c = text[i]
        if c in "{[":
            self.stack[-1][1] = "comma_or_end"
            self._emit(c)
            self.stack.append([c, "key_or_end" if c == "{" else "value_or_end"])
            return i + 1
        if c == '"':
            if self.args_state == "reading":
                role = _RAW if len(self.stack) == 1 else _ESCAPED
            else:
                role = _NAME if len(self.stack) == 1 and self.key == "name" and self.name is None else _SKIP
            self.stack[-1][1] = "comma_or_end"
            return self._open_string(i, role)
        end, value = self._scalar(text, i)
        self._emit(json.dumps(value))
        self._value_done()
        return end

    def _scalar(self, text: str, i: int) -> tuple[int, object]:
        """A number or literal at text[i]: (its end, its value); _Pending while more text could still extend it."""
        for literal in _LITERALS:
            if text.startswith(literal, i):
                return i + len(literal), json.loads(literal)
            if literal.startswith(text[i:i + len(literal)]) and i + len(literal) > len(text):
                raise _Pending
        m = _NUMBER_CHARS.match(text, i)
        if not m:
            raise _NotJson
        if m.end() == len(text):
            raise _Pending  # (more digits may follow)
        token = m.group(0)
        if not _NUMBER.fullmatch(token):
            raise _NotJson
        try:
            return m.end(), json.loads(token)
        except ValueError:  # (an integer longer than Python's digit limit)
            raise _NotJson from None

    def _close(self, i: int) -> int:
        bracket, _ = self.stack.pop()
        self._emit("}" if bracket == "{" else "]")
        if not self.stack:
            self.state = "closed"
        else:
            self._value_done()
        return i + 1

    def _value_done(self) -> None:
        self.stack[-1][1] = "comma_or_end"
        if len(self.stack) == 1 and self.args_state == "reading":
            self.args_state = "done"

    def _emit(self, piece: str) -> None:
        if self.args_state == "reading":
            self.args.append(piece)

    # --- strings ---------------------------------------------------------------------------------------------

    def _open_string(self, i: int, role: str, is_key: bool = False) -> int:
        self._string = {"role": role, "text": [], "key": is_key}
        if role == _ESCAPED:
            self.args.append('"')
        return i + 1

    def _read_string(self, text: str, i: int, base: int) -> int:
        """Read on in the open string: one run of plain characters, one escape or the closing quote."""
        s = self._string
        if i >= len(text):
            raise _Pending
        c = text[i]
        if c == '"':
            self._string = None
            if s["role"] == _ESCAPED:
                self.args.append('"')
            elif s["role"] == _KEY:
                self.key = "".join(s["text"])
            elif s["role"] == _NAME:
                self.name = "".join(s["text"])
            if not s["key"]:
                self._value_done()
            end = i + 1
        elif c == "\\":
            end, decoded = self._escape(text, i)
            self._string_text(s, decoded)
        else:
            end = _STR_RUN.match(text, i).end()
            self._string_text(s, text[i:end])
        self.pos = end - base
        if self.args_state == "reading":
            self.args_mark = self.pos
        return end

    def _string_text(self, s: dict, decoded: str) -> None:
        if s["role"] == _ESCAPED:
            self.args.append(json.dumps(decoded, ensure_ascii=False)[1:-1])
        elif s["role"] == _RAW:
            self.args.append(decoded)
        elif s["role"] != _SKIP:
            s["text"].append(decoded)

    @staticmethod
    def _escape(text: str, i: int) -> tuple[int, str]:
        """The escape at text[i] ("\\"): (its end, the character); a high surrogate pairs with a low one after it,
        as json.loads pairs them."""
        if i + 1 >= len(text):
            raise _Pending
        kind = text[i + 1]
        if kind in _ESCAPES:
            return i + 2, _ESCAPES[kind]
        if kind != "u":
            raise _NotJson
        code = _hex4(text, i + 2)
        end = i + 6
        if 0xD800 <= code <= 0xDBFF:
            follow = text[end:end + 2]
            if follow == "\\u":
                low = _hex4(text, end + 2)
                if 0xDC00 <= low <= 0xDFFF:
                    return end + 6, chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))
            elif "\\u".startswith(follow):  # ("" or "\\": the next escape may still be its low half)
                raise _Pending
        return end, chr(code)


def _hex4(text: str, i: int) -> int:
    if not _HEX4.match(text, i):
        if i + 4 > len(text) and _HEX4.match(text[i:] + "0000"):
            raise _Pending
        raise _NotJson
    return int(text[i:i + 4], 16)
