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


# structural tags: free text, except that a trigger ("<") starts a tag: "<f>", JSON of TAG_SCHEMA, "</f>". Whitespace
# inside is xgrammar's (as in vLLM): at most one in a row, or a random model writes whitespace for ever.
TAG_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
TAG = {"begin": "<f>", "content": {"type": "json_schema", "json_schema": TAG_SCHEMA, "max_whitespace_cnt": 1},
       "end": "</f>"}


def structural_tag(**options) -> dict:
    """xgrammar's structural tag (vLLM's newer form) with TAG after the trigger "<" (options: at_least_one, ...)."""
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], "tags": [TAG],
                                                 **options}}


# vLLM's older form: the same tag, JSON with free whitespace
LEGACY_TAG = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": TAG_SCHEMA, "end": "</f>"}],
              "triggers": ["<"]}


def check_tagged_output(text: str, complete: bool = True) -> list[dict]:
    """Free text with tags: every "<" begins "<f>" + JSON of TAG_SCHEMA + "</f>" (the last may be cut off unless
    `complete`); returns the tags' objects."""
    pieces = text.split("<")
    objects = []
    for i, piece in enumerate(pieces[1:], 1):
        if piece.startswith("/f>"):  # the end of the tag before: free text after it
            continue
        if not complete and i == len(pieces) - 1 and "</f>" not in "<" + piece:
            assert ("<" + piece).startswith("<f>") or "<f>".startswith("<" + piece), repr(text)
            continue
        assert piece.startswith("f>") and i + 1 < len(pieces) and pieces[i + 1].startswith("/f>"), repr(text)
        obj = json.loads(piece[2:])
        assert set(obj) == {"n", "ok"} and 0 <= obj["n"] <= 99 and isinstance(obj["ok"], bool), obj
        objects.append(obj)
    return objects
