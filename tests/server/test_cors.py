"""CORS (vLLM's flags and defaults): a browser's preflight is answered before the API-key check, responses carry
the allowed origin; a restricted --allowed-origins list answers other origins without the header."""
from __future__ import annotations

import httpx
import pytest

from server_helpers import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_default_allows_any_origin(server):
    pre = httpx.options(server.base + "/v1/chat/completions", timeout=30, headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200, pre.text  # no API key on a preflight
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = httpx.get(server.base + "/v1/models", headers={**AUTH, "Origin": "http://ui.example"}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    denied = httpx.get(server.base + "/v1/models", headers={"Origin": "http://ui.example"}, timeout=30)
    assert denied.status_code == 401  # CORS does not open the API key


def test_restricted_origins():
    """build_app with one allowed origin (what --allowed-origins '["http://a.example"]' builds)."""
    from starlette.testclient import TestClient

    from voltllm.entrypoints.openai.app import CorsSettings, build_app
    from voltllm.entrypoints.openai.serving_common import ServerState

    state = ServerState(engine=None, served_model_names=["m"], max_model_len=16, model_path="m")
    app = build_app(state, cors=CorsSettings(allowed_origins=("http://a.example",)))
    client = TestClient(app)
    ok = client.get("/version", headers={"Origin": "http://a.example"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://a.example"
    other = client.get("/version", headers={"Origin": "http://b.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    pre = client.options("/v1/completions", headers={"Origin": "http://b.example",
                                                     "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 400


@pytest.mark.parametrize("value", ["*", '{"a": 1}', "[1]"])
def test_cors_flags_want_json_string_lists(value):
    import argparse

    from voltllm.cli_args import json_string_list

    with pytest.raises(argparse.ArgumentTypeError, match="--allowed-origins must be a JSON list of strings"):
        json_string_list("--allowed-origins")(value)
