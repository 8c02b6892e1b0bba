"""--max-model-len auto / -1 (the longest context the sized KV cache holds, up to the model's) and
--kv-cache-memory-bytes (the KV cache's size instead of the utilization share), end to end on the CPU."""
from __future__ import annotations

import argparse

import pytest

from flag_parsing import parse_engine_flags
from tiny_models import make_model
from voltllm.config import ConfigError, EngineArgs

BLOCK = 16
# the tiny qwen3 below: 3 layers x K and V x 2 KV heads x 16 dims x fp32, per token
PER_BLOCK = 3 * 2 * 2 * 16 * 4 * BLOCK


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_fit")), "qwen3", max_position_embeddings=1024)


def _llm(tiny, **kw):
    from voltllm.entrypoints.llm import LLM

    return LLM(tiny, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4, **kw)


@pytest.mark.parametrize("text", ["auto", "-1"])
def test_flag_parses_auto(tiny, text):
    args = parse_engine_flags(tiny, "--device", "cpu", "--max-model-len", text, "--kv-cache-memory-bytes", "4M")
    assert args.max_model_len == "auto" and args.kv_cache_memory_bytes == 4 << 20
    cfg = args.create_engine_config()
    # until the cache is sized the length is the model's; the scheduler's prefill budget derives from it as usual
    assert cfg.model.max_model_len_fit and cfg.model.max_model_len == 1024
    assert cfg.cache.kv_cache_memory_bytes == 4 << 20


def test_bad_values_are_refused(tiny):
    from voltllm.cli_args import size_arg

    with pytest.raises(argparse.ArgumentTypeError, match="whole number of bytes"):
        size_arg("--kv-cache-memory-bytes", unit="bytes")("lots")
    with pytest.raises(ConfigError, match="--kv-cache-memory-bytes must be >= 1"):
        EngineArgs(model=tiny, device="cpu", kv_cache_memory_bytes=0).create_engine_config()
    with pytest.raises(ConfigError, match="--max-model-len takes a whole number of tokens like 8192, .* or auto"):
        EngineArgs(model=tiny, device="cpu", max_model_len="most").create_engine_config()
    with pytest.raises(ConfigError, match="--kv-cache-memory-bytes takes a whole number of bytes"):
        EngineArgs(model=tiny, device="cpu", kv_cache_memory_bytes="lots").create_engine_config()
    # strings as the command line writes them, from Python too (vLLM's LLM takes only ints: a clearer error there)
    cfg = EngineArgs(model=tiny, device="cpu", max_model_len="AUTO", kv_cache_memory_bytes="4M",
                     max_num_batched_tokens="2k").create_engine_config()
    assert cfg.model.max_model_len_fit and cfg.cache.kv_cache_memory_bytes == 4 << 20
    assert cfg.scheduler.max_num_batched_tokens == 2000


@pytest.mark.parametrize("value", ["auto", -1])
def test_auto_fits_the_length_to_the_cache(tiny, value):
    llm = _llm(tiny, max_model_len=value, kv_cache_memory_bytes=20 * PER_BLOCK)
    assert llm.engine.kv.num_blocks == 20
    assert llm.config.model.max_model_len == 20 * BLOCK == llm.engine.max_model_len
    assert llm.engine.scheduler.config.max_model_len == 20 * BLOCK
    from voltllm import SamplingParams

    out = llm.generate({"prompt_token_ids": list(range(5, 105))}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate({"prompt_token_ids": [7] * (20 * BLOCK)}, SamplingParams(max_tokens=1))
    # the user cannot know the fitted length beforehand: a long max_tokens stops there ("length"), as in vLLM
    long = llm.generate({"prompt_token_ids": [7] * 300}, SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(long[0].outputs[0].token_ids) == 20 and long[0].outputs[0].finish_reason == "length"


def test_auto_stops_at_the_models_maximum(tiny):
    llm = _llm(tiny, max_model_len="auto", kv_cache_memory_bytes=200 * PER_BLOCK)
    assert llm.config.model.max_model_len == 1024  # 3,200 tokens fit; the model has 1,024 positions


def test_a_fixed_cache_too_small_for_the_length_is_an_error(tiny):
    with pytest.raises(RuntimeError, match=r"--kv-cache-memory-bytes 0.2 MiB holds 20 blocks, fewer than one request "
                                           r"of --max-model-len 1024 needs \(64\).*or pass auto.*raise "
                                           r"--kv-cache-memory-bytes"):
        _llm(tiny, kv_cache_memory_bytes=20 * PER_BLOCK)


def test_auto_with_no_room_for_a_block_is_an_error(tiny):
    with pytest.raises(RuntimeError, match="not enough memory for any KV cache: --kv-cache-memory-bytes .* is less "
                                           "than one block of 16 tokens"):
        _llm(tiny, max_model_len="auto", kv_cache_memory_bytes=PER_BLOCK - 1)


def test_auto_on_a_hybrid_keeps_its_state_snapshots(tmp_path):
    """The prefix-cache snapshots of a hybrid take their usual share first; the length is fitted to the blocks left
    (with a fixed --max-model-len they may only take blocks beyond one full-length request, here none)."""
    from tiny_models import make_tiny_hybrid

    path = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", seed=0, gen_seed=0, max_position_embeddings=100_000)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    from voltllm.entrypoints.llm import LLM

    llm = LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=2, max_model_len="auto",
              kv_cache_memory_bytes=16 << 20, skip_tokenizer_init=True)
    runner = llm.engine.runner
    assert runner.state_snapshots is not None
    assert llm.config.model.max_model_len == runner.num_blocks * runner.block_size < 100_000
    assert llm.engine.kv.num_blocks == runner.num_blocks
