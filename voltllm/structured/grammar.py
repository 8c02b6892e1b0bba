"""A constraint's key -> xgrammar Grammar (tokenizer-free, so the API process can check a request with it).

JSON is constrained to xgrammar's compact form by default (no free whitespace between tokens: `{"a": 1, "b": [2]}`):
output that is still valid JSON, and a model cannot spend its tokens on endless whitespace inside an object. With
any_whitespace (--structured-outputs-config disable_any_whitespace false, vLLM's default) JSON grammars take any
whitespace between tokens, as vLLM's; the setting is part of the cache key. A structural tag's JSON formats are
xgrammar's own (whitespace as its format says: `max_whitespace_cnt`), as in vLLM.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Optional

import xgrammar as xgr

from voltllm.sampling.structured import StructuredOutputsError

# xgrammar's errors start with "[time] /path/file.cc:line: "; the rest is the message a user can act on
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# then, from a compile, the check that failed ("Check failed: (...) is false: "); then its structural-tag errors'
# class, which our message says already ("invalid structural tag: ...")
_ERROR_KIND = re.compile(r"^(Check failed: \(.*?\) is false: )?(Invalid (structural tag|JSON) error: )?")


# xgrammar 0.2.8 writes the characters of a string with minLength / maxLength as this class, which lets control
# characters (U+0000-U+001F) through unescaped: output a JSON parser refuses. Its other strings exclude them.
_LOOSE_STRING_CHARS = r'[^\"\\\r\n]'
_STRICT_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'


def _json_grammar(schema_text: str, any_whitespace: bool) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace, strict_mode=True)
    text = str(grammar)
    if _LOOSE_STRING_CHARS in text:  # the same grammar with control characters out of those strings
        try:
            grammar = xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHARS, _STRICT_STRING_CHARS))
        except RuntimeError:  # (a printed form xgrammar cannot read back, e.g. one with a pattern: keep it)
            pass
    return grammar


def _choice_grammar(choices_text: str) -> xgr.Grammar:
    # each choice as an EBNF string literal: xgrammar reads JSON's escapes in them
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(choices_text)))


def _structural_tag_grammar(text: str) -> Optional[xgr.Grammar]:
    try:
        return xgr.Grammar.from_structural_tag(text)
    except RuntimeError as e:
        # a token format named by its text ({"type": "token", "token": "<|im_end|>"}) needs the vocabulary: only the
        # engine's compile (GrammarCompiler.compile_structural_tag) can resolve it, and report what is wrong there
        if "requires tokenizer_info" in str(e):
            return None
        raise


# (text, any_whitespace) -> grammar; whitespace applies to the JSON kinds only, as in vLLM
_BUILDERS = {
    "json": _json_grammar,
    "json_object": lambda _, any_whitespace: _json_grammar('{"type": "object"}', any_whitespace),
    "regex": lambda text, _: xgr.Grammar.from_regex(text),
    "choice": lambda text, _: _choice_grammar(text),
    "grammar": lambda text, _: xgr.Grammar.from_ebnf(text),
    "structural_tag": lambda text, _: _structural_tag_grammar(text),
}


def xgrammar_message(e: Exception) -> str:
    """An xgrammar error's first line without its log prefix: the part a user can act on."""
    return _ERROR_KIND.sub("", _LOG_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else
                                               type(e).__name__))


def grammar_for(key: tuple[str, str], any_whitespace: bool = False) -> Optional[xgr.Grammar]:
    """The grammar of a StructuredOutputsParams.key (JSON with free whitespace between tokens when any_whitespace,
    else compact; cached by both); StructuredOutputsError naming the field when it is invalid. None only for a
    structural tag that names tokens by their text (it is built against the vocabulary, in the engine:
    GrammarMatchers)."""
    return _cached_grammar(key, any_whitespace)  # (one cache entry however the setting was passed)


@lru_cache(maxsize=256)
def _cached_grammar(key: tuple[str, str], any_whitespace: bool) -> Optional[xgr.Grammar]:
    kind, text = key
    try:
        return _BUILDERS[kind](text, any_whitespace)
    except (RuntimeError, ValueError, TypeError) as e:
        message = xgrammar_message(e)
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
                "grammar": "grammar", "structural_tag": "structural tag"}[kind]
        raise StructuredOutputsError(kind, f"invalid {what}: {message}") from None
