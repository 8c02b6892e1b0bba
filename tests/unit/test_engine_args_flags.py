"""Size flags: an explicit 0 is an error like any other value below 1, not "unset" (which derives the value); common
vLLM launch flags parse, and the modes they ask for that are not built are refused by name."""
from __future__ import annotations

import pytest

from tiny_models import make_model
from voltllm.config import ConfigError, EngineArgs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_limits")), "qwen3", max_position_embeddings=1024)


def test_unset_sizes_are_derived(tiny):
    cfg = EngineArgs(model=tiny, device="cpu").create_engine_config()
    assert cfg.model.max_model_len == 1024  # the model's max_position_embeddings
    assert cfg.scheduler.max_num_batched_tokens == 2048  # max(2048, min(max_model_len, 8192))


@pytest.mark.parametrize("flag,field", [("--max-model-len", "max_model_len"),
                                        ("--max-num-batched-tokens", "max_num_batched_tokens")])
@pytest.mark.parametrize("value", [0, -5])
def test_sizes_below_one_are_errors(tiny, flag, field, value):
    with pytest.raises(ConfigError, match=f"{flag} must be >= 1, got {value}"):
        EngineArgs(model=tiny, device="cpu", **{field: value}).create_engine_config()


def _parse(*argv):
    import argparse

    from voltllm.cli_args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    add_engine_args(p)
    return engine_args_from(p.parse_args(list(argv)))


def test_common_vllm_flags_parse(tiny):
    """Flags that vLLM launch scripts carry: chunked prefill on (the only mode here), --swap-space and
    --disable-custom-all-reduce accepted as no-ops (recompute on preemption, one GPU), -pp 1."""
    args = _parse(tiny, "--device", "cpu", "--enable-chunked-prefill", "--swap-space", "4",
                  "--disable-custom-all-reduce", "-pp", "1")
    assert args.enable_chunked_prefill is True and args.swap_space == 4.0 and args.disable_custom_all_reduce
    assert args.create_engine_config().model.max_model_len == 1024


@pytest.mark.parametrize("argv,match", [(("--no-enable-chunked-prefill",), "--no-enable-chunked-prefill"),
                                        (("--pipeline-parallel-size", "2"), "--pipeline-parallel-size 2"),
                                        (("-pp", "4"), "--pipeline-parallel-size 4")])
def test_unbuilt_vllm_modes_are_refused_by_name(tiny, argv, match):
    with pytest.raises(ConfigError, match=match):
        _parse(tiny, "--device", "cpu", *argv).create_engine_config()
