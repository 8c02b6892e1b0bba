"""--calculate-kv-scales: the flag, the scale rule (voltllm.attention.kv_spec.calc_kv_scales) and its report.
The engine end to end (first real forward, checkpoint precedence, rescaled model) is in
tests/model/test_fp8_kv_engine.py."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from voltllm.attention.kv_spec import (K_SCALE_RANGE, V_SCALE_RANGE, calc_kv_scales, kv_scales_to_calculate,
                                       maybe_calc_kv_scales, new_kv_scale)
from voltllm.cli_args import add_engine_args, engine_args_from


def _parse(*argv):
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    add_engine_args(p)
    return engine_args_from(p.parse_args(list(argv)))


def test_cli_flag():
    assert _parse("m").calculate_kv_scales is False
    assert _parse("m", "--kv-cache-dtype", "fp8", "--calculate-kv-scales").calculate_kv_scales is True
    assert _parse("m", "--no-calculate-kv-scales").calculate_kv_scales is False


def _attn(checkpoint=()):
    a = torch.nn.Module()
    a.register_buffer("k_scale", new_kv_scale())
    a.register_buffer("v_scale", new_kv_scale())
    a.checkpoint_kv_scales = set(checkpoint)
    return a


def test_calc_kv_scales_rule():
    a = _attn()
    k_buf, v_buf = a.k_scale, a.v_scale
    k = torch.tensor([[0.5, -300.0], [2.0, 1.0]], dtype=torch.float16)
    v = torch.tensor([[0.01, 0.02], [-0.04, 0.0]], dtype=torch.float16)
    calc_kv_scales(a, k, v)
    assert a.k_scale is k_buf and a.v_scale is v_buf  # in place: CUDA graphs hold these tensors
    assert float(a.k_scale) == pytest.approx(300.0 / K_SCALE_RANGE)
    assert float(a.v_scale) == pytest.approx(float(torch.tensor(0.04, dtype=torch.float16)) / V_SCALE_RANGE)
    a = _attn()
    calc_kv_scales(a, torch.zeros(3, 2), torch.tensor([float("nan"), 1.0]))  # nothing usable: kept
    assert (float(a.k_scale), float(a.v_scale)) == (1.0, 1.0)
    a = _attn(checkpoint={"k_scale"})
    a.k_scale.fill_(0.5)
    calc_kv_scales(a, k, v)
    assert float(a.k_scale) == 0.5 and float(a.v_scale) != 1.0  # the checkpoint's scale stays


def test_maybe_calc_kv_scales_only_when_asked_and_skips_padding():
    a = _attn()
    k = torch.tensor([1.0, 2.0, 1000.0])  # the last row is padding (num_tokens = 2)
    ctx = SimpleNamespace(calc_kv_scales=False, meta=SimpleNamespace(num_tokens=2))
    maybe_calc_kv_scales(a, k, k, ctx)
    assert float(a.k_scale) == 1.0
    ctx.calc_kv_scales = True
    maybe_calc_kv_scales(a, k, k, ctx)
    assert float(a.k_scale) == pytest.approx(2.0 / K_SCALE_RANGE)


def test_kv_scales_to_calculate():
    model = torch.nn.ModuleList([_attn(), _attn({"k_scale", "v_scale"})])
    assert kv_scales_to_calculate(model, False) is False
    assert kv_scales_to_calculate(model, True) is True
    model = torch.nn.ModuleList([_attn({"k_scale", "v_scale"})])
    assert kv_scales_to_calculate(model, True) is False  # every scale from the checkpoint


def test_acceleration_report_names_the_scales():
    import dataclasses

    from voltllm.acceleration import build_report
    from voltllm.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
    hf = SimpleNamespace(model_type="llama")
    model = ModelConfig(model="m", tokenizer="m", served_model_name="m", dtype=torch.float16, max_model_len=256,
                        hf_config=hf)
    cfg = EngineConfig(model=model, cache=CacheConfig(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True),
                       scheduler=SchedulerConfig(), device=DeviceConfig(device=torch.device("cpu")))
    assert build_report(cfg)["configuration"]["calculate_kv_scales"] is True
    off = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, calculate_kv_scales=False))
    assert build_report(off)["configuration"]["calculate_kv_scales"] is False
