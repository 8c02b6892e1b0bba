"""vLLM's weight-offloading flags (--cpu-offload-gb, --cpu-offload-params, --offload-backend, --offload-group-size,
--offload-num-in-group, --offload-prefetch-step): parsed into EngineConfig.weight_offload, refused clearly where they
cannot run; piecewise prompt graphs are off with offloading."""
from __future__ import annotations

import pytest

from flag_parsing import parse_engine_flags as _parse
from tiny_models import make_model
from voltllm.config import ConfigError, EngineArgs
from voltllm.weight_offload_config import matches, offload_params


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_wo_flags")), "qwen3")


def test_flags_parse(tiny):
    cfg = _parse(tiny, "--device", "cpu", "--cpu-offload-gb", "2.5", "--cpu-offload-params", "experts",
                 "self_attn.o_proj", "--offload-prefetch-step", "2").create_engine_config()
    wo = cfg.weight_offload
    assert (wo.budget_bytes, wo.group_size, wo.prefetch_step, wo.slots) == (int(2.5 * 2**30), 0, 2, 3)
    assert wo.params == ("experts", "self_attn.o_proj")
    assert cfg.device.prompt_graph_max_tokens == 0
    grouped = _parse(tiny, "--device", "cpu", "--offload-backend", "prefetch", "--offload-group-size", "8",
                     "--offload-num-in-group", "2").create_engine_config().weight_offload
    assert (grouped.budget_bytes, grouped.group_size, grouped.num_in_group, grouped.prefetch_step) == (0, 8, 2, 1)
    assert grouped.backend == "prefetch" and wo.backend == "prefetch"
    uva = _parse(tiny, "--device", "cpu", "--cpu-offload-gb", "1", "--offload-backend", "uva",
                 "--cpu-offload-params", "experts").create_engine_config()
    assert uva.weight_offload.backend == "uva" and uva.device.prompt_graph_max_tokens is None  # (prompt graphs stay)
    plain = _parse(tiny, "--device", "cpu", "--cpu-offload-gb", "0").create_engine_config()
    assert plain.weight_offload is None and plain.device.prompt_graph_max_tokens is None


@pytest.mark.parametrize("kwargs,match", [
    ({"cpu_offload_gb": 1, "offload_backend": "disk"}, "--offload-backend 'disk': not a backend"),
    ({"offload_group_size": 4, "offload_backend": "uva"}, "--offload-group-size with --offload-backend uva"),
    ({"cpu_offload_gb": -1}, "--cpu-offload-gb must be a number of GiB >= 0"),
    ({"cpu_offload_gb": float("nan")}, "--cpu-offload-gb must be a number of GiB >= 0"),
    ({"offload_group_size": 4, "offload_num_in_group": 5}, "--offload-num-in-group 5 must be <= --offload-group-s"),
    ({"offload_group_size": 4, "offload_prefetch_step": 0}, "--offload-prefetch-step must be >= 1 with --offload-g"),
    ({"offload_group_size": -2}, "--offload-group-size must be an integer >= 0"),
    ({"cpu_offload_gb": 1, "offload_prefetch_step": -1}, "--offload-prefetch-step must be an integer >= 0"),
    ({"cpu_offload_params": ["experts"]}, "--cpu-offload-params chooses what --cpu-offload-gb or --offload-group"),
    ({"cpu_offload_gb": 1, "cpu_offload_params": [".experts"]}, "--cpu-offload-params: '.experts' is not"),
    ({"cpu_offload_gb": 1, "enable_lora": True}, "with --enable-lora is not built"),
])
def test_refused(tiny, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=tiny, device="cpu", **kwargs).create_engine_config()


def test_names_match_whole_segments():
    assert offload_params("experts, mlp.down_proj") == ("experts", "mlp.down_proj")
    assert offload_params({"experts"}) == ("experts",)
    assert matches("mlp.experts.w2", ["experts"]) and matches("mlp.experts.w2", ["experts.w2"])
    assert not matches("mlp.experts.w2", ["expert"]) and not matches("mlp.experts.w2", ["w"])
    assert not matches("mlp.experts.w2_scale", ["experts.w2"])
    assert matches("self_attn.qkv_proj.gguf_segments.0.weight.lo", ["self_attn.qkv_proj"])
