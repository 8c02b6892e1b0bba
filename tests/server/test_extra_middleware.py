"""--middleware (vLLM's flag): ASGI middleware classes and async HTTP middleware functions from import paths wrap the
server, the last given outermost, outside the API-key check (a 401 passes through them too); bad paths are refused
before any model is loaded. In process: build_app over a stand-in engine."""
from __future__ import annotations

import logging
import textwrap
from types import SimpleNamespace

import pytest

from tiny_models import make_tokenizer

MODULE = textwrap.dedent('''
    SEEN = []

    async def stamp(request, call_next):
        SEEN.append("stamp")
        response = await call_next(request)
        response.headers["x-stamp"] = "function"
        return response

    class Tag:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            SEEN.append("tag")

            async def tagged(message):
                if message["type"] == "http.response.start":
                    message["headers"] = list(message.get("headers", [])) + [(b"x-tag", b"class")]
                await send(message)

            await self.app(scope, receive, tagged)

    def not_async(request, call_next):
        return call_next(request)

    VALUE = 3
''')


@pytest.fixture
def mw_module(tmp_path, monkeypatch):
    import importlib
    import sys

    (tmp_path / "voltllm_test_mw.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("voltllm_test_mw", None)
    return importlib.import_module("voltllm_test_mw")


def _client(tmp_path, middleware, api_key=None):
    from starlette.testclient import TestClient

    from voltllm.entrypoints.openai.app import HttpOptions, build_app
    from voltllm.entrypoints.openai.serving_common import ServerState

    tok = make_tokenizer(str(tmp_path / "tok"))
    engine = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), is_healthy=True, dead=None)
    state = ServerState(engine=engine, served_model_names=["m"], max_model_len=256, model_path="m")
    return TestClient(build_app(state, api_key=api_key, http=HttpOptions(middleware=middleware)))


def test_classes_and_functions_wrap_the_server_last_outermost(tmp_path, mw_module):
    from voltllm.entrypoints.openai.extra_middleware import resolve_middleware

    chain = resolve_middleware(["voltllm_test_mw.stamp", "voltllm_test_mw.Tag"])
    assert chain == (mw_module.stamp, mw_module.Tag)
    r = _client(tmp_path, chain).get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
    assert r.headers["x-stamp"] == "function" and r.headers["x-tag"] == "class"
    assert mw_module.SEEN == ["tag", "stamp"], "the last one given is the outermost"


def test_middleware_sees_what_the_api_key_check_refuses(tmp_path, mw_module):
    from voltllm.entrypoints.openai.extra_middleware import resolve_middleware

    http = _client(tmp_path, resolve_middleware(["voltllm_test_mw.Tag"]), api_key="secret")
    r = http.get("/v1/models")
    assert r.status_code == 401 and r.headers["x-tag"] == "class"
    ok = http.get("/v1/models", headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200 and ok.headers["x-tag"] == "class"


@pytest.mark.parametrize("path,message", [
    ("stamp", "give an import path, package.module.name"),
    ("voltllm_no_such_module.f", "cannot import voltllm_no_such_module"),
    ("voltllm_test_mw.missing", "voltllm_test_mw has no missing"),
    ("voltllm_test_mw.not_async", "neither a class (ASGI middleware) nor an async function"),
    ("voltllm_test_mw.VALUE", "neither a class (ASGI middleware) nor an async function"),
])
def test_bad_paths_are_refused(mw_module, path, message):
    from voltllm.config import ConfigError
    from voltllm.entrypoints.openai.extra_middleware import resolve_middleware

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_middleware([path])


def test_serve_refuses_a_bad_path_before_the_model(capsys, mw_module):
    from voltllm.cli import main

    logging.getLogger("voltllm").handlers.clear()
    assert main(["serve", "/nonexistent", "--middleware", "voltllm_test_mw.missing"]) == 2
    assert "voltllm: error: --middleware voltllm_test_mw.missing: voltllm_test_mw has no missing" in \
        capsys.readouterr().err
    # a good one (twice, and two in one flag) passes the flag checks: the missing model is what stops it
    assert main(["serve", "/nonexistent", "--middleware", "voltllm_test_mw.Tag", "voltllm_test_mw.stamp",
                 "--middleware", "voltllm_test_mw.Tag"]) == 2
    assert "model '/nonexistent' not found" in capsys.readouterr().err
