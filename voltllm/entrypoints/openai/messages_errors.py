"""Anthropic-style errors for /v1/messages*: {"type": "error", "error": {"type", "message"}}.

The handlers raise the server's OpenAIError as everywhere else; on these routes the app shapes it this way (the
HTTP status stays, the error type follows Anthropic's list for that status)."""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from voltllm.entrypoints.openai.errors import OpenAIError

MESSAGES_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    """/v1/messages or below it (also behind a --root-path prefix)."""
    return path.endswith("/v1/messages") or "/v1/messages/" in path


def anthropic_error_body(message: str, status: int) -> dict:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(err: OpenAIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(anthropic_error_body(err.message, err.status), status_code=err.status, headers=headers)


def anthropic_sse_error(err: OpenAIError) -> str:
    """The in-band error event of a stream that has already started."""
    body = json.dumps(anthropic_error_body(err.message, err.status), ensure_ascii=False, separators=(",", ":"))
    return f"event: error\ndata: {body}\n\n"
