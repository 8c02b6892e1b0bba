"""--middleware (vLLM's flag): extra ASGI middleware given as import paths (`package.module.name`, the flag repeated
for several). A class is an ASGI middleware (`cls(app)`), as vLLM's `app.add_middleware(cls)`; a coroutine function
is an HTTP middleware, `async def f(request, call_next)`, as vLLM's `app.middleware("http")(f)`. As there, each one
given wraps everything before it: the last is the outermost, and all of them sit outside CORS, the API-key check and
the request-id header, so they see every request and response (a 401 too)."""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Sequence

from voltllm.config import ConfigError


def resolve_middleware(paths: Sequence[str]) -> tuple[Any, ...]:
    """Import each path's object, before any model is loaded (ConfigError -> exit 2 naming the path)."""
    found = []
    for path in paths:
        module_name, _, attr = path.rpartition(".")
        if not module_name or not attr:
            raise ConfigError(f"--middleware {path!r}: give an import path, package.module.name")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except ImportError as e:
            raise ConfigError(f"--middleware {path}: cannot import {module_name} ({e})") from None
        except AttributeError:
            raise ConfigError(f"--middleware {path}: {module_name} has no {attr}") from None
        if not (inspect.isclass(obj) or inspect.iscoroutinefunction(obj)):
            raise ConfigError(f"--middleware {path}: neither a class (ASGI middleware) nor an async function "
                              "(request, call_next) -> response")
        found.append(obj)
    return tuple(found)


def wrap_middleware(app: Any, middleware: Sequence[Any]) -> Any:
    """The ASGI app with each middleware around the ones before it."""
    for obj in middleware:
        if inspect.isclass(obj):
            app = obj(app)
        else:
            from starlette.middleware.base import BaseHTTPMiddleware

            app = BaseHTTPMiddleware(app, dispatch=obj)
    return app
