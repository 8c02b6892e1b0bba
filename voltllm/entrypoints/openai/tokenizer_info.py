"""GET /tokenizer_info (vLLM's, with --enable-tokenizer-info-endpoint): the tokenizer's configuration as its
tokenizer_config.json holds it, with its class and the chat template the server applies, so that a router or client
can tokenize as the server does."""
from __future__ import annotations

from typing import Any, Optional


def tokenizer_info_of(tokenizer: Any, chat_template: Optional[str]) -> dict:
    """The tokenizer's init settings made JSON (special tokens as their text; values JSON cannot hold left out), plus
    `tokenizer_class` and `chat_template` (the server's --chat-template, else the tokenizer's own)."""
    info = {key: value for key, value in ((k, _json_value(v)) for k, v in
                                          dict(getattr(tokenizer, "init_kwargs", None) or {}).items())
            if value is not _UNSERIALIZABLE}
    info["tokenizer_class"] = type(tokenizer).__name__
    info["chat_template"] = chat_template or getattr(tokenizer, "chat_template", None)
    return info


_UNSERIALIZABLE = object()


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "content") and isinstance(getattr(value, "content"), str):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, (list, tuple)):
        items = [_json_value(v) for v in value]
        return _UNSERIALIZABLE if any(v is _UNSERIALIZABLE for v in items) else items
    if isinstance(value, dict):
        items = {str(k): _json_value(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _UNSERIALIZABLE}
    return _UNSERIALIZABLE
