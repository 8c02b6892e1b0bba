"""OpenAI-style errors: every failure answers {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from http import HTTPStatus
from typing import Any, Optional

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """Raised anywhere in request handling; the app turns it into its JSON error body."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")


def error_body(message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None,
               type_: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(err: OpenAIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(error_body(err.message, err.status, err.param, err.code, err.type),
                        status_code=err.status, headers=headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> OpenAIError:
    return OpenAIError(message, 400, param, code)


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
