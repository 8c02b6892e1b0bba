"""POST /pooling (vLLM's generic pooling route) on the session's embedding server (conftest.py `embed_server`): the
embed task's data is the /v1/embeddings embedding (floats, base64, bytes; the chat form; truncation; the activation
switch), vLLM's PoolingResponse shape and usage, and the 400s for the tasks and fields voltllm does not run; in
process (no model), the route on a generative server and behind --api-key. A classifier's /pooling:
tests/server/test_score_server.py."""
from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from server_helpers import EMBED_MAX_LEN, EMBED_NAME
from tiny_models import make_tokenizer

NAME, MAX_LEN = EMBED_NAME, EMBED_MAX_LEN
TEXTS = ["The quick brown fox", "Hello world"]


def _post(server, body, path="/pooling", **kw):
    return httpx.post(server.base + path, json=body, timeout=60, **kw)


def _embeddings(server, body):
    r = _post(server, body, "/v1/embeddings")
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


@pytest.mark.parametrize("task", [None, "embed"])
def test_the_embed_task_pools_the_embedding(embed_server, task):
    body = {"model": NAME, "input": TEXTS, **({"task": task} if task else {})}
    r = _post(embed_server, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"id", "object", "created", "model", "data", "usage"}
    assert out["id"].startswith("pool-") and out["object"] == "list" and out["model"] == NAME
    assert [(d["index"], d["object"]) for d in out["data"]] == [(0, "pooling"), (1, "pooling")]
    assert [d["data"] for d in out["data"]] == [pytest.approx(e, abs=1e-6)
                                                for e in _embeddings(embed_server, {"input": TEXTS})]
    n = _post(embed_server, {"input": TEXTS}, "/v1/embeddings").json()["usage"]["prompt_tokens"]
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}


def test_request_id_header_names_the_response(embed_server):
    r = _post(embed_server, {"input": "hi"}, headers={"X-Request-Id": "abc-1"})
    assert r.status_code == 200 and r.json()["id"] == "pool-abc-1"


def test_the_chat_form_and_token_ids(embed_server):
    messages = [{"role": "user", "content": "Hello there"}]
    r = _post(embed_server, {"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["data"] == pytest.approx(_embeddings(embed_server, {"messages": messages})[0],
                                                        abs=1e-6)
    ids = [[5, 6, 7, 8], [9, 10]]
    r = _post(embed_server, {"input": ids})
    assert [d["data"] for d in r.json()["data"]] == [pytest.approx(e, abs=1e-6)
                                                     for e in _embeddings(embed_server, {"input": ids})]
    assert r.json()["usage"]["prompt_tokens"] == 6


def test_base64_and_bytes_encodings(embed_server):
    floats = _post(embed_server, {"input": TEXTS[0]}).json()["data"][0]["data"]
    b64 = _post(embed_server, {"input": TEXTS[0], "encoding_format": "base64", "embed_dtype": "float16",
                               "endianness": "big"}).json()["data"][0]["data"]
    assert np.frombuffer(base64.b64decode(b64), dtype=">f2").tolist() == pytest.approx(floats, abs=2e-3)
    r = _post(embed_server, {"input": TEXTS, "encoding_format": "bytes"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    meta = json.loads(r.headers["metadata"])
    assert meta["id"].startswith("pool-") and meta["model"] == NAME and len(meta["data"]) == 2
    first = meta["data"][0]
    # (each call computes the embeddings again: one whose prompt meets the prefix cache left by earlier tests differs in
    # the last bits, so values are compared to rounding, not bit for bit)
    assert np.frombuffer(r.content[first["start"]:first["end"]], dtype=np.float32).tolist() == pytest.approx(
        floats, abs=1e-6)
    bare = _post(embed_server, {"input": TEXTS, "encoding_format": "bytes_only"})
    assert "metadata" not in bare.headers and len(bare.content) == len(r.content)
    assert np.frombuffer(bare.content, dtype=np.float32).tolist() == pytest.approx(
        np.frombuffer(r.content, dtype=np.float32).tolist(), abs=1e-6)


def test_activation_switch_and_truncation(embed_server):
    """use_activation (or its older names) off: the embedding unnormalized, as /v1/embeddings' normalize false;
    truncate_prompt_tokens with truncation_side right keeps the first tokens."""
    raw = _embeddings(embed_server, {"input": TEXTS[0], "normalize": False})[0]
    for name in ("use_activation", "normalize"):
        got = _post(embed_server, {"input": TEXTS[0], name: False}).json()["data"][0]["data"]
        assert got == pytest.approx(raw, abs=1e-5), name
    assert np.linalg.norm(raw) != pytest.approx(1.0, abs=1e-3)
    cut = {"input": "a b c d e f g h", "truncate_prompt_tokens": 3, "truncation_side": "right"}
    r = _post(embed_server, cut).json()
    assert r["usage"]["prompt_tokens"] == 3
    assert r["data"][0]["data"] == pytest.approx(_embeddings(embed_server, cut)[0], abs=1e-6)
    assert r["data"][0]["data"] != pytest.approx(
        _embeddings(embed_server, {**cut, "truncation_side": "left"})[0], abs=1e-6)


@pytest.mark.parametrize("body,param,fragment", [
    ({"input": "a", "task": "classify"}, "task", "Unsupported task: 'classify': this server runs an embedding model"),
    ({"input": "a", "task": "token_embed"}, "task", "per-token embeddings"),
    ({"input": "a", "task": "token_classify"}, "task", "per-token classification"),
    ({"input": "a", "task": "embed&token_classify"}, "task", "is not built"),
    ({"input": "a", "task": "plugin"}, "task", "IO processor plugins are not built"),
    ({"input": "a", "task": "score"}, "task", "use 'classify'"),
    ({"input": "a", "task": "encode"}, "task", "was removed in vLLM"),
    ({"input": "a", "task": "reward"}, "task", "task must be one of embed, classify"),
    ({"data": {"image": "x"}}, "data", "IO processor plugin requests (task 'plugin') are not built"),
    ({"input": "a", "dimensions": 16}, "dimensions", "dimensions is currently not supported"),
    ({"input": "a", "use_activation": True, "normalize": False}, "use_activation", "name the same switch"),
    ({"input": "a", "truncation_side": "middle"}, "truncation_side", ""),
    ({"input": "a", "truncate_prompt_tokens": MAX_LEN + 1}, "truncate_prompt_tokens", "maximum context length"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": "a", "messages": [{"role": "user", "content": "b"}]}, None, "give either 'input'"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", ""),
])
def test_bad_requests_are_400s(embed_server, body, param, fragment):
    r = _post(embed_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and fragment in err["message"], err


def test_unknown_model_is_a_404(embed_server):
    r = _post(embed_server, {"model": "nope", "input": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# -- in process (no model): a generative server's /pooling, the API key, the load count ----------------------------
def _app(tmp_path, runner, **kw):
    from fastapi.testclient import TestClient

    from voltllm.entrypoints.openai.app import build_app
    from voltllm.entrypoints.openai.serving_common import ServerState

    tok = make_tokenizer(str(tmp_path))
    engine = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), is_healthy=True, dead=None)
    state = ServerState(engine=engine, served_model_names=["m"], max_model_len=64, model_path="m", runner=runner)
    return TestClient(build_app(state, **kw))


def test_a_generative_server_has_no_pooling_route(tmp_path):
    r = _app(tmp_path, "generate").post("/pooling", json={"input": "hi"})
    assert r.status_code == 404
    assert "runs a generative model, which pools nothing" in r.json()["error"]["message"]


def test_pooling_is_behind_the_api_key_and_counts_as_load(tmp_path):
    from voltllm.entrypoints.openai.server_middleware import LOAD_ROUTES

    http = _app(tmp_path, "pooling", api_key="k")
    assert http.post("/pooling", json={"input": "hi"}).status_code == 401
    r = http.post("/pooling", json={"input": "hi", "task": "plugin"}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"
    assert "/pooling" in LOAD_ROUTES
