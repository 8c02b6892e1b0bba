"""--enable-lora --lora-modules over HTTP (the tiny server serves the adapter "tiny-lora"): /v1/models lists it with
`parent` (the base model) and `root` (its path), a request naming it runs with it (its greedy tokens are transformers'
with the adapter merged; use_beam_search's beams are the merged model's), the base model's requests run without it, an
unknown name stays a 404; without --allow-runtime-lora-updating the load / unload routes do not exist
(tests/server/test_lora_runtime_server.py serves them)."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from beam_reference import Reference
from lora_adapters import merged_model


def _post(server, path, body):
    return httpx.post(server.base + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_server):
    """Greedy tokens of transformers' base model and of the merged adapter."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_server.model_path)
    models = {"tiny": merged_model(tiny_server.model_path, None),
              "tiny-lora": merged_model(tiny_server.model_path, tiny_server.lora_path)}

    def greedy(model, ids, n):
        with torch.no_grad():
            out = models[model].generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, len(ids):].tolist()

    return tok, greedy, models


def test_models_lists_the_adapter_under_its_base(tiny_server):
    data = httpx.get(tiny_server.base + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in data] == ["tiny", "tiny-lora"]
    base, lora = data
    assert base["parent"] is None and base["root"] == tiny_server.model_path
    assert lora["parent"] == "tiny" and lora["root"] == tiny_server.lora_path and lora["object"] == "model"
    card = httpx.get(tiny_server.base + "/v1/models/tiny-lora", timeout=30).json()
    assert card == lora
    assert httpx.get(tiny_server.base + "/v1/models/tiny-lora2", timeout=30).status_code == 404


def test_a_completion_naming_the_adapter_runs_with_it(tiny_server, reference):
    tok, greedy, _ = reference
    prompt = "The quick brown fox jumps over"
    ids = tok.encode(prompt)
    tokens = {}
    for model in ("tiny-lora", "tiny"):
        r = _post(tiny_server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == model
        tokens[model] = body["choices"][0]["token_ids"]
        assert tokens[model] == greedy(model, ids, 6), model
    assert tokens["tiny"] != tokens["tiny-lora"]


def test_chat_and_streams_take_the_adapter(tiny_server, reference):
    tok, greedy, _ = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": "tiny-lora", "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = _post(tiny_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "tiny-lora"
    ids = out["prompt_token_ids"]
    assert out["choices"][0]["token_ids"] == greedy("tiny-lora", ids, 5)
    streamed = []
    with httpx.stream("POST", tiny_server.base + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk["model"] == "tiny-lora"
                for c in chunk["choices"]:
                    streamed += c.get("token_ids") or []
    assert streamed == out["choices"][0]["token_ids"]


def test_an_unknown_model_stays_a_404(tiny_server):
    r = _post(tiny_server, "/v1/completions", {"model": "other-lora", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "'tiny-lora'" in err["message"]


def _beams(reference, name, prompt_ids, n, max_tokens):
    """The best beams' output ids of a plain beam search over transformers' logprobs of `name`'s merged model."""
    tok, _, models = reference
    eos = {tok.eos_token_id}
    best = Reference(models[name]).search(prompt_ids, n, max_tokens, eos)
    return [t[len(prompt_ids):-1] if t[-1] in eos else t[len(prompt_ids):] for t, _ in best]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "The quick brown fox"}),
                                       ("/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "The quick brown fox"}]})])
def test_beam_search_with_an_adapter_answers_its_beams(tiny_server, reference, path, body):
    """use_beam_search naming the adapter: every step runs with it, so the beams are the merged model's (and not
    the base model's, which the same request naming "tiny" answers)."""
    got = {}
    for model in ("tiny-lora", "tiny"):
        r = _post(tiny_server, path, {"model": model, "use_beam_search": True, "n": 3, "max_tokens": 5,
                                      "temperature": 0, "return_token_ids": True, **body})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["model"] == model
        prompt_ids = out["choices"][0]["prompt_token_ids"] if "prompt" in body else out["prompt_token_ids"]
        got[model] = [c["token_ids"] for c in out["choices"]]
        assert got[model] == _beams(reference, model, prompt_ids, 3, 5), model
    assert got["tiny-lora"] != got["tiny"]


def _lora_info(server) -> dict:
    text = httpx.get(server.base + "/metrics", timeout=30).text
    [line] = [x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{")]
    labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split('",'))
    return {k: v.strip('"') for k, v in labels.items()}


def test_metrics_name_the_running_adapters(tiny_server):
    """vLLM's vllm:lora_requests_info gauge (gateway routers read it for adapter affinity): max_lora, and the running
    and waiting requests' adapters by name (the engine's stats come with its outputs: one request first)."""
    assert _post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200
    idle = _lora_info(tiny_server)
    assert idle["running_lora_adapters"] == "" and idle["waiting_lora_adapters"] == "" and int(idle["max_lora"]) >= 1
    body = {"model": "tiny-lora", "prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", tiny_server.base + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(x for x in lines if x.startswith("data: "))  # the request runs
        busy = _lora_info(tiny_server)
    assert busy["running_lora_adapters"] == "tiny-lora", busy


def test_without_runtime_updating_the_load_and_unload_routes_do_not_exist(tiny_server):
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": tiny_server.lora_path}),
                       ("/v1/unload_lora_adapter", {"lora_name": "tiny-lora"})):
        r = _post(tiny_server, path, body)
        assert r.status_code == 404 and "no route" in r.json()["error"]["message"], r.text
    assert [m["id"] for m in httpx.get(tiny_server.base + "/v1/models", timeout=30).json()["data"]] == \
        ["tiny", "tiny-lora"]
