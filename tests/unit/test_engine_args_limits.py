"""Size flags: an explicit 0 is an error like any other value below 1, not "unset" (which derives the value)."""
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
