"""Configuration on GPUs without bf16 (V100 sm_70, T4 sm_75) and below the minimum (P100 sm_60 / P40 sm_61), with
the compute capability faked on the CPU: what dtype, route and KV cache dtype resolve to, and what is refused."""
from __future__ import annotations

import json
import logging
import os
import types

import pytest
import torch

from tiny_models import make_model
from voltllm.config import ConfigError, EngineArgs


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> str:
    """A tiny qwen3 whose config says bfloat16 (as most released checkpoints do)."""
    path = make_model(str(tmp_path_factory.mktemp("bf16") / "tiny"), kind="qwen3")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


def fake_gpu(monkeypatch, cap: tuple[int, int], name: str) -> None:
    """A visible CUDA device of compute capability cap (what the configuration asks torch.cuda)."""
    props = types.SimpleNamespace(major=cap[0], minor=cap[1], name=name, multi_processor_count=80,
                                  total_memory=16 << 30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_70", "sm_75", "sm_80", "sm_90"])


def config(model: str, **kw):
    return EngineArgs(model=model, max_model_len=256, **kw).create_engine_config()


@pytest.mark.parametrize("cap,name", [((7, 0), "Tesla V100-SXM2-32GB"), ((7, 5), "Tesla T4")])
def test_bf16_checkpoint_runs_fp16_below_sm80_whatever_compat(bf16_model, monkeypatch, cap, name):
    """torch has no bf16 SDPA kernels below sm_80: --compat none there must not pick bf16 either."""
    fake_gpu(monkeypatch, cap, name)
    for compat in ("auto", "none", f"sm{cap[0]}{cap[1]}"):
        assert config(bf16_model, compat=compat).model.dtype == torch.float16, compat
    assert config(bf16_model, compat="none", dtype="float32").model.dtype == torch.float32


@pytest.mark.parametrize("compat", ["auto", "none", "sm70"])
def test_explicit_bf16_refused_below_sm80(bf16_model, monkeypatch, compat):
    fake_gpu(monkeypatch, (7, 0), "Tesla V100-SXM2-32GB")
    with pytest.raises(ConfigError, match=r"--dtype bfloat16: .*no bf16; use --dtype half \(or float32\)"):
        config(bf16_model, compat=compat, dtype="bfloat16")


def test_bf16_kept_on_sm80_and_refused_on_a_forced_compat_route(bf16_model, monkeypatch):
    fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    assert config(bf16_model).model.dtype == torch.bfloat16
    assert config(bf16_model, dtype="bfloat16").model.dtype == torch.bfloat16
    assert config(bf16_model, compat="sm70").model.dtype == torch.float16
    with pytest.raises(ConfigError, match="the sm70 route has no bf16; use --dtype half"):
        config(bf16_model, compat="sm70", dtype="bfloat16")


def test_bf16_checkpoint_as_fp16_is_logged_once(bf16_model, monkeypatch, caplog):
    fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    with caplog.at_level(logging.INFO, logger="voltllm"):
        config(bf16_model)
    said = [r for r in caplog.records if "bfloat16" in r.getMessage() and "float16" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "--dtype float32" in said[0].getMessage() and "sm75 route" in said[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="voltllm"):
        config(bf16_model, dtype="half")  # asked for: nothing to say
    assert not [r for r in caplog.records if "--dtype float32" in r.getMessage()]


@pytest.mark.parametrize("cap,name", [((6, 0), "Tesla P100-PCIE-16GB"), ((6, 1), "Tesla P40")])
def test_gpus_below_sm70_are_refused(bf16_model, monkeypatch, cap, name):
    fake_gpu(monkeypatch, cap, name)
    for compat in ("auto", "none", "sm75"):
        with pytest.raises(ConfigError, match=rf"{name} \(sm_{cap[0]}{cap[1]}\) is not supported: .*sm_70.*"
                                              r"--device cpu"):
            config(bf16_model, compat=compat)


def test_cli_check_reports_an_unsupported_gpu(bf16_model, monkeypatch, capsys):
    from voltllm.cli import main

    fake_gpu(monkeypatch, (6, 1), "Tesla P40")
    assert main(["check", bf16_model, "--no-load"]) == 2
    assert "Tesla P40 (sm_61) is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("compat", ["sm70", "sm75"])
def test_forced_compat_route_on_the_cpu_is_refused(bf16_model, compat):
    with pytest.raises(ConfigError, match=rf"--compat {compat} selects a GPU kernel route, but the device is the CPU"):
        config(bf16_model, device="cpu", compat=compat)
    for fine in ("auto", "none"):
        assert config(bf16_model, device="cpu", compat=fine).device.compat == "none"


def test_bf16_kv_cache_on_the_compat_route_names_the_route(bf16_model, monkeypatch):
    fake_gpu(monkeypatch, (7, 0), "Tesla V100-SXM2-32GB")
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype bfloat16: the sm70 route has no bf16 .*use auto"):
        config(bf16_model, kv_cache_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype bfloat16: this GPU \(sm_70, below sm_80\) has no bf16"):
        config(bf16_model, compat="none", kv_cache_dtype="bfloat16")
    assert config(bf16_model, kv_cache_dtype="float16").cache.kv_cache_dtype == "float16"
    assert config(bf16_model, kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"


def test_engine_start_refuses_a_torch_build_without_the_gpus_arch(bf16_model, monkeypatch, capsys):
    """A V100 under a torch build that ships no sm_70 kernels (a CUDA 12.8 build): refused before anything loads,
    with the fix `voltllm check` prints, not "no kernel image is available" from the first kernel."""
    from voltllm.cli import main
    from voltllm.engine.core import EngineCore

    fake_gpu(monkeypatch, (7, 0), "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_90", "sm_100", "sm_120"])
    cfg = config(bf16_model)  # the configuration itself is fine
    with pytest.raises(ConfigError, match=r"Tesla V100-SXM2-32GB \(sm_70\): this torch build lists sm_75, .*not sm_70: "
                                          r"install a build that ships it \(V100: a CUDA 12.6 build\)"):
        EngineCore(cfg)
    assert main(["check", bf16_model, "--max-model-len", "256"]) == 2
    assert "install a build that ships it" in capsys.readouterr().err
