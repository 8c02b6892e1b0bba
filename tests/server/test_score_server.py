"""POST /score, /v1/score, /rerank, /v1/rerank, /v2/rerank, /classify and /pooling on `voltllm serve TINY --runner
pooling --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
"is_original_qwen3_reranker": true}'` (a tiny random qwen3 served as vLLM serves Qwen3-Reranker): scores against
transformers' sigmoid(logit_yes - logit_no) at the pair prompt's last token, the input forms, rerank order, top_n and
return_documents, usage, the 400s, and the routes this server answers 404."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from server_helpers import ServerProc, free_port
from tiny_models import make_model

NAME = "tiny-rerank"
MAX_LEN = 64
NO_ID, YES_ID = 300, 301  # (the tiny tokenizer has no "no" / "yes": two of its tokens stand in)
QUERY = "query: capital of France? "
DOCS = ["Paris is the capital.", "def add(a, b): return a + b", "The fox jumps.", "France, Paris, capital"]


@pytest.fixture(scope="module")
def rerank_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_rerank")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="module")
def tok(rerank_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(rerank_path)


@pytest.fixture(scope="module")
def rerank_server(rerank_path, tok):
    no, yes = tok.convert_ids_to_tokens([NO_ID, YES_ID])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    srv = ServerProc([rerank_path, "--device", "cpu", "--runner", "pooling", "--block-size", "4",
                      "--max-model-len", str(MAX_LEN), "--served-model-name", NAME, "--disable-log-stats",
                      "--disable-uvicorn-access-log", "--hf_overrides", json.dumps(overrides)],
                     free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def expected_ids(rerank_path):
    """transformers' sigmoid(logit_yes - logit_no) at the last of these prompt tokens."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(rerank_path, dtype=torch.float32).eval()

    def score(ids: list[int]) -> float:
        with torch.no_grad():
            lg = ref(torch.tensor([ids])).logits[0, -1]
        return torch.sigmoid(lg[YES_ID] - lg[NO_ID]).item()
    return score


@pytest.fixture(scope="module")
def expected(expected_ids, tok):
    """transformers' sigmoid(logit_yes - logit_no) at the last token of text_1 + text_2."""
    return lambda a, b: expected_ids(tok(a + b)["input_ids"])


def _post(server, body, path):
    return httpx.post(server.base + path, json=body, timeout=60)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_scores_match_transformers(rerank_server, expected, tok, path):
    r = _post(rerank_server, {"model": NAME, "text_1": QUERY, "text_2": DOCS}, path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == NAME and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    for doc, d in zip(DOCS, body["data"]):
        assert d["object"] == "score" and d["score"] == pytest.approx(expected(QUERY, doc), abs=2e-5)
    tokens = sum(len(tok(QUERY + doc)["input_ids"]) for doc in DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}


def test_score_input_forms(rerank_server, expected):
    queries = [QUERY, "another? ", "x "]
    nn = _post(rerank_server, {"text_1": queries, "text_2": DOCS[:3]}, "/v1/score").json()["data"]
    for q, d, got in zip(queries, DOCS, nn):
        assert got["score"] == pytest.approx(expected(q, d), abs=2e-5)
    for names in (("queries", "documents"), ("data_1", "data_2"), ("queries", "items")):
        r = _post(rerank_server, {names[0]: QUERY, names[1]: DOCS[1]}, "/score")
        assert r.status_code == 200 and r.json()["data"][0]["score"] == pytest.approx(expected(QUERY, DOCS[1]),
                                                                                      abs=2e-5)
    raw = _post(rerank_server, {"text_1": QUERY, "text_2": DOCS[0], "use_activation": False}, "/score").json()
    p = expected(QUERY, DOCS[0])
    assert raw["data"][0]["score"] == pytest.approx(float(torch.logit(torch.tensor(p, dtype=torch.float64))),
                                                    abs=1e-3)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_score(rerank_server, expected, tok, path):
    r = _post(rerank_server, {"model": NAME, "query": QUERY, "documents": DOCS}, path)
    assert r.status_code == 200, r.text
    body = r.json()
    want = sorted(range(len(DOCS)), key=lambda i: expected(QUERY, DOCS[i]), reverse=True)
    assert [x["index"] for x in body["results"]] == want and body["id"].startswith("rerank-")
    for x in body["results"]:
        assert x["document"] == {"text": DOCS[x["index"]]}
        assert x["relevance_score"] == pytest.approx(expected(QUERY, DOCS[x["index"]]), abs=2e-5)
    tokens = sum(len(tok(QUERY + doc)["input_ids"]) for doc in DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens} and body["model"] == NAME


def test_rerank_top_n_and_return_documents(rerank_server):
    def order(results):  # (scores may differ in the last bits with the batch's shape)
        return [(x["index"], x["document"]["text"], pytest.approx(x["relevance_score"], abs=1e-5)) for x in results]

    full = _post(rerank_server, {"query": QUERY, "documents": DOCS}, "/v1/rerank").json()["results"]
    top = _post(rerank_server, {"query": QUERY, "documents": DOCS, "top_n": 2}, "/v1/rerank").json()["results"]
    assert order(top) == order(full[:2])
    more = _post(rerank_server, {"query": QUERY, "documents": DOCS, "top_n": 10}, "/v1/rerank").json()["results"]
    assert order(more) == order(full)
    bare = _post(rerank_server, {"query": QUERY, "documents": DOCS, "return_documents": False}, "/v2/rerank").json()
    assert [set(x) for x in bare["results"]] == [{"index", "relevance_score"}] * len(DOCS)


def test_classify_and_invocations(rerank_server, expected):
    r = _post(rerank_server, {"model": NAME, "input": [QUERY + DOCS[0], QUERY + DOCS[1]]}, "/classify")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    for doc, d in zip(DOCS, body["data"]):
        assert d["object"] == "classification" and d["num_classes"] == 1 and d["label"] == "LABEL_0"
        assert d["probs"][0] == pytest.approx(expected(QUERY, doc), abs=2e-5)
    inv = _post(rerank_server, {"query": QUERY, "documents": DOCS[:2]}, "/invocations").json()
    assert {x["index"] for x in inv["results"]} == {0, 1}
    inv = _post(rerank_server, {"text_1": QUERY, "text_2": DOCS[0]}, "/invocations").json()
    assert inv["data"][0]["score"] == pytest.approx(expected(QUERY, DOCS[0]), abs=2e-5)


@pytest.mark.parametrize("task", [None, "classify"])
def test_pooling_route_gives_the_class_probabilities(rerank_server, expected, task):
    """vLLM's /pooling on a classifier: each input's data is its probabilities (/classify's probs); use_activation
    (or softmax / activation) false the raw logit."""
    texts = [QUERY + DOCS[0], QUERY + DOCS[1]]
    r = _post(rerank_server, {"model": NAME, "input": texts, **({"task": task} if task else {})}, "/pooling")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("pool-") and body["object"] == "list" and body["model"] == NAME
    probs = [d["probs"] for d in _post(rerank_server, {"input": texts}, "/classify").json()["data"]]
    for doc, d, p in zip(DOCS, body["data"], probs):
        assert d["object"] == "pooling" and d["data"] == pytest.approx(p, abs=1e-6)
        assert d["data"][0] == pytest.approx(expected(QUERY, doc), abs=2e-5)
    assert body["usage"] == _post(rerank_server, {"input": texts}, "/classify").json()["usage"]
    for name in ("use_activation", "softmax", "activation"):
        raw = _post(rerank_server, {"input": texts[0], name: False}, "/pooling").json()["data"][0]["data"][0]
        p = expected(QUERY, DOCS[0])
        assert raw == pytest.approx(float(torch.logit(torch.tensor(p, dtype=torch.float64))), abs=1e-3), name


@pytest.mark.parametrize("task,fragment", [("embed", "Unsupported task: 'embed': this server runs a classifier"),
                                           ("score", "use 'classify'"),
                                           ("token_classify", "per-token classification")])
def test_pooling_route_refuses_the_other_tasks(rerank_server, task, fragment):
    r = _post(rerank_server, {"input": "a", "task": task}, "/pooling")
    assert r.status_code == 400 and r.json()["error"]["param"] == "task" and fragment in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,param,fragment", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "text_1 has 2 texts and text_2 3"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2", "text_2: at least one text"),
    ("/score", {"text_1": "a"}, None, "give one pair of inputs"),
    ("/score", {"text_1": "a", "text_2": "b", "queries": "c", "documents": "d"}, None, "give one pair of inputs"),
    ("/score", {"text_1": 5, "text_2": "b"}, "text_1", ""),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": MAX_LEN + 1}, "truncate_prompt_tokens",
     "greater than this model's maximum context length"),
    ("/score", {"text_1": "a " * MAX_LEN, "text_2": "b"}, "input", "maximum context length"),
    ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority", "Priority scheduling is not enabled"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents", "at least one document"),
    ("/v1/rerank", {"documents": ["a"]}, "query", ""),
    ("/v1/rerank", {"query": "a", "documents": "b"}, "documents", ""),
    ("/classify", {"input": []}, "input", "input must not be empty"),
    ("/classify", {"input": [[]]}, "input", "input 0 is empty"),
])
def test_bad_requests_are_400s(rerank_server, path, body, param, fragment):
    r = _post(rerank_server, body, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and fragment in err["message"]


def test_unknown_model_is_a_404(rerank_server):
    r = _post(rerank_server, {"model": "nope", "query": "a", "documents": ["b"]}, "/v1/rerank")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path,body", [("/v1/embeddings", {"input": "hi"}),
                                       ("/v1/completions", {"prompt": "hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_embedding_and_generation_routes_are_404_on_a_classifier(rerank_server, path, body):
    r = _post(rerank_server, body, path)
    assert r.status_code == 404 and "/rerank" in r.json()["error"]["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(rerank_server, tok, expected):
    """vLLM's truncate_prompt_tokens as the embeddings route applies it here: the pair prompt's last k tokens."""
    ids = tok(QUERY + DOCS[0])["input_ids"]
    r = _post(rerank_server, {"text_1": QUERY, "text_2": DOCS[0], "truncate_prompt_tokens": 5}, "/score").json()
    assert r["usage"]["prompt_tokens"] == 5 and len(ids) > 5


def test_truncation_side_right_keeps_the_first_tokens(rerank_server, tok, expected_ids):
    """vLLM's truncation_side: "right" cuts the pair prompt's end (keeps its first k tokens), "left" its start."""
    ids = tok(QUERY + DOCS[0])["input_ids"]
    for side, kept in (("right", ids[:5]), ("left", ids[-5:])):
        r = _post(rerank_server, {"text_1": QUERY, "text_2": DOCS[0], "truncate_prompt_tokens": 5,
                                  "truncation_side": side}, "/score")
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 5
        assert r.json()["data"][0]["score"] == pytest.approx(expected_ids(kept), abs=2e-5), side
    r = _post(rerank_server, {"input": QUERY + DOCS[0], "truncate_prompt_tokens": 4, "truncation_side": "right"},
              "/classify").json()
    assert r["usage"]["prompt_tokens"] == 4 and r["data"][0]["probs"][0] == pytest.approx(expected_ids(ids[:4]),
                                                                                          abs=2e-5)


def _first_tokens(tok, text, n):
    """The text cut after its first n tokens (what vLLM's max_tokens_per_query / max_tokens_per_doc keep)."""
    cut = text[:tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"][n - 1][1]]
    assert tok.encode(cut) == tok.encode(text)[:n] and len(tok.encode(text)) > n
    return cut


@pytest.mark.parametrize("path,pair", [("/score", ("text_1", "text_2")), ("/v1/rerank", ("query", "documents")),
                                       ("/score", ("queries", "documents"))])
def test_max_tokens_per_query_and_doc_cut_each_text(rerank_server, tok, expected, path, pair):
    """vLLM's max_tokens_per_query / max_tokens_per_doc: each text cut to its first N tokens before the pair prompt
    is made (truncate_prompt_tokens then cuts that prompt); the usage counts what was scored."""
    query, docs = QUERY, DOCS[:2]
    body = {pair[0]: query, pair[1]: docs, "max_tokens_per_query": 3, "max_tokens_per_doc": 2}
    r = _post(rerank_server, body, path)
    assert r.status_code == 200, r.text
    q = _first_tokens(tok, query, 3)
    cut = [_first_tokens(tok, d, 2) for d in docs]
    got = r.json()["data"] if path == "/score" else sorted(r.json()["results"], key=lambda x: x["index"])
    for d, x in zip(cut, got):
        assert x.get("score", x.get("relevance_score")) == pytest.approx(expected(q, d), abs=2e-5)
    assert r.json()["usage"]["prompt_tokens"] == sum(len(tok(q + d)["input_ids"]) for d in cut)
    # a limit the text fits leaves it whole; with truncate_prompt_tokens the pair prompt is cut after
    whole = _post(rerank_server, {pair[0]: query, pair[1]: docs, "max_tokens_per_doc": MAX_LEN - 1}, path).json()
    assert whole["usage"]["prompt_tokens"] == sum(len(tok(query + d)["input_ids"]) for d in docs)
    both = _post(rerank_server, {**body, "truncate_prompt_tokens": 4}, path).json()
    assert both["usage"]["prompt_tokens"] == 4 * len(docs)


@pytest.mark.parametrize("path", ["/score", "/v1/rerank"])
@pytest.mark.parametrize("field,value,fragment", [
    ("max_tokens_per_query", -1, "max_tokens_per_query must be a non-negative integer"),
    ("max_tokens_per_doc", -2, "max_tokens_per_doc must be a non-negative integer"),
    ("max_tokens_per_doc", MAX_LEN, f"max_tokens_per_doc ({MAX_LEN}) must be less than max_model_len ({MAX_LEN})"),
    ("max_tokens_per_query", "x", ""),
    ("truncation_side", "middle", ""),
])
def test_bad_truncation_fields_are_400s(rerank_server, path, field, value, fragment):
    body = {"text_1": "a", "text_2": "b"} if path == "/score" else {"query": "a", "documents": ["b"]}
    r = _post(rerank_server, {**body, field: value}, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and fragment in err["message"], err


@pytest.mark.parametrize("path", ["/score", "/rerank", "/v2/rerank", "/classify", "/v1/rerank"])
def test_the_classifier_routes_are_behind_the_api_key(tmp_path, path):
    """In process (no model): with --api-key, a scoring route outside /v1 is refused without the key, as /v1/*."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from tiny_models import make_tokenizer
    from voltllm.entrypoints.openai.app import build_app
    from voltllm.entrypoints.openai.serving_common import ServerState

    tok = make_tokenizer(str(tmp_path))
    engine = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), is_healthy=True, dead=None)
    state = ServerState(engine=engine, served_model_names=["m"], max_model_len=64, model_path="m", runner="pooling")
    http = TestClient(build_app(state, api_key="k"))
    assert http.post(path, json={"query": "a", "documents": ["b"]}).status_code == 401
    # with the key it reaches the route (an embedding model here: /classify answers 404, the others check the body)
    r = http.post(path, json={"query": "a", "documents": []}, headers={"Authorization": "Bearer k"})
    if path == "/classify":
        assert r.status_code == 404 and "served by classifiers" in r.json()["error"]["message"]
    else:
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_the_classifier_routes_count_as_server_load():
    """--enable-server-load-tracking counts the POSTs that run the model; vLLM's /load counts the pooling routes."""
    from voltllm.entrypoints.openai.server_middleware import LOAD_ROUTES

    assert {"/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify"} <= LOAD_ROUTES
