"""`voltllm run-batch -i IN.jsonl -o OUT.jsonl MODEL`: OpenAI batch files answered by the server's app in process, in
the input's order, refusals kept with their status; bad files refused by line before the model loads."""
from __future__ import annotations

import io
import json

import pytest

from tiny_models import make_model
from voltllm.config import ConfigError
from voltllm.entrypoints.openai.run_batch import read_batch


def _line(custom_id, url="/v1/completions", **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize("text,match", [
    ("{not json\n", "line 1: not JSON"),
    ("[1]\n", "line 1: expected an object"),
    (_line("a") + "\n" + _line("a") + "\n", "line 2: custom_id 'a' is used twice"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}), "method must be POST"),
    (_line("a", url="/classify"), "url '/classify' is not served in a batch"),
    (_line("a", url="/v3/rerank"), "url '/v3/rerank' is not served in a batch; one of: .*/v2/rerank"),
    (_line("a", stream=True), "cannot stream"),
    (_line("a", url="/v1/responses", input="x", background=True), "cannot run in the background"),
    (_line("a", url="/v1/embeddings", input="x", encoding_format="bytes"), "encoding_format 'bytes' answers with a "
                                                                             "binary body"),
    (_line("a", url="/v1/embeddings", input="x", encoding_format="bytes_only"), "use float or base64"),
    (json.dumps({"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}), "non-empty string"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}), "body must be"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}, "x": 1}), "unknown field"),
])
def test_bad_batch_files_are_refused_by_line(text, match):
    with pytest.raises(ConfigError, match=match):
        read_batch(io.StringIO(text), "in.jsonl")


def test_blank_lines_are_skipped():
    lines = read_batch(io.StringIO("\n" + _line("a", prompt="x") + "\n\n"), "in.jsonl")
    assert [(x.custom_id, x.url, x.body) for x in lines] == [("a", "/v1/completions", {"prompt": "x"})]


def test_a_bad_file_fails_before_the_model_loads(tmp_path, capsys):
    from voltllm.cli import main

    bad = tmp_path / "in.jsonl"
    bad.write_text(_line("a") + "\n" + _line("a") + "\n")
    # (a model path that does not exist: the file is refused first)
    assert main(["run-batch", "-i", str(bad), "-o", str(tmp_path / "out.jsonl"), "/nonexistent/model"]) == 2
    assert "voltllm: error: " in (err := capsys.readouterr().err) and "line 2: custom_id 'a' is used twice" in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("engines", [[], ["--data-parallel-size", "2"]], ids=["one-engine", "dp2"])
def test_run_batch_answers_in_order(tmp_path, engines):
    """(with -dp 2 the lines spread over two engine processes and still come back in the input's order)"""
    from voltllm.cli import main

    model = make_model(str(tmp_path / "tiny"), "llama")
    lines = [
        _line("chat", url="/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
              temperature=0),
        _line("refused", prompt="x", max_tokens=-3),
        _line("text", model="tiny", prompt="Hello there", max_tokens=3, temperature=0),
        _line("resp", url="/v1/responses", input="Hi", max_output_tokens=2),
        _line("unknown-model", model="other", prompt="x", max_tokens=1),
    ] + [_line(f"n{i}", prompt=f"p{i}", max_tokens=2) for i in range(12)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(src), "-o", str(out), model, "--device", "cpu", "--served-model-name", "tiny",
                 "--max-num-seqs", "2", *engines]) == 0
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [json.loads(x)["custom_id"] for x in lines]
    by_id = {r["custom_id"]: r for r in results}
    assert all(r["error"] is None and r["id"].startswith("batch_req_") for r in results)
    chat = by_id["chat"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert chat["body"]["usage"]["completion_tokens"] == 4 and chat["body"]["model"] == "tiny"
    refused = by_id["refused"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
    assert by_id["text"]["response"]["body"]["object"] == "text_completion"
    assert by_id["resp"]["response"]["body"]["object"] == "response"
    assert by_id["unknown-model"]["response"]["status_code"] == 404
    assert all(by_id[f"n{i}"]["response"]["body"]["usage"]["completion_tokens"] == 2 for i in range(12))


def test_run_batch_embeddings(tmp_path):
    """A pooling model's batch: /v1/embeddings lines answered as the pooling server answers them (a generation line
    gets its 404)."""
    from voltllm.cli import main

    model = make_model(str(tmp_path / "tiny"), "qwen3")
    lines = [_line("e1", url="/v1/embeddings", input="Hello there"),
             _line("e2", url="/v1/embeddings", input=["a b", "c"], encoding_format="float"),
             _line("gen", prompt="x", max_tokens=1)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(src), "-o", str(out), model, "--device", "cpu", "--runner", "pooling"]) == 0
    by_id = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    assert by_id["e1"]["status_code"] == 200 and len(by_id["e1"]["body"]["data"][0]["embedding"]) == 64
    assert [d["index"] for d in by_id["e2"]["body"]["data"]] == [0, 1]
    assert by_id["gen"]["status_code"] == 404 and "generates nothing" in by_id["gen"]["body"]["error"]["message"]


def test_run_batch_scores_and_reranks(tmp_path):
    """vLLM's run-batch score and rerank URLs on an embedding model: each line answered as the server answers it
    (the cosine of the two texts' embeddings, rerank order, a 400 kept with its status)."""
    import torch
    import torch.nn.functional as F

    from voltllm.cli import main

    model = make_model(str(tmp_path / "tiny"), "qwen3")
    query, docs = "What is the capital of France?", ["Paris is the capital of France.", "def add(a, b): return a + b"]
    lines = [_line("eq", url="/v1/embeddings", input=query), _line("ed", url="/v1/embeddings", input=docs)]
    lines += [_line(f"score{url}", url=url, text_1=query, text_2=docs) for url in ("/score", "/v1/score")]
    lines += [_line(f"rerank{url}", url=url, query=query, documents=docs)
              for url in ("/rerank", "/v1/rerank", "/v2/rerank")]
    lines.append(_line("bad", url="/v1/rerank", query=query, documents=docs, max_tokens_per_doc=-1))
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(src), "-o", str(out), model, "--device", "cpu", "--runner", "pooling"]) == 0
    by_id = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    q = torch.tensor(by_id["eq"]["body"]["data"][0]["embedding"])
    want = [F.cosine_similarity(q, torch.tensor(d["embedding"]), dim=0).item() for d in by_id["ed"]["body"]["data"]]
    for url in ("/score", "/v1/score"):
        r = by_id[f"score{url}"]
        assert r["status_code"] == 200 and r["body"]["object"] == "list" and r["body"]["id"].startswith("score-")
        assert [d["score"] for d in r["body"]["data"]] == pytest.approx(want, abs=1e-5)
    order = sorted(range(len(docs)), key=lambda i: want[i], reverse=True)
    for url in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = by_id[f"rerank{url}"]
        assert r["status_code"] == 200 and r["body"]["id"].startswith("rerank-"), r
        assert [x["index"] for x in r["body"]["results"]] == order
        assert [x["document"]["text"] for x in r["body"]["results"]] == [docs[i] for i in order]
    bad = by_id["bad"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "max_tokens_per_doc"


def test_run_batch_serves_lora_modules(tmp_path):
    """--lora-modules in a batch file's requests: a line naming the adapter runs with it (transformers' merged tokens),
    one naming the base model runs without."""
    import torch

    from lora_adapters import make_adapter, merged_model
    from voltllm.cli import main
    from voltllm.model.loader import load_tokenizer

    model = make_model(str(tmp_path / "tiny"), "llama")
    adapter = make_adapter(str(tmp_path / "lora"), model, rank=8)
    body = dict(prompt="The quick brown fox", max_tokens=4, temperature=0, ignore_eos=True, return_token_ids=True)
    src = tmp_path / "in.jsonl"
    src.write_text(_line("lora", model="sql", **body) + "\n" + _line("base", model="tiny", **body) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(src), "-o", str(out), model, "--device", "cpu", "--served-model-name", "tiny",
                 "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}"]) == 0
    results = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    ids = load_tokenizer(model).encode(body["prompt"])
    for name, path in (("lora", adapter), ("base", None)):
        with torch.no_grad():
            want = merged_model(model, path).generate(torch.tensor([ids]), max_new_tokens=4, min_new_tokens=4,
                                                      do_sample=False)[0, len(ids):].tolist()
        assert results[name]["choices"][0]["token_ids"] == want, name
    assert results["lora"]["model"] == "sql"
