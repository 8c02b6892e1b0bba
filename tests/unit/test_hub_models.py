"""Models named by a Hugging Face Hub repo id (voltllm/model/loader/hub.py). No network here: huggingface_hub's
snapshot_download is replaced by a fake "hub" that serves tiny local repos and records what it was asked."""
from __future__ import annotations

import os
import shutil

import pytest

from hub_fakes import FakeHub

from voltllm.config import ConfigError, EngineArgs
from voltllm.model.loader import ModelLoadError, hub, resolve_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tiny_models import make_model

    return make_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def fake_hub(tmp_path, tiny_model, monkeypatch):
    import huggingface_hub

    gguf_repo = tmp_path / "gguf-repo"
    gguf_repo.mkdir()
    (gguf_repo / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    (gguf_repo / "README.md").write_text("quantizations")
    fake = FakeHub(str(tmp_path / "hf-cache"), {"acme/tiny": tiny_model, "acme/tiny-GGUF": str(gguf_repo)})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return fake


def test_repo_ids_are_told_from_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.looks_like_repo_id("Qwen/Qwen3-8B") and hub.looks_like_repo_id("gpt2")
    for local in ("./Qwen/Qwen3-8B", "/models/qwen", "~/models/qwen", "a/b/c", "model.gguf", "Qwen/Qwen3-8B.gguf",
                  "bad name/x", ""):
        assert not hub.looks_like_repo_id(local), local
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "tiny").mkdir()
    assert not hub.looks_like_repo_id("acme/tiny")  # an existing directory wins over the Hub


def test_a_repo_id_is_fetched_once_then_used_offline(fake_hub, tiny_model):
    src = resolve_model("acme/tiny", revision="v1", token="hf_x")
    assert src.kind == "hf" and os.path.isfile(os.path.join(src.path, "config.json"))
    first, second = fake_hub.calls
    assert first["local_files_only"] and not second["local_files_only"]  # cache first, then the download
    assert second["revision"] == "v1" and second["token"] == "hf_x" and "*.safetensors" in second["allow_patterns"]
    assert "*.py" not in second["allow_patterns"]  # no remote code unless trusted
    assert sorted(os.listdir(src.path)) == sorted(f for f in os.listdir(tiny_model) if not f.endswith(".py"))
    fake_hub.calls.clear()
    assert resolve_model("acme/tiny", revision="v1").path == src.path
    assert [c["local_files_only"] for c in fake_hub.calls] == [True]  # cached: no network
    resolve_model("acme/tiny", revision="v1", trust_remote_code=True)
    assert "*.py" in fake_hub.calls[-1]["allow_patterns"]


def test_engine_serves_a_repo_id_under_that_name(fake_hub, tmp_path):
    cfg = EngineArgs(model="acme/tiny", device="cpu", download_dir=str(tmp_path / "dl")).create_engine_config()
    assert cfg.model.served_model_name == "acme/tiny"
    assert cfg.model.model.startswith(str(tmp_path / "dl")) and cfg.model.tokenizer == cfg.model.model
    assert all(c["cache_dir"] == str(tmp_path / "dl") for c in fake_hub.calls)


def test_tokenizer_from_the_hub_and_its_revision(fake_hub, tiny_model):
    cfg = EngineArgs(model=tiny_model, tokenizer="acme/tiny", tokenizer_revision="t2",
                     device="cpu").create_engine_config()
    call = fake_hub.calls[-1]
    assert call["repo_id"] == "acme/tiny" and call["revision"] == "t2"
    assert "*.safetensors" not in call["allow_patterns"]  # tokenizer files only
    assert cfg.model.tokenizer.endswith("t2") and cfg.model.model == tiny_model
    with pytest.raises(ConfigError, match="--tokenizer-revision"):
        EngineArgs(model=tiny_model, tokenizer_revision="t2", device="cpu").create_engine_config()


def _hub_error(cls):
    """One of huggingface_hub's HTTP errors without an HTTP response (their constructors want one, whose class
    differs between huggingface_hub versions); the loader only looks at the type."""
    err = cls.__new__(cls)
    Exception.__init__(err, "boom")
    return err


@pytest.mark.parametrize("error,match", [
    ("RepositoryNotFoundError", "neither a local path nor a repository"),
    ("GatedRepoError", "gated"),
    ("RevisionNotFoundError", "revision 'v9' not found"),
    (ConnectionError("no route to host"), "fetching it from the Hugging Face Hub failed: ConnectionError"),
])
def test_hub_failures_are_clear_errors(fake_hub, error, match):
    import huggingface_hub.errors as E

    fake_hub.error = _hub_error(getattr(E, error)) if isinstance(error, str) else error
    with pytest.raises(ModelLoadError, match=match):
        resolve_model("acme/absent", revision="v9")


def test_a_gguf_repo_asks_for_one_file(fake_hub):
    with pytest.raises(ModelLoadError, match="acme/tiny-GGUF:Q4_K_M, or download the .gguf you want"):
        resolve_model("acme/tiny-GGUF")


def test_one_gguf_file_of_a_repo_by_its_quantization(fake_hub, tmp_path):
    """owner/name:QUANT (vLLM's form) fetches that one file, whatever the letter case; a cached snapshot without
    it is completed from the Hub; a quantization the repo lacks is a clear error."""
    assert hub.gguf_quant_ref("acme/tiny-GGUF:Q4_K_M") == ("acme/tiny-GGUF", "Q4_K_M")
    for other in ("acme/tiny-GGUF", "acme/tiny:Q4-K", "/models/x.gguf:Q4_K_M", "a/b/c:Q8_0", ":Q8_0"):
        assert hub.gguf_quant_ref(other) is None, other
    src = resolve_model("acme/tiny-GGUF:q4_k_m", token="hf_x")
    assert src.kind == "gguf" and src.path.endswith("model-Q4_K_M.gguf")
    assert os.listdir(os.path.dirname(src.path)) == ["model-Q4_K_M.gguf"]  # that file only
    assert "*[-._]Q4_K_M.gguf" in fake_hub.calls[-1]["allow_patterns"] and fake_hub.calls[-1]["token"] == "hf_x"
    with pytest.raises(ModelLoadError, match="has no .gguf model named \\*Q8_0.gguf"):
        resolve_model("acme/tiny-GGUF:Q8_0")  # the cached snapshot lacks it, and so does the repo
    assert [c["local_files_only"] for c in fake_hub.calls[-2:]] == [True, False]


def test_a_quantization_tag_is_matched_whole(fake_hub, tmp_path):
    """:F16 fetches model-F16.gguf alone: not model-BF16.gguf (which ends in the same letters and would make two
    models), nor a projector with the same tag (fetch_projector chooses projectors)."""
    repo = tmp_path / "gguf-repo"
    for name in ("model-F16.gguf", "model-BF16.gguf", "mmproj-F16.gguf", "MMPROJ-model.F16.gguf"):
        (repo / name).write_bytes(b"GGUF")
    src = resolve_model("acme/tiny-GGUF:F16")
    assert src.path.endswith("model-F16.gguf") and os.listdir(os.path.dirname(src.path)) == ["model-F16.gguf"]
    assert resolve_model("acme/tiny-GGUF:BF16").path.endswith("model-BF16.gguf")


def test_a_split_gguf_of_a_repo_by_its_quantization(fake_hub, tmp_path):
    """A big model comes split by gguf-split, often in a folder per quantization: all its parts are fetched (no other
    quantization) and the model is named by its first part; a part that did not come is a clear error."""
    folder = tmp_path / "gguf-repo" / "Q8_0"
    folder.mkdir()
    for i in (1, 2, 3):
        (folder / f"model-Q8_0-0000{i}-of-00003.gguf").write_bytes(b"GGUF")
    src = resolve_model("acme/tiny-GGUF:Q8_0")
    assert src.kind == "gguf" and src.path.endswith(os.path.join("Q8_0", "model-Q8_0-00001-of-00003.gguf"))
    assert sorted(os.listdir(os.path.dirname(src.path))) == [f"model-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(src.path)), "model-Q4_K_M.gguf"))
    os.remove(src.path.replace("00001-of", "00002-of"))  # a part missing from the cache is fetched again
    assert resolve_model("acme/tiny-GGUF:Q8_0").path == src.path and os.path.isfile(src.path.replace("1-of", "2-of"))
    assert [c["local_files_only"] for c in fake_hub.calls[-2:]] == [True, False]
    os.remove(src.path.replace("00001-of", "00002-of"))
    (folder / "model-Q8_0-00002-of-00003.gguf").unlink()  # and one the repo lacks is a clear error
    with pytest.raises(ModelLoadError, match="lacks 1 of its 3 files: model-Q8_0-00002-of-00003.gguf"):
        resolve_model("acme/tiny-GGUF:Q8_0")


def test_hub_flags_parse():
    import argparse

    from voltllm.cli_args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    add_engine_args(p)
    ea = engine_args_from(p.parse_args(["Qwen/Qwen3-8B", "--revision", "abc", "--tokenizer-revision", "t",
                                        "--download-dir", "/d", "--hf-token"]))
    assert (ea.model, ea.revision, ea.tokenizer_revision, ea.download_dir, ea.hf_token) == (
        "Qwen/Qwen3-8B", "abc", "t", "/d", True)
    assert engine_args_from(p.parse_args(["m", "--hf-token", "hf_abc"])).hf_token == "hf_abc"


def _hub_cache_with(cache, repo_id: str, src: str, revision: str = "main") -> str:
    """huggingface_hub's own cache layout (models--owner--name/{refs,snapshots}) holding a copy of src, as a
    finished download leaves it; returns the snapshot directory."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    shutil.copytree(src, snap, ignore=shutil.ignore_patterns("*.py"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", revision), "w") as f:
        f.write(commit)
    return snap


def test_the_real_hub_cache_is_used_offline(tmp_path, tiny_model):
    """No fake: huggingface_hub resolves a repo id from its cache layout without the network."""
    snap = _hub_cache_with(str(tmp_path / "cache"), "acme/tiny", tiny_model)
    src = resolve_model("acme/tiny", download_dir=str(tmp_path / "cache"))
    assert os.path.realpath(src.path) == os.path.realpath(snap) and src.kind == "hf"


def test_generate_cli_runs_a_cached_repo_id(tmp_path, tiny_model):
    """`voltllm generate PROMPT owner/name --download-dir D` end to end in a subprocess, offline (the repo is in the
    cache; HF_HUB_OFFLINE makes any network attempt an error)."""
    import subprocess
    import sys

    _hub_cache_with(str(tmp_path / "cache"), "acme/tiny", tiny_model)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "voltllm.cli", "generate", "hello", "acme/tiny", "--max-tokens", "4",
                        "--device", "cpu", "--download-dir", str(tmp_path / "cache")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "voltllm.cli", "generate", "hello", "acme/absent", "--device", "cpu",
                        "--download-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode != 0 and "acme/absent" in r.stderr and "Traceback" not in r.stderr


def test_a_speculators_head_repo_as_the_model(fake_hub, tiny_model, tmp_path):
    """--model naming a speculators EAGLE-3 head on the Hub (as RedHatAI/*-speculator.eagle3): the head's repo is
    fetched as a model's is, then the verifier its config names (another repo) is served under that name, the head
    as drafter with its drafts per step (engine/speculators.py)."""
    import json

    from eagle3_models import make_eagle3, to_speculators

    with open(os.path.join(tiny_model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    head = make_eagle3(str(tmp_path / "head"), 64, vocab, layer_ids=[1, 2])
    fake_hub.repos["acme/tiny-speculator.eagle3"] = to_speculators(head, str(tmp_path / "spec-head"), "acme/tiny",
                                                                   tiny_model, speculative_tokens=2)
    dl = str(tmp_path / "dl")
    cfg = EngineArgs(model="acme/tiny-speculator.eagle3", device="cpu", download_dir=dl).create_engine_config()
    assert cfg.model.served_model_name == "acme/tiny" and cfg.model.model.startswith(dl)
    assert cfg.speculative.method == "eagle3" and cfg.speculative.num_speculative_tokens == 2
    assert cfg.speculative.model.startswith(dl) and "speculator" in cfg.speculative.model
    assert {c["repo_id"] for c in fake_hub.calls} == {"acme/tiny-speculator.eagle3", "acme/tiny"}
