"""--ignore-patterns and --pt-load-map-location (voltllm/model/loader/load_options.py): the files left out are neither
fetched from the Hub nor read from disk, end to end through the engine; torch.load gets the map location."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hub_fakes import FakeHub

from voltllm.config import ConfigError, EngineArgs
from voltllm.model.loader import ModelLoadError, resolve_model
from voltllm.model.loader.load_options import DEFAULT_IGNORE_PATTERNS, ignore_patterns_of, map_location_of
from voltllm.model.loader.safetensors_loader import safetensors_weights


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tiny_models import make_model

    return make_model(str(tmp_path_factory.mktemp("tiny")))


def test_flag_values():
    assert ignore_patterns_of(None) == ignore_patterns_of([]) == DEFAULT_IGNORE_PATTERNS == ("original/*",)
    assert ignore_patterns_of(["*.bin", " extra/* "]) == ("*.bin", "extra/*")
    assert ignore_patterns_of("consolidated.safetensors") == ("consolidated.safetensors",)
    for bad, message in (([""], "an empty pattern"), ([3], "expected glob patterns"), (7, "expected glob patterns")):
        with pytest.raises(ValueError, match=message):
            ignore_patterns_of(bad)
    assert map_location_of(None) == map_location_of("cpu") == "cpu"
    assert map_location_of("cuda:1") == "cuda:1"
    assert map_location_of('{"cuda:1": "cuda:0"}') == map_location_of({"cuda:1": "cuda:0"}) == {"cuda:1": "cuda:0"}
    for bad, message in (("gpu0", "'gpu0' is not a device"), ('{"cuda:1": 0}', "expected a device name"),
                         ('{"cuda:1": "cuda:0"', "not valid JSON"), ({"cuda:x": "cpu"}, "'cuda:x' is not a device"),
                         (3, "expected a device name")):
        with pytest.raises(ValueError, match=message):
            map_location_of(bad)


def test_bad_values_are_config_errors(tiny_model):
    with pytest.raises(ConfigError, match="--ignore-patterns: an empty pattern"):
        EngineArgs(model=tiny_model, device="cpu", ignore_patterns=[""]).create_engine_config()
    with pytest.raises(ConfigError, match="--pt-load-map-location: 'gpu' is not a device"):
        EngineArgs(model=tiny_model, device="cpu", pt_load_map_location="gpu").create_engine_config()


def test_hub_fetch_leaves_the_ignored_files_out(tmp_path, tiny_model, monkeypatch):
    import huggingface_hub

    repo = tmp_path / "repo"
    shutil.copytree(tiny_model, repo)
    (repo / "original").mkdir()
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(repo / "original" / "consolidated.safetensors"))
    (repo / "original" / "params.json").write_text("{}")
    (repo / "notes.txt").write_text("extra")
    fake = FakeHub(str(tmp_path / "hf-cache"), {"acme/tiny": str(repo)})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)

    default = resolve_model("acme/tiny", revision="a")  # vLLM's default: Meta's original/ copies stay on the Hub
    assert not os.path.exists(os.path.join(default.path, "original"))
    assert os.path.isfile(os.path.join(default.path, "notes.txt"))
    assert fake.calls[-1]["ignore_patterns"] == ["original/*"]
    assert default.ignore_patterns == DEFAULT_IGNORE_PATTERNS

    mine = resolve_model("acme/tiny", revision="b", ignore_patterns=("*.txt",))  # given patterns replace the default
    assert not os.path.exists(os.path.join(mine.path, "notes.txt"))
    assert os.path.isfile(os.path.join(mine.path, "original", "params.json"))
    assert mine.ignore_patterns == ("*.txt",)


def _split_into_shards(src: str, dst: str) -> dict:
    """A copy of the tiny model with its weights in two shards, plus a junk shard that would break the load."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(weights)
    save_file({n: weights[n] for n in names[::2]}, os.path.join(dst, "model-00001-of-00002.safetensors"))
    save_file({n: weights[n] for n in names[1::2]}, os.path.join(dst, "model-00002-of-00002.safetensors"))
    save_file({names[0]: torch.full((3, 5), float("nan"))}, os.path.join(dst, "zz-stale-export.safetensors"))
    return weights


def test_ignored_files_are_not_read(tmp_path, tiny_model):
    path = str(tmp_path / "sharded")
    weights = _split_into_shards(tiny_model, path)
    read = dict(safetensors_weights(path, ignore=("zz-*",)))
    assert sorted(read) == sorted(weights) and all(torch.equal(read[n], weights[n]) for n in weights)
    assert len(list(safetensors_weights(path))) == len(weights) + 1  # without the pattern the junk is read too
    with pytest.raises(ModelLoadError, match=r"no \.safetensors .*--ignore-patterns \*\.safetensors left out those"):
        list(safetensors_weights(path, ignore=("*.safetensors",)))


def test_engine_loads_without_the_ignored_shard(tmp_path, tiny_model):
    from voltllm import LLM, SamplingParams

    path = str(tmp_path / "sharded")
    _split_into_shards(tiny_model, path)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = {"prompt_token_ids": [5, 9, 17, 30, 41]}
    kw = dict(device="cpu", max_model_len=64, num_gpu_blocks_override=16)
    want = LLM(model=tiny_model, **kw).generate([prompt], params)[0].outputs[0].token_ids
    with pytest.raises(Exception, match="shape|size"):  # the junk shard's tensor does not fit the model
        LLM(model=path, **kw)
    got = LLM(model=path, ignore_patterns=["zz-*"], **kw).generate([prompt], params)[0].outputs[0].token_ids
    assert got == want


def test_pt_checkpoints_load_through_the_map_location(tmp_path, monkeypatch):
    path = tmp_path / "bin"
    path.mkdir()
    torch.save({"w": torch.arange(6.0).reshape(2, 3)}, str(path / "pytorch_model.bin"))
    seen = []
    real_load = torch.load

    def recording_load(f, map_location=None, **kw):
        seen.append(map_location)
        return real_load(f, map_location=map_location, **kw)

    monkeypatch.setattr(torch, "load", recording_load)
    (name, t), = safetensors_weights(str(path), map_location={"cuda:7": "cpu"})
    assert name == "w" and t.device.type == "cpu" and torch.equal(t, torch.arange(6.0).reshape(2, 3))
    assert seen == [{"cuda:7": "cpu"}]
    list(safetensors_weights(str(path)))
    assert seen[-1] == "cpu"
