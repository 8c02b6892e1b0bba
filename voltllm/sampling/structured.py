"""StructuredOutputsParams: the one output constraint a request may carry (vLLM's field names).

Exactly one of json (a JSON schema), regex, choice, grammar (EBNF as xgrammar reads it), json_object or
structural_tag (free text with constrained parts after triggers: structured/structural_tag.py). The
constraint is checked when the params are made, by building its grammar (voltllm/structured/grammar.py, cached),
so a bad schema fails there rather than in the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from voltllm.sampling.params import SamplingParamsError


class StructuredOutputsError(SamplingParamsError):
    """An invalid constraint; `field` names the StructuredOutputsParams field it came from."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class StructuredOutputsParams:
    json: Optional[Union[str, dict]] = None  # a JSON schema, as an object or its JSON text
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None  # any JSON object
    structural_tag: Optional[Union[str, dict]] = None  # xgrammar's structural tag or vLLM's older form (or JSON text)

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                given[1] if given else "json",
                "structured outputs take exactly one of json, regex, choice, grammar, json_object, structural_tag"
                + (f"; got {', '.join(given)}" if given else ""))
        self._check_types()
        from voltllm.structured.grammar import grammar_for

        grammar_for(self.key)  # raises StructuredOutputsError naming the field

    def _check_types(self) -> None:
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise StructuredOutputsError("json", f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise StructuredOutputsError("json", "the JSON schema must be a JSON object")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise StructuredOutputsError("regex", "regex must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice or
                                        any(not isinstance(c, str) or not c for c in self.choice)):
            raise StructuredOutputsError("choice", "choice must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise StructuredOutputsError("grammar", "grammar must be a non-empty EBNF string")
        if self.json_object not in (None, True, False):
            raise StructuredOutputsError("json_object", "json_object must be a boolean")
        if self.structural_tag is not None:
            self._structural_tag_text()  # its shape (what is inside its formats: when the grammar is built)

    def _structural_tag_text(self) -> str:
        from voltllm.structured.structural_tag import structural_tag_text

        if not isinstance(self.structural_tag, (str, dict)):
            raise StructuredOutputsError("structural_tag",
                                         "invalid structural tag: it must be a JSON object or its JSON text")
        try:
            return structural_tag_text(self.structural_tag)
        except ValueError as e:
            raise StructuredOutputsError("structural_tag", f"invalid structural tag: {e}") from None

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar is built from, and the key compiled grammars are cached by. A schema keeps
        its key order (it sets the order of the output's properties)."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            text = value if isinstance(value, str) else json.dumps(value)
            return kind, json.dumps(json.loads(text))  # one text per schema, however it was spaced
        if kind == "choice":
            return kind, json.dumps(list(value))
        if kind == "json_object":
            return kind, ""
        if kind == "structural_tag":  # (the older form rewritten into xgrammar's: one key for both)
            return kind, self._structural_tag_text()
        return kind, value
