"""POST /score, /v1/score, /rerank, /v1/rerank and /v2/rerank on an embedding server (conftest.py `embed_server`: the
tiny qwen3 under --task embed), vLLM's bi-encoder scoring: each pair's score is the cosine similarity of the two
texts' /v1/embeddings vectors (computed here with torch), for the 1:1, 1:N and N:N pairings and every input form;
rerank order, top_n, return_documents; usage as vLLM counts it; truncation; /invocations; the 400s."""
from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F

from server_helpers import EMBED_MAX_LEN, EMBED_NAME, metrics

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "def add(a, b): return a + b", "The quick brown fox jumps.",
        "France, Paris, capital"]


@pytest.fixture(scope="module")
def tok(embed_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embed_path)


def _post(server, body, path):
    return httpx.post(server.base + path, json=body, timeout=60)


def _embedding(server, text, **extra) -> torch.Tensor:
    r = _post(server, {"input": text, "encoding_format": "float", **extra}, "/v1/embeddings")
    assert r.status_code == 200, r.text
    return torch.tensor(r.json()["data"][0]["embedding"])


def _cosine(server, a, b, **extra) -> float:
    return F.cosine_similarity(_embedding(server, a, **extra), _embedding(server, b, **extra), dim=0).item()


def _pair_tokens(tok, a, b) -> int:
    """vLLM's usage of a bi-encoder pair: both texts' tokens and the pad token between them."""
    return len(tok.encode(a)) + 1 + len(tok.encode(b))


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_scores_are_the_cosines_of_the_embeddings(embed_server, tok, path):
    assert tok.pad_token_id is not None
    r = _post(embed_server, {"model": EMBED_NAME, "text_1": QUERY, "text_2": DOCS}, path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == EMBED_NAME and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    for doc, d in zip(DOCS, body["data"]):
        assert d["object"] == "score" and d["score"] == pytest.approx(_cosine(embed_server, QUERY, doc), abs=1e-5)
    tokens = sum(_pair_tokens(tok, QUERY, doc) for doc in DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}


def test_pairings_and_input_forms(embed_server):
    queries = [QUERY, "Who wrote this function?", "A fox"]
    nn = _post(embed_server, {"text_1": queries, "text_2": DOCS[:3]}, "/v1/score").json()["data"]
    assert len(nn) == 3
    for q, d, got in zip(queries, DOCS, nn):
        assert got["score"] == pytest.approx(_cosine(embed_server, q, d), abs=1e-5)
    for names in (("queries", "documents"), ("data_1", "data_2"), ("queries", "items")):
        r = _post(embed_server, {names[0]: [QUERY], names[1]: DOCS[1]}, "/score")
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == [pytest.approx(_cosine(embed_server, QUERY, DOCS[1]),
                                                                        abs=1e-5)]
    same = _post(embed_server, {"text_1": DOCS[2], "text_2": DOCS[2]}, "/score").json()["data"][0]["score"]
    assert same == pytest.approx(1.0, abs=1e-5)
    # the embedding's normalization does not change a cosine
    raw = _post(embed_server, {"text_1": QUERY, "text_2": DOCS[:2], "use_activation": False}, "/score").json()
    assert [d["score"] for d in raw["data"]] == pytest.approx([_cosine(embed_server, QUERY, d) for d in DOCS[:2]],
                                                              abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_cosine(embed_server, tok, path):
    r = _post(embed_server, {"model": EMBED_NAME, "query": QUERY, "documents": DOCS}, path)
    assert r.status_code == 200, r.text
    body = r.json()
    want = {i: _cosine(embed_server, QUERY, d) for i, d in enumerate(DOCS)}
    assert body["id"].startswith("rerank-") and body["model"] == EMBED_NAME
    assert [x["index"] for x in body["results"]] == sorted(want, key=want.get, reverse=True)
    for x in body["results"]:
        assert x["document"] == {"text": DOCS[x["index"]]}
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
    tokens = sum(_pair_tokens(tok, QUERY, doc) for doc in DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_top_n_and_return_documents(embed_server):
    full = _post(embed_server, {"query": QUERY, "documents": DOCS}, "/v1/rerank").json()["results"]
    top = _post(embed_server, {"query": QUERY, "documents": DOCS, "top_n": 2}, "/v1/rerank").json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full[:2]]
    more = _post(embed_server, {"query": QUERY, "documents": DOCS, "top_n": 9}, "/rerank").json()["results"]
    assert [x["index"] for x in more] == [x["index"] for x in full]
    bare = _post(embed_server, {"query": QUERY, "documents": DOCS, "return_documents": False}, "/v2/rerank").json()
    assert [set(x) for x in bare["results"]] == [{"index", "relevance_score"}] * len(DOCS)


def test_truncate_prompt_tokens_cuts_each_text(embed_server, tok):
    r = _post(embed_server, {"text_1": QUERY, "text_2": DOCS[0], "truncate_prompt_tokens": 3}, "/score").json()
    assert r["usage"]["prompt_tokens"] == 3 + 1 + 3
    want = _cosine(embed_server, QUERY, DOCS[0], truncate_prompt_tokens=3)
    assert r["data"][0]["score"] == pytest.approx(want, abs=1e-5)


def test_truncation_side_right_cuts_each_text_end(embed_server, tok):
    """vLLM's truncation_side "right": truncate_prompt_tokens keeps each text's first k tokens."""
    r = _post(embed_server, {"text_1": QUERY, "text_2": DOCS[0], "truncate_prompt_tokens": 3,
                             "truncation_side": "right"}, "/score").json()
    assert r["usage"]["prompt_tokens"] == 3 + 1 + 3
    want = F.cosine_similarity(_embedding(embed_server, tok.encode(QUERY)[:3]),
                               _embedding(embed_server, tok.encode(DOCS[0])[:3]), dim=0).item()
    assert r["data"][0]["score"] == pytest.approx(want, abs=1e-5)


def _first_tokens(tok, text, n):
    """The text cut after its first n tokens (what vLLM's max_tokens_per_query / max_tokens_per_doc keep)."""
    cut = text[:tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"][n - 1][1]]
    assert tok.encode(cut) == tok.encode(text)[:n] and len(tok.encode(text)) > n
    return cut


@pytest.mark.parametrize("path,pair", [("/score", ("text_1", "text_2")), ("/rerank", ("query", "documents"))])
def test_max_tokens_per_query_and_doc_cut_each_text(embed_server, tok, path, pair):
    """vLLM's max_tokens_per_query / max_tokens_per_doc on a bi-encoder: each text cut to its first N tokens, then
    embedded; the usage counts the cut texts."""
    r = _post(embed_server, {pair[0]: QUERY, pair[1]: DOCS[:2], "max_tokens_per_query": 4, "max_tokens_per_doc": 3},
              path)
    assert r.status_code == 200, r.text
    q, cut = _first_tokens(tok, QUERY, 4), [_first_tokens(tok, d, 3) for d in DOCS[:2]]
    got = r.json()["data"] if path == "/score" else sorted(r.json()["results"], key=lambda x: x["index"])
    for d, x in zip(cut, got):
        assert x.get("score", x.get("relevance_score")) == pytest.approx(_cosine(embed_server, q, d), abs=1e-5)
    assert r.json()["usage"]["prompt_tokens"] == sum(_pair_tokens(tok, q, d) for d in cut) == 2 * (4 + 1 + 3)


@pytest.mark.parametrize("path,pair", [("/score", ("text_1", "text_2")), ("/v1/rerank", ("query", "documents"))])
def test_cache_salt_reaches_the_prefix_cache(embed_server, path, pair):
    """vLLM's cache_salt: texts under a new salt share no cached blocks with earlier ones; under the same salt they
    do (prefix-cache hits in /metrics)."""
    first, second = f"Salted query for {path}", f"Another salted text for {path}"  # (no shared first block)
    body = {pair[0]: first, pair[1]: [second] if pair[1] == "documents" else second}

    def hits(salt):
        before = metrics(embed_server)["voltllm:prefix_cache_hits_total"]
        assert _post(embed_server, {**body, "cache_salt": salt}, path).status_code == 200
        return metrics(embed_server)["voltllm:prefix_cache_hits_total"] - before
    assert hits(f"{path}-a") == 0
    assert hits(f"{path}-b") == 0
    assert hits(f"{path}-b") > 0


def test_invocations_dispatch_by_body(embed_server):
    rerank = _post(embed_server, {"query": QUERY, "documents": DOCS[:2]}, "/invocations").json()
    assert {x["index"] for x in rerank["results"]} == {0, 1}
    score = _post(embed_server, {"text_1": QUERY, "text_2": DOCS[0]}, "/invocations").json()
    assert score["data"][0]["score"] == pytest.approx(_cosine(embed_server, QUERY, DOCS[0]), abs=1e-5)
    embed = _post(embed_server, {"input": QUERY}, "/invocations").json()
    assert embed["data"][0]["object"] == "embedding"


@pytest.mark.parametrize("path,body,param,fragment", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "text_1 has 2 texts and text_2 3"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2", "text_2: at least one text"),
    ("/score", {"text_1": "", "text_2": "b"}, "text_1", "text_1: text 0 is empty"),
    ("/score", {"text_1": "a"}, None, "give one pair of inputs"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": EMBED_MAX_LEN + 1}, "truncate_prompt_tokens",
     "greater than this model's maximum context length"),
    ("/score", {"text_1": "a", "text_2": "b " * (EMBED_MAX_LEN + 1)}, "input", "maximum context length"),
    ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority", "Priority scheduling is not enabled"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents", "at least one document"),
    ("/v1/rerank", {"query": "a", "documents": ["b", ""]}, "documents", "documents: text 1 is empty"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": -1}, "max_tokens_per_doc",
     "must be a non-negative integer"),
    ("/score", {"text_1": "a", "text_2": "b", "max_tokens_per_query": EMBED_MAX_LEN}, "max_tokens_per_query",
     f"must be less than max_model_len ({EMBED_MAX_LEN})"),
    ("/score", {"text_1": "a", "text_2": "b", "truncation_side": "both"}, "truncation_side", ""),
])
def test_bad_requests_are_400s(embed_server, path, body, param, fragment):
    r = _post(embed_server, body, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and fragment in err["message"]
    if fragment == "maximum context length":
        assert err["code"] == "context_length_exceeded"
