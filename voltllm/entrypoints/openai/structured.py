"""A request's structured-output parameters -> one StructuredOutputsParams, or an OpenAI-style 400.

Sources: OpenAI's response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}; vLLM's {"type": "structural_tag", "format": {...}} and its older {"type": "structural_tag",
"structures": [...], "triggers": [...]}), vLLM's guided_json / guided_regex / guided_choice / guided_grammar and its
newer structured_outputs object (structural_tag there: the same, as JSON text). More than one constraint in a
request is refused, as is an invalid one (the grammar is built here, in the API process, so the engine only ever
sees constraints that compile; a structural tag's token formats excepted: structured/grammar.py).
"""
from __future__ import annotations

from typing import Any, Optional

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.sampling.structured import StructuredOutputsError, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_FORMAT_TYPES = "'text', 'json_object', 'json_schema' or 'structural_tag'"


def _from_response_format(rf: dict[str, Any]) -> Optional[dict[str, Any]]:
    if "type" not in rf:  # required by OpenAI's API (and vLLM's)
        raise bad_request(f"response_format needs a type: {_FORMAT_TYPES}", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request("response_format json_schema needs a json_schema object with a schema object "
                              "({\"name\": ..., \"schema\": {...}})", "response_format")
        return {"json": spec["schema"]}
    if kind == "structural_tag":  # the object is the tag, either form (StructuredOutputsParams checks it)
        return {"structural_tag": rf}
    raise bad_request(f"response_format type {kind!r} is not supported; use {_FORMAT_TYPES}", "response_format",
                      "unsupported_parameter")


def _from_structured(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    obj = dict(obj)
    # vLLM's options, at what voltllm does: xgrammar never falls back to another backend (disable_fallback either
    # way); whitespace in JSON is the server's setting (--structured-outputs-config disable_any_whitespace, the only
    # one vLLM's engine reads too), so a request's true is taken as the default's compact form and false refused
    fallback = obj.pop("disable_fallback", None)
    if fallback is not None and not isinstance(fallback, bool):
        raise bad_request("structured_outputs.disable_fallback must be true or false", "structured_outputs")
    if obj.pop("disable_any_whitespace", True) is not True:
        raise bad_request("structured_outputs.disable_any_whitespace false: whitespace between JSON tokens is set "
                          "for the server (--structured-outputs-config '{\"disable_any_whitespace\": false}'), not "
                          "per request", "structured_outputs", "unsupported_parameter")
    unknown = sorted(k for k, v in obj.items() if k not in _STRUCTURED_FIELDS and v is not None)
    if unknown:
        raise bad_request(f"structured_outputs has unsupported fields: {', '.join(unknown)} (supported: "
                          f"{', '.join(_STRUCTURED_FIELDS)})", "structured_outputs", "unsupported_parameter")
    return {k: v for k, v in obj.items() if v is not None and v is not False}


def structured_outputs_of(req: Any) -> Optional[StructuredOutputsParams]:
    """The request's constraint (None when it has none); raises a 400 naming the offending parameter."""
    found: list[tuple[str, dict[str, Any]]] = []  # (request parameter, StructuredOutputsParams fields)
    if req.response_format is not None:
        fields = _from_response_format(req.response_format)
        if fields:
            found.append(("response_format", fields))
    for param, field in _GUIDED.items():
        value = getattr(req, param)
        if value is not None:
            found.append((param, {field: value}))
    if req.structured_outputs is not None:
        fields = _from_structured(req.structured_outputs)
        for name, value in fields.items():  # each field is a constraint of its own
            found.append(("structured_outputs", {name: value}))
    if not found:
        return None
    if len(found) > 1:
        names = [p if p != "structured_outputs" else f"structured_outputs.{next(iter(f))}" for p, f in found]
        raise bad_request(f"a request takes one structured-output constraint; got {', '.join(names)}", found[1][0])
    param, fields = found[0]
    try:
        return StructuredOutputsParams(**fields)
    except StructuredOutputsError as e:
        raise bad_request(f"{param}: {e}", param) from None
