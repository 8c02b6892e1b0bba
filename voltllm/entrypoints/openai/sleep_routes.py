"""vLLM's sleep-mode routes: POST /sleep?level=1|2, POST /wake_up[?tags=weights&tags=kv_cache], GET /is_sleeping.

They exist when the server runs with --enable-sleep-mode (vLLM serves them in its dev mode); without it each answers
404 saying so. While the engine sleeps, generation and pooling requests get 503 (AsyncLLM.EngineSleepingError); a
sleep aborts the requests in flight (their clients get 503 request_aborted), as vLLM's default "abort" mode does.
"""
from __future__ import annotations

from typing import Any, Optional

from fastapi import Request
from fastapi.responses import Response

from voltllm.entrypoints.openai.errors import OpenAIError, bad_request

_OFF = "sleep mode is off: start the server with --enable-sleep-mode"


def _level(request: Request) -> int:
    raw = request.query_params.get("level", "1")
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f"level must be 1 or 2, got {raw!r}", "level") from None


async def call_engine(coro: Any, param: Optional[str]) -> Response:
    """200 once the engine's call is done; its ValueError is a 400 naming `param`, RuntimeError a 500, a dead engine
    a 503 (the sleep-mode and profiling routes)."""
    from voltllm.engine.async_llm import EngineDeadError

    try:
        await coro
    except ValueError as e:
        raise bad_request(str(e), param) from None
    except EngineDeadError as e:
        raise OpenAIError(f"the engine is not available: {e}", 503) from None
    except RuntimeError as e:  # (e.g. too little GPU memory left to wake up: the engine stays asleep)
        raise OpenAIError(str(e), 500) from None
    return Response(status_code=200)


def add_sleep_routes(app: Any, state: Any, enabled: bool) -> None:
    if not enabled:
        async def refuse(request: Request) -> None:
            raise OpenAIError(f"{request.method} {request.url.path}: {_OFF}", 404)

        for path, method in (("/sleep", "POST"), ("/wake_up", "POST"), ("/is_sleeping", "GET")):
            app.add_api_route(path, refuse, methods=[method], include_in_schema=False,
                              operation_id=f"sleep_mode_off_{path.strip('/')}")
        return

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode != "abort":
            raise bad_request(f"mode {mode!r}: only 'abort' is built (requests in flight are aborted); vLLM's 'wait' "
                              "and 'keep' are not", "mode")
        return await call_engine(state.engine.sleep(_level(request)), "level")

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None  # (vLLM's: repeated ?tags=..., none for all)
        return await call_engine(state.engine.wake_up(tags), "tags")

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": bool(state.engine.sleeping)}
