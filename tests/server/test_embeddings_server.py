"""POST /v1/embeddings on `voltllm serve TINY --runner pooling` (the openai client and httpx): floats and base64,
list and token-id inputs, the chat form, usage, matryoshka dimensions, the 400s and 404s; the generation routes on a
pooling server and /v1/embeddings on a generative one (in process, with a stand-in engine)."""
from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from server_helpers import EMBED_MAX_LEN, EMBED_NAME, metrics
from tiny_models import make_tokenizer

NAME, MAX_LEN = EMBED_NAME, EMBED_MAX_LEN  # (conftest.py's session fixture `embed_server`)


@pytest.fixture(scope="module")
def reference(embed_path):
    """transformers' normalized last-token hidden state of token ids (AutoModel: after the final norm)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(embed_path, dtype=torch.float32).eval()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
    return embed


@pytest.fixture(scope="module")
def tok(embed_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embed_path)


def _post(server, body, path="/v1/embeddings"):
    return httpx.post(server.base + path, json=body, timeout=60)


def test_float_embeddings_match_transformers(embed_server, reference, tok):
    r = _post(embed_server, {"model": NAME, "input": ["The quick brown fox", "Hello world"],
                             "encoding_format": "float", "user": "someone"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == NAME and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"embedding"}
    ids = [tok.encode(t) for t in ("The quick brown fox", "Hello world")]
    for d, i in zip(body["data"], ids):
        torch.testing.assert_close(torch.tensor(d["embedding"]), reference(i), atol=2e-5, rtol=1e-4)
    n = sum(len(i) for i in ids)
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}


def test_openai_client_base64_round_trip(embed_server):
    """The openai client asks for base64 unless told otherwise and decodes float32 itself: the same numbers."""
    import openai

    client = openai.OpenAI(base_url=embed_server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    got = client.embeddings.create(model=NAME, input="The quick brown fox")
    floats = _post(embed_server, {"input": "The quick brown fox"}).json()["data"][0]["embedding"]
    assert got.data[0].embedding == pytest.approx(floats, abs=0)
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0
    raw = _post(embed_server, {"input": "The quick brown fox", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32)
    assert decoded.tolist() == pytest.approx(floats, abs=0)


@pytest.mark.parametrize("dtype,endianness,np_dtype", [("float16", "big", ">f2"), ("float32", "little", "<f4"),
                                                       ("bfloat16", "native", "=i2")])
def test_base64_dtypes_and_byte_orders(embed_server, dtype, endianness, np_dtype):
    floats = torch.tensor(_post(embed_server, {"input": "Hello"}).json()["data"][0]["embedding"])
    r = _post(embed_server, {"input": "Hello", "encoding_format": "base64", "embed_dtype": dtype,
                             "endianness": endianness})
    values = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype=np_dtype)
    if dtype == "bfloat16":  # its bits, as 16-bit integers
        back = torch.from_numpy(values.astype(np.int16)).view(torch.bfloat16).float()
    else:
        back = torch.from_numpy(values.astype(np.float32))
    assert torch.equal(back, floats.to(getattr(torch, dtype)).float())


@pytest.mark.parametrize("dtype,torch_dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_base64_fp8(embed_server, dtype, torch_dtype):
    """vLLM's fp8 embed_dtypes: one byte per value, the fp8 bits (byte order does not apply; the exact bits:
    tests/unit/test_embedding_bytes.py). Another request's floats may differ in their last bits (a prefix-cache hit
    computes fewer rows): compared within fp8's precision."""
    floats = torch.tensor(_post(embed_server, {"input": "Hello"}).json()["data"][0]["embedding"])
    for endianness in ("native", "big"):
        r = _post(embed_server, {"input": "Hello", "encoding_format": "base64", "embed_dtype": dtype,
                                 "endianness": endianness})
        raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype=np.uint8)
        assert len(raw) == len(floats)
        torch.testing.assert_close(torch.from_numpy(raw.copy()).view(torch_dtype).float(), floats, rtol=0.13,
                                   atol=2e-3)


def _decoded(body: bytes, item: dict) -> torch.Tensor:
    """One embedding of a binary answer, from its metadata item (vLLM's layout)."""
    np_dtype = {"float32": "f4", "float16": "f2", "bfloat16": "i2"}[item["embed_dtype"]]
    order = {"native": "=", "little": "<", "big": ">"}[item["endianness"]]
    values = np.frombuffer(body[item["start"]:item["end"]], dtype=order + np_dtype).reshape(item["shape"])
    t = torch.from_numpy(values.astype(values.dtype.newbyteorder("=")))
    return t.view(torch.bfloat16).float() if item["embed_dtype"] == "bfloat16" else t.float()


@pytest.mark.parametrize("dtype,endianness", [("float32", "native"), ("float16", "big"), ("bfloat16", "little")])
def test_bytes_encoding_format(embed_server, tok, dtype, endianness):
    """vLLM's encoding_format bytes: the embeddings' bytes one after another as the body (application/octet-stream),
    the id, model, usage and each embedding's place in a `metadata` header; bytes_only: the same body alone."""
    texts = ["Hello world", "The quick brown fox"]
    floats = [torch.tensor(d["embedding"]) for d in _post(embed_server, {"input": texts}).json()["data"]]
    r = _post(embed_server, {"model": NAME, "input": texts, "encoding_format": "bytes", "embed_dtype": dtype,
                             "endianness": endianness})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    meta = json.loads(r.headers["metadata"])
    n = sum(len(tok.encode(t)) for t in texts)
    assert meta["id"].startswith("embd-") and meta["model"] == NAME and isinstance(meta["created"], int)
    assert meta["usage"] == {"prompt_tokens": n, "total_tokens": n}
    width = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype] * len(floats[0])
    assert [(m["index"], m["start"], m["end"], m["shape"], m["embed_dtype"], m["endianness"]) for m in meta["data"]] \
        == [(0, 0, width, [len(floats[0])], dtype, endianness), (1, width, 2 * width, [len(floats[0])], dtype,
                                                                 endianness)]
    assert len(r.content) == 2 * width
    for item, want in zip(meta["data"], floats):  # (another request's floats: equal within the dtype's precision)
        tol = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 4e-3}[dtype]
        torch.testing.assert_close(_decoded(r.content, item), want, rtol=tol, atol=tol)
    only = _post(embed_server, {"input": texts, "encoding_format": "bytes_only", "embed_dtype": dtype,
                                "endianness": endianness})
    assert only.status_code == 200 and "metadata" not in only.headers and len(only.content) == len(r.content)
    for item in meta["data"]:  # (the same layout; the floats may differ in the last bits when batched differently)
        torch.testing.assert_close(_decoded(only.content, item), _decoded(r.content, item), rtol=tol, atol=tol)


def test_token_id_inputs_and_usage(embed_server, reference, tok):
    ids = tok.encode("What is the capital of France?")
    one = _post(embed_server, {"input": ids}).json()
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(ids)
    torch.testing.assert_close(torch.tensor(one["data"][0]["embedding"]), reference(ids), atol=2e-5, rtol=1e-4)
    many = _post(embed_server, {"input": [ids, ids[:3], [ids[0]]]}).json()
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    assert many["usage"]["prompt_tokens"] == len(ids) + 4
    assert many["data"][0]["embedding"] == pytest.approx(one["data"][0]["embedding"], abs=1e-6)
    torch.testing.assert_close(torch.tensor(many["data"][2]["embedding"]), reference([ids[0]]), atol=2e-5, rtol=1e-4)


def test_text_options(embed_server, reference, tok):
    text = "What is the capital of France? The capital of France is Paris."
    ids = tok.encode(text)
    cut = _post(embed_server, {"input": text, "truncate_prompt_tokens": 5}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    torch.testing.assert_close(torch.tensor(cut["data"][0]["embedding"]), reference(ids[-5:]), atol=2e-5, rtol=1e-4)
    # vLLM's truncation_side: right keeps the first k tokens, left (the default's end) the last k
    first = _post(embed_server, {"input": text, "truncate_prompt_tokens": 5, "truncation_side": "right"}).json()
    assert first["usage"]["prompt_tokens"] == 5
    torch.testing.assert_close(torch.tensor(first["data"][0]["embedding"]), reference(ids[:5]), atol=2e-5, rtol=1e-4)
    last = _post(embed_server, {"input": text, "truncate_prompt_tokens": 5, "truncation_side": "left"}).json()
    assert last["data"][0]["embedding"] == pytest.approx(cut["data"][0]["embedding"], abs=1e-5)
    raw = _post(embed_server, {"input": ids, "normalize": False}).json()["data"][0]["embedding"]
    assert abs(torch.tensor(raw).norm().item() - 1.0) > 1e-3
    torch.testing.assert_close(F.normalize(torch.tensor(raw), dim=-1), reference(ids), atol=2e-5, rtol=1e-4)
    # (the same switch under vLLM's newer name; a prefix-cache hit computes fewer rows: not bit-identical)
    assert _post(embed_server, {"input": ids, "use_activation": False}).json()["data"][0]["embedding"] == \
        pytest.approx(raw, abs=1e-5)


def test_chat_form(embed_server, reference, tok):
    """vLLM's messages form: the chat templated (no generation prompt by default), without added special tokens."""
    messages = [{"role": "user", "content": "Hello world"}]
    r = _post(embed_server, {"messages": messages})
    assert r.status_code == 200, r.text
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), reference(ids), atol=2e-5, rtol=1e-4)


def test_matryoshka_dimensions(embed_server, reference, tok):
    ids = tok.encode("Hello world")
    r = _post(embed_server, {"input": ids, "dimensions": 16, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["data"][0]["embedding"])
    full = reference(ids)
    torch.testing.assert_close(got, F.normalize(full[:16], dim=-1), atol=2e-5, rtol=1e-4)
    bad = _post(embed_server, {"input": ids, "dimensions": 8})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    assert f"model '{NAME}' supports the matryoshka dimensions [16, 32] only, got 8" in bad.json()["error"]["message"]


@pytest.mark.parametrize("body,param,fragment", [
    ({"input": ""}, "input", "input 0 is empty"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": [[]]}, "input", "input 0 is empty"),
    ({"input": [10**6]}, "input", "prompt token ids must be in [0,"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, None, "give either 'input'"),
    ({}, None, "give either 'input'"),
    ({"input": [1.5]}, "input", ""),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", ""),
    ({"input": "x", "encoding_format": "base64", "embed_dtype": "int8"}, "embed_dtype", ""),
    ({"input": "x", "truncate_prompt_tokens": MAX_LEN + 1}, "truncate_prompt_tokens", "greater than this model's "
                                                                                      "maximum context length"),
    ({"input": list(range(1, MAX_LEN + 2))}, "input", f"This model's maximum context length is {MAX_LEN} tokens. "
                                                      f"However, you requested {MAX_LEN + 1} tokens in the input"),
    ({"input": "x", "normalize": True, "use_activation": False}, "normalize", "name the same switch"),
    ({"input": "x", "truncate_prompt_tokens": 1, "truncation_side": "middle"}, "truncation_side", ""),
    ({"input": "x", "priority": 1}, "priority", "Got priority 1 but Priority scheduling is not enabled"),
    ({"input": "x", "chat_template": "{{ x }}"}, "chat_template", "apply to the messages form"),
])
def test_bad_requests_are_400s(embed_server, body, param, fragment):
    r = _post(embed_server, {"model": NAME, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and fragment in err["message"]
    if "context length" in fragment and param == "input":  # (vLLM's words, which clients match)
        assert err["code"] == "context_length_exceeded"


def test_exactly_the_context_length_is_accepted(embed_server):
    r = _post(embed_server, {"input": list(range(1, MAX_LEN + 1))})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_LEN


def test_unknown_model_is_a_404(embed_server):
    r = _post(embed_server, {"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/completions", {"prompt": "hi"}),
    ("POST", "/v1/responses", {"input": "hi"}),
    ("GET", "/v1/responses/resp_1", None),
    ("POST", "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_generation_routes_are_404_on_a_pooling_server(embed_server, method, path, body):
    r = httpx.request(method, embed_server.base + path, json=body, timeout=30)
    assert r.status_code == 404
    text = json.dumps(r.json())
    assert "pooling model (--runner pooling), which generates nothing" in text
    assert "POST /v1/embeddings, /score, /v1/score, /rerank, /v1/rerank, /v2/rerank and /pooling" in text


def test_invocations_embed_and_the_other_routes_still_answer(embed_server):
    inv = _post(embed_server, {"input": "Hello"}, "/invocations")
    assert inv.status_code == 200 and inv.json()["object"] == "list"
    assert inv.json()["data"][0]["embedding"] == _post(embed_server, {"input": "Hello"}).json()["data"][0]["embedding"]
    models = httpx.get(embed_server.base + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["data"][0]["max_model_len"] == MAX_LEN
    assert httpx.post(embed_server.base + "/tokenize", json={"prompt": "Hello"}, timeout=10).json()["count"] > 0
    m = metrics(embed_server)
    assert m["voltllm:request_success_total"] > 0 and m["voltllm:prompt_tokens_total"] > 0
    assert m.get("voltllm:generation_tokens_total", 0) == 0


def test_classify_is_404_on_an_embedding_server(embed_server):
    """(/score and /rerank answer here: tests/server/test_embedding_score_server.py)"""
    r = _post(embed_server, {"model": NAME, "input": "a"}, "/classify")
    assert r.status_code == 404
    assert "served by classifiers" in r.json()["error"]["message"] and "an embedding model" in r.text


def test_cohere_embed_route_is_refused(embed_server):
    """(vLLM's /pooling answers: tests/server/test_pooling_server.py)"""
    r = _post(embed_server, {"model": NAME, "texts": ["a"]}, "/v2/embed")
    assert r.status_code == 404 and "is not built in voltllm" in r.json()["error"]["message"]


def test_concurrent_requests_batch_and_leave_nothing_behind(embed_server):
    """Many small requests at once (they share steps), then no request or block is left (/metrics)."""
    import concurrent.futures

    texts = [f"Hello world {i}" * (1 + i % 3) for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda t: _post(embed_server, {"input": t}), texts))
    assert all(r.status_code == 200 for r in results)
    alone = _post(embed_server, {"input": texts[5]}).json()["data"][0]["embedding"]
    assert results[5].json()["data"][0]["embedding"] == pytest.approx(alone, abs=1e-5)
    m = metrics(embed_server)
    assert m["voltllm:num_requests_running"] == 0 and m["voltllm:kv_cache_usage_perc"] == 0


# -- in process: a generative server's /v1/embeddings, a pooling server's refusals (no model needed) --------------
def _app(tmp_path, runner):
    from fastapi.testclient import TestClient

    from voltllm.entrypoints.openai.app import build_app
    from voltllm.entrypoints.openai.serving_common import ServerState

    tok = make_tokenizer(str(tmp_path))
    engine = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), is_healthy=True, dead=None)
    state = ServerState(engine=engine, served_model_names=["m"], max_model_len=256, model_path="m", runner=runner)
    return TestClient(build_app(state))


def test_a_generative_server_has_no_embeddings(tmp_path):
    http = _app(tmp_path, "generate")
    r = http.post("/v1/embeddings", json={"model": "m", "input": "hi"})
    assert r.status_code == 404
    assert "runs a generative model, which computes no embeddings" in r.json()["error"]["message"]
    assert "--runner pooling" in r.json()["error"]["message"]
    r = http.post("/v1/rerank", json={"query": "a", "documents": ["b"]})
    assert r.status_code == 404 and "reranking is served by pooling models" in r.json()["error"]["message"]
    assert "this server runs a generative model" in r.json()["error"]["message"]


def test_a_pooling_servers_messages_routes_answer_in_anthropics_shape(tmp_path):
    http = _app(tmp_path, "pooling")
    r = http.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200
