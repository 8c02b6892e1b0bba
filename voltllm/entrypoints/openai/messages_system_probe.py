"""Whether this server's chat template can keep a Messages request's later system messages in place ("preserve")
or they must be folded into neighbouring turns ("fold"): vLLM's "auto" placement, decided once per server by
rendering small conversations with and without a system message inserted (messages_inline_system.py places them).

A template passes when, for a system message in the middle, after a tool result and at the end, it renders the
message (no error, its text there), renders only that message anew (the prompt is the old one with one segment
inserted, so the turns before it stay prefix-cached), puts it before the generation prompt, marks it with a special
token of its own (a role marker) and renders it unlike a user message. (vLLM also checks that the reasoning kept in
history does not change; voltllm sends no reasoning in history, so there is nothing to check.)
"""
from __future__ import annotations

import json
import logging
import weakref
from typing import Any, Optional

from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.serving_common import ServerState, render_chat

logger = logging.getLogger(__name__)

_NOTE = "Kilo inserted note"
_TOOLS = [{"type": "function", "function": {"name": "probe_tool", "description": "A probe.",
                                             "parameters": {"type": "object", "properties": {}}}}]
_HEAD = [{"role": "system", "content": "Lima standing rules"}, {"role": "user", "content": "Mike opening ask"}]
_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "probecall1", "type": "function", "function": {"name": "probe_tool", "arguments": {}}}]}
# (name, conversation, where the system message goes)
_CASES: tuple[tuple[str, list[dict], int], ...] = (
    ("mid", [*_HEAD, {"role": "assistant", "content": "November reply"},
             {"role": "user", "content": "Oscar next ask"}], 3),
    ("after_tool", [*_HEAD, _CALL, {"role": "tool", "tool_call_id": "probecall1", "content": "Papa output"}], 4),
    ("trailing", list(_HEAD), 2),
)

_modes: dict[int, tuple[Any, str]] = {}  # id(state) -> (a weak reference to it, its mode)


def inline_system_mode(state: ServerState) -> str:
    """"preserve" or "fold" for this server (probed on first use, then kept)."""
    known = _modes.get(id(state))
    if known is not None and known[0]() is state:
        return known[1]
    try:
        mode, reason = probe(state)
    except Exception:  # a probe that cannot run must not fail requests: fold, which every template takes
        logger.warning("the inline system-message probe failed; folding them into user turns", exc_info=True)
        mode, reason = "fold", "the probe failed"
    logger.info("Messages API: system messages inside `messages` will be %s (%s)",
                "kept in place" if mode == "preserve" else "folded into neighbouring turns", reason)
    _modes[id(state)] = (weakref.ref(state), mode)
    return mode


def _render(state: ServerState, messages: list[dict]) -> Optional[list[int]]:
    try:
        text = render_chat(state, state.template_messages(messages, None, _TOOLS), chat_template=None, kwargs=None,
                           add_generation_prompt=True, continue_final_message=False, tools=_TOOLS)
    except OpenAIError:
        return None
    return list(state.tokenizer.encode(text, add_special_tokens=False))


def _insertion(base: list[int], new: list[int]) -> Optional[tuple[int, list[int]]]:
    """(p, segment) when new == base[:p] + segment + base[p:], else None."""
    p = 0
    while p < min(len(base), len(new)) and base[p] == new[p]:
        p += 1
    s = 0
    while s < min(len(base), len(new)) - p and base[-1 - s] == new[-1 - s]:
        s += 1
    return (p, new[p:len(new) - s]) if p + s == len(base) else None


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "get_added_vocab", None)
    return ids | set((added() if callable(added) else {}).values())


def _insert(messages: list[dict], index: int, message: dict) -> list[dict]:
    return json.loads(json.dumps(messages[:index] + [message] + messages[index:]))  # a fresh copy per render


def _check(state: ServerState, name: str, messages: list[dict], index: int) -> Optional[str]:
    """Why a system message at `index` cannot stay in place, or None."""
    base = _render(state, messages)
    if base is None:
        return f"{name}: the template fails without it"
    new = _render(state, _insert(messages, index, {"role": "system", "content": _NOTE}))
    if new is None:
        return f"{name}: the template refuses it"
    decode = state.tokenizer.decode
    if _NOTE not in decode(new):
        return f"{name}: the template drops it"
    found = _insertion(base, new)
    if found is None:
        return f"{name}: rendering it changes other parts of the prompt"
    position, segment = found
    if index == len(messages) and position >= len(base):
        return f"{name}: it lands after the generation prompt"
    if decode(segment).count(_NOTE) != 1:
        return f"{name}: it is not rendered as a segment of its own"
    if not _special_ids(state.tokenizer) & set(segment):
        return f"{name}: it has no role marker"
    if name == "mid":
        as_user = _render(state, _insert(messages, index, {"role": "user", "content": _NOTE}))
        user_found = None if as_user is None else _insertion(base, as_user)
        if user_found is not None and user_found[1] == segment:
            return f"{name}: it renders the same as a user message"
    return None


def probe(state: ServerState) -> tuple[str, str]:
    """(mode, the reason)."""
    for name, messages, index in _CASES:
        reason = _check(state, name, messages, index)
        if reason is not None:
            return "fold", reason
    return "preserve", "the template renders them as system turns of their own"
