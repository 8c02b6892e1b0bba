"""Where a Messages request's `role: "system"` messages go, as vLLM places them (Claude Code >= 2.1.154 sends them
inside `messages`, e.g. a fresh note after every tool result).

System messages that open `messages` join the top-level `system` text (a blank line between). Later ones are never
hoisted there: a new one each turn would change the head of the prompt and defeat prefix caching. They are either
kept in place as system turns ("preserve": the chat template renders a system turn anywhere, and the request has
system text) or folded into a neighbouring message ("fold"): appended to the user turn they follow (its own text,
else its last tool result), else put in front of the next user turn, else made a user turn of their own. Folding
never adds a user turn after tool results nor puts anything between an assistant's tool_use and its results: a
system message found there first moves after the results. Which mode a server uses is probed from its template
(messages_system_probe.py). Claude Code's `x-anthropic-billing-header` text (a per-request hash that would defeat
prefix caching) is dropped from system text, as vLLM does.
"""
from __future__ import annotations

from typing import Any, Optional

from voltllm.entrypoints.openai.errors import bad_request

BILLING_HEADER = "x-anthropic-billing-header"


def system_text(content: Any, where: str) -> str:
    """The text of a system prompt or system message (a string or text blocks, joined by newlines), without the
    billing header."""
    if isinstance(content, str):
        return "" if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", "messages")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{j}] must be a text block {{\"type\": \"text\", \"text\": ...}}",
                              "messages")
        if not block["text"].startswith(BILLING_HEADER):
            texts.append(block["text"])
    return "\n".join(texts)


def _join(*texts: str) -> str:
    return "\n\n".join(t for t in texts if t)


def _add_text(content: Any, text: str, at_end: bool) -> Any:
    """`text` joined onto the text at one end of a string or block-list content (merged into a text block there,
    as some templates glue blocks together without a separator)."""
    if content is None or isinstance(content, str):
        return _join(content or "", text) if at_end else _join(text, content or "")
    if not isinstance(content, list):
        return content  # malformed: the translation refuses it
    items = list(content)
    end = -1 if at_end else 0
    if items and isinstance(items[end], dict) and items[end].get("type") == "text":
        old = items[end].get("text") or ""
        items[end] = {**items[end], "text": _join(old, text) if at_end else _join(text, old)}
    else:
        items.insert(len(items) if at_end else 0, {"type": "text", "text": text})
    return items


def _is_result(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "tool_result"


def _append_to_user(message: dict, text: str) -> dict:
    """The user turn with `text` after its own text, or after its last tool result when it has nothing else (so
    no user turn follows the results)."""
    content = message.get("content")
    if isinstance(content, list) and content and all(_is_result(b) for b in content):
        last = content[-1]
        return {**message, "content": [*content[:-1], {**last, "content": _add_text(last.get("content"), text,
                                                                                       at_end=True)}]}
    if isinstance(content, list):  # results go first in translation anyway
        own = _add_text([b for b in content if not _is_result(b)], text, at_end=True)
        return {**message, "content": [b for b in content if _is_result(b)] + own}
    return {**message, "content": _add_text(content, text, at_end=True)}


def _calls_tools(message: dict) -> bool:
    content = message.get("content")
    return (message.get("role") == "assistant" and isinstance(content, list)
            and any(isinstance(b, dict) and b.get("type") == "tool_use" for b in content))


Placed = list[tuple[Optional[int], dict]]  # (index in the request's messages, None for a turn made here; message)


def _move_out_of_tool_runs(messages: Placed) -> Placed:
    """System messages between an assistant's tool_use and the user turn with its results go after that turn."""
    out: Placed = []
    held: Placed = []
    awaiting = False
    for item in messages:
        role = item[1].get("role")
        if role == "system":
            (held if awaiting else out).append(item)
            continue
        if role == "assistant":
            out.extend(held)
            held.clear()
        out.append(item)
        if role == "user":
            out.extend(held)
            held.clear()
        awaiting = _calls_tools(item[1])
    return out + held


def _fold(messages: Placed) -> Placed:
    out: Placed = []
    pending: list[str] = []  # system text after an assistant turn, for the next user turn
    for i, m in messages:
        if m["role"] == "system":
            if out and out[-1][1]["role"] == "user" and not pending:
                out[-1] = (out[-1][0], _append_to_user(out[-1][1], m["content"]))
            else:
                pending.append(m["content"])
            continue
        if pending:
            if m["role"] == "user":
                m = {**m, "content": _add_text(m.get("content"), _join(*pending), at_end=False)}
            else:
                out.append((None, {"role": "user", "content": _join(*pending)}))
            pending.clear()
        out.append((i, m))
    if pending:
        out.append((None, {"role": "user", "content": _join(*pending)}))
    return out


def place_inline_system(messages: list[dict], system_prompt: str, mode: str) -> tuple[str, Placed]:
    """(text to append to the system prompt, the messages left, each with its index in `messages`). In "preserve"
    mode the later system messages stay, as {"role": "system", "content": text}; in "fold" mode they are merged
    into their neighbours. "preserve" folds too when the request has no system text at all, as vLLM does (some
    templates put the tools at the first system turn, wherever it is). System messages with no text (a billing
    header only) are dropped."""
    flat: Placed = [(i, {"role": "system", "content": system_text(m.get("content"), f"messages[{i}].content")}
                     if m.get("role") == "system" else m) for i, m in enumerate(messages)]
    lead = 0
    while lead < len(flat) and flat[lead][1]["role"] == "system":
        lead += 1
    leading = _join(*(m["content"] for _, m in flat[:lead]))
    rest = [(i, m) for i, m in _move_out_of_tool_runs(flat[lead:]) if m["role"] != "system" or m["content"]]
    if mode == "preserve" and (system_prompt or leading):
        return leading, rest
    return leading, _fold(rest)


def has_inline_system(messages: list[dict]) -> bool:
    """Whether a system message comes after another message (only those need a placement mode)."""
    roles = [m.get("role") for m in messages]
    first_other = next((k for k, r in enumerate(roles) if r != "system"), len(roles))
    return "system" in roles[first_other:]
