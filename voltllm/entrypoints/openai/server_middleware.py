"""Optional ASGI layers of the server: X-Request-Id response headers (--enable-request-id-headers), the in-flight
request count behind GET /load (--enable-server-load-tracking) and the header count bound (--h11-max-header-count).
Pure ASGI, so streamed bodies pass through as they are written and a request counts until its last byte is sent (or
its client leaves)."""
from __future__ import annotations

import uuid
from typing import Any, Optional

REQUEST_ID_HEADER = b"x-request-id"
GENERATED_ID_KEY = "voltllm.request_id"  # (ASGI scope) the id made for a request that sent no X-Request-Id
# the routes that run the model (vLLM's /load counts its generation and pooling routes)
LOAD_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                         "/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify",
                         "/pooling"})


def header(scope: dict, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def chosen_request_id(raw_request: Any, body_request_id: Optional[str] = None) -> Optional[str]:
    """vLLM's choice of a request's id: the X-Request-Id header, else the body's `request_id`; else the id
    RequestIdHeaderMiddleware put in the response header (so that the body's id carries it too); None: the server
    makes one."""
    headers = getattr(raw_request, "headers", None)
    given = headers.get("x-request-id") if headers is not None else None
    scope = getattr(raw_request, "scope", None) or {}
    return given or body_request_id or scope.get(GENERATED_ID_KEY) or None


def engine_request_id(response_id: str, chosen: bool) -> str:
    """The id the engine runs a request under: its response id, made unique when it was chosen outside the server
    (two requests may send the same X-Request-Id; the engine needs distinct ids)."""
    return f"{response_id}-{uuid.uuid4().hex[:8]}" if chosen else response_id


class RequestIdHeaderMiddleware:
    """Every response gets an X-Request-Id header: the request's own, else a new uuid4 hex (vLLM's behaviour). A
    chat or completion request that sent neither the header nor a body `request_id` then takes the new id as its
    own (`chatcmpl-<id>`), so that the header names the response."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = header(scope, REQUEST_ID_HEADER)
        if not rid:
            rid = uuid.uuid4().hex
            scope = dict(scope, **{GENERATED_ID_KEY: rid})
        value = rid.encode("latin-1")

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                message = dict(message, headers=[*headers, (REQUEST_ID_HEADER, value)])
            await send(message)

        await self.app(scope, receive, send_with_id)


class HeaderCountLimit:
    """--h11-max-header-count (vLLM's, default 256): a request with more header fields is answered 431 before any
    other layer (extra middleware included) sees it, a bound on header abuse; None: no bound."""

    def __init__(self, app: Any, max_count: int):
        self.app, self.max_count = app, max_count

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and len(scope.get("headers", ())) > self.max_count:
            from voltllm.entrypoints.openai.errors import OpenAIError, error_response

            why = f"the request has {len(scope['headers'])} header fields, more than this server's {self.max_count}"
            await error_response(OpenAIError(why, 431))(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ServerLoad:
    """The number of requests in flight on the model routes (vLLM's `server_load`, GET /load)."""

    def __init__(self) -> None:
        self.value = 0


class ServerLoadMiddleware:
    """Counts a POST to a model route from its arrival until its response has been sent in full or its client went
    away; route_path strips --root-path (app.route_path)."""

    def __init__(self, app: Any, load: ServerLoad, route_path: Any):
        self.app, self.load, self.route_path = app, load, route_path

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or self.route_path(scope) not in LOAD_ROUTES:
            await self.app(scope, receive, send)
            return
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1
