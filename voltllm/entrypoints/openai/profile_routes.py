"""vLLM's profiling routes: POST /start_profile and POST /stop_profile (voltllm/profiling.py).

They exist when the server runs with --profiler-config (as in vLLM); without it each answers 404 saying so. Starting
a running profiler, or stopping one that is not, is a 400; stop answers once the engine has written its trace files
(a long profile takes a while to write).
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.sleep_routes import call_engine

_OFF = ("profiling is off: start the server with --profiler-config "
        "'{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/abs/dir\"}'")


def add_profile_routes(app: Any, state: Any, enabled: bool) -> None:
    if not enabled:
        async def refuse(request: Request) -> None:
            raise OpenAIError(f"{request.method} {request.url.path}: {_OFF}", 404)

        for path in ("/start_profile", "/stop_profile"):
            app.add_api_route(path, refuse, methods=["POST"], include_in_schema=False,
                              operation_id=f"profiling_off_{path.strip('/')}")
        return

    @app.post("/start_profile")
    async def start_profile() -> Response:
        return await call_engine(state.engine.start_profile(), None)

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        return await call_engine(state.engine.stop_profile(), None)
