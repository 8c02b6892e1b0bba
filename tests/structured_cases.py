"""Constraints whose every completion ends within a few dozen tokens (a random-weight model follows the mask
anywhere it allows), and checks of an output against them, for the structured-output tests."""
from __future__ import annotations

import json
import re

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "n", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]
# a grammar in xgrammar's EBNF
GRAMMAR = 'root ::= "(" item (", " item)? ")"\nitem ::= [0-9] | "x"'
GRAMMAR_RE = r"\((?:[0-9]|x)(?:, (?:[0-9]|x))?\)"
LONG_REGEX = r"[a-z ]{30,40}\."  # long enough to be preempted mid-way


def check_schema_output(text: str) -> dict:
    """Parse `text` and check it against SCHEMA by hand (no jsonschema dependency)."""
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) == {"name", "ok", "n", "tags"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6, obj
    assert isinstance(obj["ok"], bool), obj
    assert isinstance(obj["n"], int) and not isinstance(obj["n"], bool) and 0 <= obj["n"] <= 99, obj
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and all(t in "abc" for t in obj["tags"]), obj
    return obj


def check_regex_output(text: str, pattern: str = REGEX) -> None:
    assert re.fullmatch(pattern, text), repr(text)


def check_json_object_output(text: str) -> None:
    assert isinstance(json.loads(text), dict), repr(text)
