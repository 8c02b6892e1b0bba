"""A structural tag (vLLM's `structural_tag`) -> the one JSON text it is compiled from and cached by.

Two forms arrive, as in vLLM: xgrammar's structural tag, `{"type": "structural_tag", "format": {...}}` (any of its
formats: triggered_tags, tag, sequence, json_schema, regex, ...), and the older `{"structures": [{"begin", "schema",
"end"}], "triggers": [...]}`, which is xgrammar's triggered_tags format written another way (free text until a
trigger; a structure's begin, JSON following its schema, its end; free text again). The older form is rewritten into
the newer here, as xgrammar itself rewrites it, so one compile path and one cache key serve both. No xgrammar here:
the grammar is built (and checked) by structured/grammar.py.
"""
from __future__ import annotations

import json
from typing import Any, Union

_LEGACY_KEYS = {"type", "structures", "triggers"}


def _legacy_as_format(tag: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(tag) - _LEGACY_KEYS)
    if unknown:
        raise ValueError(f"the older form takes structures and triggers only; got {', '.join(unknown)}")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"type must be \"structural_tag\", got {tag['type']!r}")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures must be a non-empty list of {\"begin\", \"schema\", \"end\"} objects")
    if not isinstance(triggers, list) or not triggers or any(not isinstance(t, str) or not t for t in triggers):
        raise ValueError("triggers must be a non-empty list of non-empty strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError(f"structures[{i}] needs a begin and an end string")
        if not isinstance(s.get("schema"), dict):
            raise ValueError(f"structures[{i}].schema must be a JSON schema object")
        extra = sorted(set(s) - {"begin", "schema", "end"})
        if extra:
            raise ValueError(f"structures[{i}] takes begin, schema and end only; got {', '.join(extra)}")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": s["schema"]}})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def structural_tag_text(value: Union[str, dict]) -> str:
    """The canonical JSON text of a structural tag given as JSON text or an object; ValueError saying what is wrong
    with its shape (what xgrammar finds wrong inside a format is reported when the grammar is built)."""
    tag: Any = value
    if isinstance(value, str):
        try:
            tag = json.loads(value)
        except ValueError as e:
            raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError("it must be a JSON object: {\"type\": \"structural_tag\", \"format\": {...}} or the older "
                         "{\"structures\": [...], \"triggers\": [...]}")
    if "structures" in tag or "triggers" in tag:
        if "format" in tag:
            raise ValueError("give either format or the older structures + triggers, not both")
        tag = _legacy_as_format(tag)
    elif "format" not in tag:
        raise ValueError("it needs a format ({\"type\": \"structural_tag\", \"format\": {...}}, xgrammar's structural "
                         "tag) or the older structures + triggers")
    return json.dumps(tag)
