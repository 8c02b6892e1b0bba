"""/v1/completions' prompt_embeds (vLLM's, with --enable-prompt-embeds): base64 of torch.save()d [tokens, hidden]
rows. Reference: the same prompt as token ids, whose rows are the checkpoint's own embedding matrix rows: the same
tokens and logprobs. Batches of embeddings with text prompts, truncate_prompt_tokens, and the 400s."""
from __future__ import annotations

import base64
import glob
import io
import os
from types import SimpleNamespace

import httpx
import pytest
import torch

from server_helpers import ServerProc, free_port
from tiny_models import make_model, make_tokenizer

IDS = [5, 17, 3, 60, 22, 9, 41, 8, 13, 77, 4]


def _b64(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def embeds_server(tmp_path_factory):
    from safetensors.torch import load_file

    path = make_model(str(tmp_path_factory.mktemp("tiny_embeds")), "llama")
    (weights,) = glob.glob(os.path.join(path, "*.safetensors"))
    table = load_file(weights)["model.embed_tokens.weight"].float()
    srv = ServerProc([path, "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--served-model-name",
                      "tiny", "--disable-log-stats", "--disable-uvicorn-access-log", "--enable-prompt-embeds"],
                     free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        yield SimpleNamespace(base=srv.base, table=table)
    finally:
        srv.stop()


def _complete(base: str, **body) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "logprobs": 1, "ignore_eos": True, **body}
    return httpx.post(base + "/v1/completions", json=body, timeout=60)


def _tokens(choice: dict) -> list:
    return choice["logprobs"]["tokens"], [round(x, 4) for x in choice["logprobs"]["token_logprobs"]]


def test_rows_of_the_ids_answer_as_the_ids(embeds_server):
    base, table = embeds_server.base, embeds_server.table
    want = _complete(base, prompt=IDS).json()
    got = _complete(base, prompt_embeds=_b64(table[IDS]))
    assert got.status_code == 200, got.text
    body = got.json()
    assert _tokens(body["choices"][0]) == _tokens(want["choices"][0])
    assert body["choices"][0]["text"] == want["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == len(IDS)
    # a batch of one ([1, tokens, hidden]) and fp16 rows are taken too
    fp16 = _complete(base, prompt_embeds=_b64(table[IDS][None].half()))
    assert fp16.status_code == 200 and fp16.json()["usage"]["prompt_tokens"] == len(IDS)


def test_streamed_and_n_choices(embeds_server):
    """A streamed answer's text is the non-streamed one's; n = 2 seeded samples from the rows equal those from the
    ids (each choice its own seed stream); a prompt longer than the context is the usual 400."""
    import json

    base, table = embeds_server.base, embeds_server.table
    want = _complete(base, prompt=IDS).json()["choices"][0]["text"]
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"model": "tiny", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
                            "prompt_embeds": _b64(table[IDS])}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    sampled = {"n": 2, "temperature": 1.0, "seed": 7, "logprobs": None}
    ids_texts = sorted(c["text"] for c in _complete(base, prompt=IDS, **sampled).json()["choices"])
    rows_texts = sorted(c["text"] for c in _complete(base, prompt_embeds=_b64(table[IDS]), **sampled).json()["choices"])
    assert rows_texts == ids_texts
    long = _complete(base, prompt_embeds=_b64(table[[5] * 9000]))
    assert long.status_code == 400 and "context length" in long.json()["error"]["message"]


def test_a_list_of_embeddings_with_text_prompts(embeds_server):
    """Choices of the embeddings come first, then the prompt's, each as it would alone (vLLM's order)."""
    base, table = embeds_server.base, embeds_server.table
    alone = [_tokens(_complete(base, prompt=p).json()["choices"][0]) for p in (IDS, IDS[:4], [9, 9, 1])]
    r = _complete(base, prompt_embeds=[_b64(table[IDS]), _b64(table[IDS[:4]])], prompt=[[9, 9, 1]])
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2] and [_tokens(c) for c in choices] == alone


def test_truncate_prompt_tokens_keeps_the_last_rows(embeds_server):
    base, table = embeds_server.base, embeds_server.table
    want = _tokens(_complete(base, prompt=IDS[-5:]).json()["choices"][0])
    r = _complete(base, prompt_embeds=_b64(table[IDS]), truncate_prompt_tokens=5)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 5 and _tokens(r.json()["choices"][0]) == want


@pytest.mark.parametrize("body,param,message", [
    ({"prompt_embeds": "not base64!"}, "prompt_embeds", "prompt_embeds is not valid base64"),
    ({"prompt_embeds": base64.b64encode(b"plain bytes").decode()}, "prompt_embeds",
     "prompt_embeds is not a torch.save()d tensor"),
    ({"prompt_embeds": "WIDE"}, "prompt_embeds", "prompt_embeds rows have 5 values; this model's hidden size is"),
    ({"prompt_embeds": "ROWS", "echo": True}, "echo", "echo is not supported with prompt_embeds"),
    ({"prompt_embeds": "ROWS", "prompt_logprobs": 1}, "prompt_logprobs",
     "prompt_logprobs is not supported with prompt_embeds"),
    ({"prompt_embeds": []}, "prompt_embeds", "prompt_embeds must not be an empty list"),
    ({}, "prompt", "give prompt (or prompt_embeds)"),
])
def test_bad_requests(embeds_server, body, param, message):
    rows = {"WIDE": _b64(torch.zeros(3, 5)), "ROWS": _b64(embeds_server.table[IDS])}
    body = {k: rows.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    r = _complete(embeds_server.base, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param, err


def test_chat_completions_refuse_them(embeds_server):
    r = httpx.post(embeds_server.base + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                         "prompt_embeds": _b64(embeds_server.table[IDS])})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds"
    assert "built for /v1/completions only" in r.json()["error"]["message"]


def test_without_the_flag_nothing_is_decoded(tmp_path, monkeypatch):
    """A server without --enable-prompt-embeds answers 400 before torch.load sees the request's bytes."""
    from starlette.testclient import TestClient

    from voltllm.engine import prompt_embeds
    from voltllm.entrypoints.openai.app import build_app
    from voltllm.entrypoints.openai.serving_common import ServerState

    def never(value):
        raise AssertionError("decoded without --enable-prompt-embeds")

    monkeypatch.setattr(prompt_embeds, "decode_base64_embeds", never)
    monkeypatch.setattr("voltllm.entrypoints.openai.serving_completion.decode_base64_embeds", never)
    tok = make_tokenizer(str(tmp_path / "tok"))
    engine = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), is_healthy=True, dead=None)
    state = ServerState(engine=engine, served_model_names=["m"], max_model_len=64, model_path="m")
    r = TestClient(build_app(state)).post("/v1/completions",
                                          json={"model": "m", "prompt_embeds": _b64(torch.zeros(2, 4))})
    assert r.status_code == 400 and "--enable-prompt-embeds" in r.json()["error"]["message"]
