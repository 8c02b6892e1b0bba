"""tool_choice "required" or a named function -> a JSON-schema constraint on the output (structured outputs).

A named function: the output is that function's arguments, a JSON object following its `parameters` schema (none
or an empty one: any JSON object). "required": the output is a JSON array of one or more calls, each
{"name": <a tool's name>, "parameters": <that tool's arguments>} (an anyOf over the tools, each name a const);
`parallel_tool_calls: false` caps the array at one call. Neither needs a tool-call parser: the grammar fixes the
form, and forced_calls.py reads the calls back out of it. "auto" / "none" (or no tool_choice) give None here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.sampling.structured import StructuredOutputsError, StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}
_DEF_KEYS = ("$defs", "definitions")  # where a schema's "$ref": "#/$defs/X" (or "#/definitions/X") points


@dataclass(frozen=True)
class ForcedToolChoice:
    mode: str  # "named" or "required"
    name: Optional[str]  # the forced function ("named" only)
    schema: dict[str, Any]  # what the output must follow

    def params(self) -> StructuredOutputsParams:
        try:
            return StructuredOutputsParams(json=self.schema)
        except StructuredOutputsError as e:  # the schema came from the request's tools
            raise bad_request(f"tools: a function's parameters are not a usable JSON schema: {e}", "tools") from None


def _functions(tools: Optional[list]) -> dict[str, dict]:
    """name -> parameters schema of the request's tools, each of which must be a named function."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(fn, dict) or tool.get("type", "function") != "function"
                or not isinstance(fn.get("name"), str) or not fn["name"]):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                              '"parameters": {...}}}', "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if fn["name"] in out:
            raise bad_request(f"tools has two functions named {fn['name']!r}", "tools")
        out[fn["name"]] = params or _ANY_OBJECT
    return out


def _required_schema(functions: dict[str, dict], parallel: bool) -> dict[str, Any]:
    # the tools' own definitions move to the root, where their "#/$defs/..." references now point
    defs: dict[str, dict[str, Any]] = {}
    calls = []
    for name, params in functions.items():
        params = dict(params)
        for key in _DEF_KEYS:
            for def_name, definition in (params.pop(key, None) or {}).items():
                seen = defs.setdefault(key, {})
                if def_name in seen and seen[def_name] != definition:
                    raise bad_request(f"tools: two functions define {key}/{def_name} differently, which "
                                      "tool_choice 'required' cannot put into one schema", "tools")
                seen[def_name] = definition
        calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def forced_tool_choice(tools: Optional[list], tool_choice: Any, parallel_tool_calls: Optional[bool]
                       ) -> Optional[ForcedToolChoice]:
    """The constraint a forcing tool_choice puts on the output (None for "auto" / "none" / unset); 400s naming
    tool_choice or tools for what cannot be honoured."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        if not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return ForcedToolChoice("required", None, _required_schema(_functions(tools), parallel_tool_calls is not False))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(fn, dict) or tool_choice.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    if not tools:
        raise bad_request("tool_choice names a function but the request has no tools", "tool_choice")
    functions = _functions(tools)
    if fn["name"] not in functions:
        raise bad_request(f"tool_choice names function {fn['name']!r}, which is not among tools "
                          f"({', '.join(map(json.dumps, functions))})", "tool_choice")
    return ForcedToolChoice("named", fn["name"], functions[fn["name"]])
