"""LoRA adapters loaded and unloaded while the server runs (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter,
--allow-runtime-lora-updating): a loaded adapter serves completions, chat and streams with its weights (greedy tokens
of transformers' merged model) and is listed by /v1/models; unloaded, its name is a 404 and requests already running
with it finish with it; an in-place reload serves the new weights and none of the old load's cached blocks; bad input
is a 400 (a path with no adapter a 404) that changes nothing. (Without the flag the routes do not exist:
tests/server/test_lora_server.py.)"""
from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from lora_adapters import make_adapter, merged_model
from server_helpers import ServerProc, free_port
from tiny_models import make_model

PROMPT = "Hello world! Voltllm serves language models on old GPUs, fast."  # several full blocks of 4
FLIGHT = 200  # tokens of the request that runs across an unload


@pytest.fixture(scope="module")
def runtime_server(tmp_path_factory):
    """A tiny random llama with runtime updating on and a --lora-modules adapter, "tiny-lora" (one torch thread, as
    the other tiny servers)."""
    root = tmp_path_factory.mktemp("runtime")
    path = make_model(str(root / "tiny"), "llama")
    lora = make_adapter(str(root / "tiny-lora"), path, rank=8, alpha=16)
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny", "--enable-lora",
                      "--max-lora-rank", "8", "--max-loras", "2", "--allow-runtime-lora-updating", "--lora-modules",
                      f"tiny-lora={lora}", "--enable-prompt-tokens-details", "--disable-log-stats",
                      "--disable-uvicorn-access-log"], free_port(), env={"OMP_NUM_THREADS": "1"})
    srv.model_path, srv.lora_path = path, lora
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def adapters(runtime_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-loras")
    return {name: make_adapter(str(root / name), runtime_server.model_path, rank=4, alpha=8, seed=seed)
            for name, seed in (("d1", 21), ("d2", 22))}


def _post(server, path, body):
    return httpx.post(server.base + path, json=body, timeout=120)


def _load(server, name, path, **kw):
    return _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, **kw})


def _unload(server, name):
    return _post(server, "/v1/unload_lora_adapter", {"lora_name": name})


def _models(server) -> dict:
    return {m["id"]: m for m in httpx.get(server.base + "/v1/models", timeout=30).json()["data"]}


def _complete(server, model, max_tokens=6, prompt=PROMPT):
    r = _post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _running_adapters(server) -> str:
    """vllm:lora_requests_info's running_lora_adapters label (the engine's stats of its latest step)."""
    text = httpx.get(server.base + "/metrics", timeout=30).text
    [line] = [x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{")]
    return line.split('running_lora_adapters="', 1)[1].split('"', 1)[0]


def _greedy(server, adapter_path, ids, n):
    """transformers' greedy tokens with the adapter (as its files are now) merged into the base weights."""
    with torch.no_grad():
        out = merged_model(server.model_path, adapter_path).generate(torch.tensor([ids]), max_new_tokens=n,
                                                                      min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_load_use_list_and_unload(runtime_server, adapters):
    server = runtime_server
    r = _load(server, "dyn", adapters["d1"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'dyn' added successfully.", r.text
    card = _models(server)["dyn"]
    assert card["root"] == adapters["d1"] and card["parent"] == "tiny" and card["object"] == "model"
    assert httpx.get(server.base + "/v1/models/dyn", timeout=30).json() == card
    ids, tokens, _ = _complete(server, "dyn")
    assert tokens == _greedy(server, adapters["d1"], ids, 6)
    assert _complete(server, "tiny")[1] != tokens  # (the adapter changes the output)
    # chat, streamed and not
    body = {"model": "dyn", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["model"] == "dyn", r.text
    out = r.json()
    assert out["choices"][0]["token_ids"] == _greedy(server, adapters["d1"], out["prompt_token_ids"], 5)
    streamed = []
    with httpx.stream("POST", server.base + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c.get("token_ids") or []
    assert streamed == out["choices"][0]["token_ids"]
    # a second load of the name is refused unless in place
    r = _load(server, "dyn", adapters["d2"])
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"], r.text
    assert _models(server)["dyn"]["root"] == adapters["d1"]
    r = _unload(server, "dyn")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'dyn' removed successfully.", r.text
    assert "dyn" not in _models(server)
    assert httpx.get(server.base + "/v1/models/dyn", timeout=30).status_code == 404
    for path, req in (("/v1/completions", {"prompt": "hi"}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(server, path, {"model": "dyn", "max_tokens": 1, **req})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = _unload(server, "dyn")
    assert r.status_code == 404 and "'dyn' is not loaded" in r.json()["error"]["message"], r.text


def test_a_lora_modules_adapter_unloads_and_loads_back(runtime_server):
    server = runtime_server
    r = _unload(server, "tiny-lora")
    assert r.status_code == 200, r.text
    assert list(_models(server)) == ["tiny"]
    assert _post(server, "/v1/completions", {"model": "tiny-lora", "prompt": "hi", "max_tokens": 1}).status_code == 404
    assert _load(server, "tiny-lora", server.lora_path).status_code == 200
    ids, tokens, _ = _complete(server, "tiny-lora")
    assert tokens == _greedy(server, server.lora_path, ids, 6)
    assert list(_models(server)) == ["tiny", "tiny-lora"]


def test_a_request_running_during_the_unload_finishes_with_the_adapter(runtime_server, adapters):
    server = runtime_server
    assert _load(server, "flight", adapters["d2"]).status_code == 200
    body = {"model": "flight", "prompt": PROMPT, "max_tokens": FLIGHT, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    tokens, finish, prompt_ids = [], None, None
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=120) as s:
        lines = s.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])["choices"][0]
                prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
                tokens += chunk.get("token_ids") or []
                break
        assert _running_adapters(server) == "flight"  # (it has not finished)
        r = _unload(server, "flight")  # the request runs on
        assert r.status_code == 200, r.text
        assert _post(server, "/v1/completions", {"model": "flight", "prompt": "hi", "max_tokens": 1}).status_code \
            == 404
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])["choices"][0]
                prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
                tokens += chunk.get("token_ids") or []
                finish = chunk.get("finish_reason") or finish
    assert finish == "length" and len(tokens) == FLIGHT
    assert tokens == _greedy(server, adapters["d2"], prompt_ids, FLIGHT)
    assert _running_adapters(server) == ""
    # the engine took the unload after the request: the base model and other adapters run on
    ids, base, _ = _complete(server, "tiny")
    assert base == _greedy(server, None, ids, 6)


def test_an_in_place_reload_serves_the_new_weights_and_none_of_the_old_blocks(runtime_server, adapters, tmp_path):
    server = runtime_server
    assert _load(server, "swap", adapters["d1"]).status_code == 200
    ids, old, _ = _complete(server, "swap")
    _, again, cached = _complete(server, "swap")
    assert again == old and cached > 0  # its prompt's blocks are cached
    r = _load(server, "swap", adapters["d2"], load_inplace=True)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'swap' added successfully.", r.text
    assert _models(server)["swap"]["root"] == adapters["d2"]
    _, new, cached = _complete(server, "swap")
    assert new == _greedy(server, adapters["d2"], ids, 6) != old and cached == 0
    # new files at the same path, reloaded in place: the new weights, no block of the old ones
    path = make_adapter(str(tmp_path / "same"), server.model_path, rank=4, alpha=8, seed=31)
    assert _load(server, "same", path).status_code == 200
    _, first, _ = _complete(server, "same")
    assert _complete(server, "same")[2] > 0
    make_adapter(path, server.model_path, rank=4, alpha=8, seed=32)
    assert _load(server, "same", path, load_inplace=True).status_code == 200
    _, second, cached = _complete(server, "same")
    assert second == _greedy(server, path, ids, 6) != first and cached == 0
    for name in ("swap", "same"):
        assert _unload(server, name).status_code == 200


def test_bad_loads_and_unloads_are_refused_and_change_nothing(runtime_server, adapters, tmp_path):
    server = runtime_server
    before = _models(server)
    empty = tmp_path / "empty"
    empty.mkdir()
    wide = make_adapter(str(tmp_path / "wide"), server.model_path, rank=16, targets=("q_proj",))
    odd = make_adapter(str(tmp_path / "odd"), server.model_path, rank=4, targets=("q_proj",), extra_tensors={
        "base_model.model.model.layers.0.mlp.foo.lora_A.weight": torch.zeros(4, 8),
        "base_model.model.model.layers.0.mlp.foo.lora_B.weight": torch.zeros(8, 4)})
    d1 = adapters["d1"]
    cases = [
        ("/v1/load_lora_adapter", {"lora_path": d1}, 400, "lora_name", "Field required"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", "Field required"),
        ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": d1}, 400, "lora_name", "must be given"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "nope")}, 404, "lora_path",
         "no such directory"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(empty)}, 404, "lora_path",
         "no adapter_config.json"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": wide}, 400, "lora_path",
         "LoRA rank 16 is greater than --max-lora-rank 8"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": odd}, 400, "lora_path", "mlp.foo is not built"),
        ("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": d1}, 400, "lora_name", "served model name"),
        # (the flag is taken: the reader tells an adapter's form from its weights, and checks it as ever)
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": odd, "is_3d_lora_weight": True}, 400, "lora_path",
         "mlp.foo is not built"),
        ("/v1/load_lora_adapter", {"lora_name": "tiny-lora", "lora_path": wide, "load_inplace": True}, 400,
         "lora_path", "greater than --max-lora-rank"),
        ("/v1/unload_lora_adapter", {}, 400, "lora_name", "Field required"),
        ("/v1/unload_lora_adapter", {"lora_name": ""}, 400, "lora_name", "must be given"),
        ("/v1/unload_lora_adapter", {"lora_name": "x", "lora_int_id": 1}, 404, "lora_name", "not loaded"),
    ]
    for path, body, status, param, words in cases:
        r = _post(server, path, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (body, err)
    assert _models(server) == before
    ids, tokens, _ = _complete(server, "tiny-lora")  # the failed in-place reload left it as it was
    assert tokens == _greedy(server, server.lora_path, ids, 6)
    assert not os.path.exists(str(tmp_path / "nope"))
