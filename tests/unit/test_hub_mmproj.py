"""A vision-language GGUF model named owner/name:QUANT comes with its projector (mmproj) file, chosen among the repo's
as llama.cpp's -hf chooses it (voltllm/model/loader/hub.py fetch_projector, pick_projector). No network: a fake Hub
(tests/hub_fakes.py) serves tiny local repos; the engine-level cases use a tiny Qwen2.5-VL GGUF pair written as
convert_hf_to_gguf.py writes it (tests/gguf_files.py)."""
from __future__ import annotations

import logging
import os
import shutil

import pytest

pytest.importorskip("gguf")

from hub_fakes import FakeHub  # noqa: E402

from voltllm.config import ConfigError, EngineArgs  # noqa: E402
from voltllm.model.loader import hub, resolve_model  # noqa: E402

PROJECTORS = ("mmproj-BF16.gguf", "mmproj-F16.gguf", "mmproj-F32.gguf", "mmproj-Q8_0.gguf")


def test_the_projector_is_chosen_as_llama_cpp_chooses_it():
    """Nearest folder at or above the model's, then the closest quantization bits, then the first name."""
    pick = hub.pick_projector
    fp = ["mmproj-BF16.gguf", "mmproj-F16.gguf", "mmproj-F32.gguf"]
    assert pick(fp + ["m-Q4_K_M.gguf"], "m-Q4_K_M.gguf") == "mmproj-BF16.gguf"  # 16 bits both: the first name
    assert pick(fp + ["mmproj-Q8_0.gguf"], "m-Q4_K_M.gguf") == "mmproj-Q8_0.gguf"  # 8 bits: closest to 4
    assert pick(fp + ["mmproj-Q8_0.gguf"], "m-F32.gguf") == "mmproj-F32.gguf"
    assert pick(fp, "m-UD-Q8_K_XL.gguf") == "mmproj-BF16.gguf"  # (llama.cpp's own test: unsloth's names)
    assert pick(["mmproj-F32.gguf", "mmproj-F16.gguf"], "m-Q4_K_M.gguf") == "mmproj-F16.gguf"  # (not listing order)
    for name in ("mmproj-model-f16.gguf", "mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf", "Qwen3-VL-8B-mmproj-F16.gguf",
                 "MMPROJ-F16.gguf"):
        assert pick(["m-Q4_K_M.gguf", "README.md", name], "m-Q4_K_M.gguf") == name
    assert pick(["m-Q4_K_M.gguf", "README.md", "mmproj-F16.bin", "imatrix.gguf"], "m-Q4_K_M.gguf") is None
    # a split model in a folder per quantization: a projector in that folder before the top one, none from another
    split = "Q8_0/m-Q8_0-00001-of-00003.gguf"
    tree = ["mmproj-F16.gguf", "Q8_0/mmproj-F32.gguf", "BF16/mmproj-BF16.gguf", "BF16/m-BF16.gguf", split]
    assert pick(tree, split) == "Q8_0/mmproj-F32.gguf"
    assert pick([f for f in tree if f != "Q8_0/mmproj-F32.gguf"], split) == "mmproj-F16.gguf"
    assert pick(["BF16/mmproj-BF16.gguf"], split) is None
    assert pick(["Q8_0/mmproj-F16.gguf"], "m-Q8_0.gguf") is None  # (below the model's folder)


def _header_gguf(path: str, arch: str) -> None:
    """A GGUF file with its architecture alone (what decides whether a projector is fetched)."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """acme/vl-GGUF: a qwen2vl model (two quantizations) with four projectors; acme/text-GGUF: a qwen2 model with a
    projector file all the same; acme/bare-VL-GGUF: a qwen2vl model and no projector."""
    repos = {}
    for repo, arch, files in (("acme/vl-GGUF", "qwen2vl", PROJECTORS), ("acme/text-GGUF", "qwen2", PROJECTORS[:1]),
                              ("acme/bare-VL-GGUF", "qwen2vl", ())):
        src = tmp_path / "repos" / repo.replace("/", "--")
        src.mkdir(parents=True)
        for quant in ("Q4_K_M", "Q6_K"):
            _header_gguf(str(src / f"model-{quant}.gguf"), arch)
        for f in files:
            (src / f).write_bytes(b"GGUF projector " + f.encode())
        repos[repo] = str(src)
    return FakeHub(str(tmp_path / "hf-cache"), repos).install(monkeypatch)


def _downloads(fake):
    return [c["allow_patterns"] for c in fake.calls if not c["local_files_only"]]


def test_a_vision_model_brings_the_chosen_projector_alone(fake_hub):
    src = resolve_model("acme/vl-GGUF:Q4_K_M", token="hf_x", projector=True)
    snapshot = os.path.dirname(src.path)
    assert src.hub_repo == "acme/vl-GGUF" and src.mmproj == os.path.join(snapshot, "mmproj-Q8_0.gguf")
    assert sorted(os.listdir(snapshot)) == ["mmproj-Q8_0.gguf", "model-Q4_K_M.gguf"]  # that projector alone
    assert _downloads(fake_hub)[-1] == ["mmproj-Q8_0.gguf"] and fake_hub.calls[-1]["token"] == "hf_x"
    assert [c["token"] for c in fake_hub.listings] == ["hf_x"]
    fake_hub.calls.clear()
    fake_hub.listings.clear()
    assert resolve_model("acme/vl-GGUF:Q4_K_M", projector=True) == src  # a restart: all from the cache
    assert _downloads(fake_hub) == [] and fake_hub.listings == []


def test_the_projector_is_not_fetched_for_text_models_or_when_not_asked(fake_hub):
    src = resolve_model("acme/text-GGUF:Q4_K_M", projector=True)
    assert src.mmproj is None and fake_hub.listings == [] and len(_downloads(fake_hub)) == 1
    assert os.listdir(os.path.dirname(src.path)) == ["model-Q4_K_M.gguf"]
    src = resolve_model("acme/vl-GGUF:Q4_K_M")  # (projector=False: --mmproj, --no-mmproj, other callers)
    assert src.mmproj is None and fake_hub.listings == []
    assert os.listdir(os.path.dirname(src.path)) == ["model-Q4_K_M.gguf"]


def test_offline_a_cached_projector_is_used_and_a_missing_one_warned(fake_hub, caplog):
    resolve_model("acme/vl-GGUF:Q4_K_M")  # the model alone in the cache
    fake_hub.offline = True
    with caplog.at_level(logging.WARNING, logger="voltllm"):
        src = resolve_model("acme/vl-GGUF:Q4_K_M", projector=True)
    assert src.mmproj is None and os.path.isfile(src.path)
    [line] = [r.getMessage() for r in caplog.records]
    assert "OfflineModeIsEnabled" in line and "text only" in line and "--mmproj PATH" in line
    fake_hub.offline = False
    fetched = resolve_model("acme/vl-GGUF:Q4_K_M", projector=True).mmproj
    fake_hub.offline = True
    assert resolve_model("acme/vl-GGUF:Q4_K_M", projector=True).mmproj == fetched  # cached: no network needed


def test_a_vision_repo_without_a_projector_is_warned(fake_hub, caplog):
    with caplog.at_level(logging.WARNING, logger="voltllm"):
        src = resolve_model("acme/bare-VL-GGUF:Q6_K", projector=True)
    assert src.mmproj is None and os.path.isfile(src.path)
    [line] = [r.getMessage() for r in caplog.records]
    assert "holds no projector" in line and "acme/bare-VL-GGUF" in line


def test_the_real_hub_cache_gives_the_projector_offline(tmp_path, monkeypatch):
    """No fake: huggingface_hub's own cache layout and offline mode (HF_HUB_OFFLINE's constant)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--acme--vl-GGUF"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    _header_gguf(str(snap / "model-Q4_K_M.gguf"), "qwen2vl")
    src = resolve_model("acme/vl-GGUF:Q4_K_M", download_dir=str(tmp_path / "cache"), projector=True)
    assert src.mmproj is None and os.path.realpath(src.path) == os.path.realpath(snap / "model-Q4_K_M.gguf")
    (snap / "mmproj-F16.gguf").write_bytes(b"GGUF")
    src = resolve_model("acme/vl-GGUF:Q4_K_M", download_dir=str(tmp_path / "cache"), projector=True)
    assert os.path.realpath(src.mmproj) == os.path.realpath(snap / "mmproj-F16.gguf")


# --- through the engine: a real tiny Qwen2.5-VL pair -------------------------------------------------------------

@pytest.fixture(scope="module")
def vl_pair(tmp_path_factory) -> tuple[str, str]:
    """(a tiny Qwen2.5-VL GGUF language model, its projector), as llama.cpp's converter writes them."""
    pytest.importorskip("PIL")
    from gguf_files import use_qwen_pre_tokenizer, write_qwen2_vl_ggufs
    from vl_models import make_tiny_qwen2_5_vl

    root = str(tmp_path_factory.mktemp("vl"))
    hf = make_tiny_qwen2_5_vl(os.path.join(root, "hf"), "qwen2_5_vl", seed=0)
    use_qwen_pre_tokenizer(hf, "qwen2vl")
    lm, mmproj = os.path.join(root, "tiny-Q4_K_M.gguf"), os.path.join(root, "mmproj-F16.gguf")
    write_qwen2_vl_ggufs(hf, lm, mmproj)
    return lm, mmproj


@pytest.fixture
def vl_hub(tmp_path, monkeypatch, vl_pair):
    """acme/tiny-VL-GGUF: the pair's language model with four projector files (each the pair's projector)."""
    src = tmp_path / "repo"
    src.mkdir()
    shutil.copy(vl_pair[0], src / "tiny-Q4_K_M.gguf")
    for name in PROJECTORS:
        shutil.copy(vl_pair[1], src / name)
    return FakeHub(str(tmp_path / "hf-cache"), {"acme/tiny-VL-GGUF": str(src)}).install(monkeypatch)


def _config(**kw):
    return EngineArgs(model="acme/tiny-VL-GGUF:Q4_K_M", device="cpu", **kw).create_engine_config()


def test_the_engine_serves_images_with_the_fetched_projector(vl_hub):
    cfg = _config()
    assert os.path.basename(cfg.model.mmproj) == "mmproj-Q8_0.gguf"
    assert os.path.dirname(cfg.model.mmproj) == os.path.dirname(cfg.model.model)  # the same snapshot
    assert cfg.model.hf_config.model_type == "qwen2_5_vl" and cfg.model.served_model_name == "acme/tiny-VL-GGUF:Q4_K_M"


def test_mmproj_overrides_and_no_mmproj_skips(vl_hub, vl_pair, tmp_path):
    mine = str(tmp_path / "my-mmproj.gguf")
    shutil.copy(vl_pair[1], mine)
    cfg = _config(mmproj=mine)
    assert cfg.model.mmproj == mine and cfg.model.hf_config.model_type == "qwen2_5_vl"
    assert vl_hub.listings == [] and not any("mmproj" in os.path.basename(f)
                                             for f in os.listdir(os.path.dirname(cfg.model.model)))
    cfg = _config(no_mmproj=True)
    assert cfg.model.mmproj is None and cfg.model.hf_config.model_type == "qwen2" and vl_hub.listings == []
    assert _config(no_mmproj=True, mmproj=mine).model.mmproj == mine  # (as llama.cpp: --mmproj still loads)
    _config()  # the projector now in the snapshot: --no-mmproj does not take it either
    assert _config(no_mmproj=True).model.mmproj is None
    assert _config(language_model_only=True).model.mmproj is None


def test_no_mmproj_beside_a_local_file_and_with_a_directory(vl_pair, tmp_path):
    folder = tmp_path / "local"
    folder.mkdir()
    for f in vl_pair:
        shutil.copy(f, folder / os.path.basename(f))
    model = str(folder / os.path.basename(vl_pair[0]))
    assert EngineArgs(model=model, device="cpu").create_engine_config().model.mmproj is not None
    assert EngineArgs(model=model, device="cpu", no_mmproj=True).create_engine_config().model.mmproj is None
    hf = os.path.join(os.path.dirname(vl_pair[0]), "hf")
    with pytest.raises(ConfigError, match="--no-mmproj: a projector file goes with a GGUF model"):
        EngineArgs(model=hf, device="cpu", no_mmproj=True).create_engine_config()


def test_the_flags_parse():
    import argparse

    from voltllm.cli_args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    add_engine_args(p)
    ea = engine_args_from(p.parse_args(["acme/vl-GGUF:Q4_K_M", "--no-mmproj"]))
    assert ea.no_mmproj and ea.mmproj is None
    ea = engine_args_from(p.parse_args(["acme/vl-GGUF:Q4_K_M", "--mmproj", "/p/mmproj.gguf"]))
    assert not ea.no_mmproj and ea.mmproj == "/p/mmproj.gguf"
