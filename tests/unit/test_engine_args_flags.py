"""Size flags: an explicit 0 is an error like any other value below 1, not "unset" (which derives the value); common
vLLM launch flags parse, and the modes they ask for that are not built are refused by name."""
from __future__ import annotations

import pytest

from flag_parsing import parse_engine_flags as _parse
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


def test_common_vllm_flags_parse(tiny):
    """Flags that vLLM launch scripts carry: chunked prefill on (the only mode here), --swap-space and
    --disable-custom-all-reduce accepted as no-ops (recompute on preemption, one GPU), -pp 1."""
    args = _parse(tiny, "--device", "cpu", "--enable-chunked-prefill", "--swap-space", "4",
                  "--disable-custom-all-reduce", "-pp", "1")
    assert args.enable_chunked_prefill is True and args.swap_space == 4.0 and args.disable_custom_all_reduce
    assert args.create_engine_config().model.max_model_len == 1024


@pytest.mark.parametrize("argv,match", [(("--no-enable-chunked-prefill",), "--no-enable-chunked-prefill"),
                                        (("--pipeline-parallel-size", "2", "--cpu-offload-gb", "1"),
                                         "--pipeline-parallel-size 2: pipeline parallelism with weight offloading"),
                                        (("-pp", "64"), "--pipeline-parallel-size 64: the model has only")])
def test_unbuilt_vllm_modes_are_refused_by_name(tiny, argv, match):
    with pytest.raises(ConfigError, match=match):
        _parse(tiny, "--device", "cpu", *argv).create_engine_config()


@pytest.mark.parametrize("text,want", [("8192", 8192), ("32k", 32_000), ("32K", 32_768), ("1.5m", 1_500_000),
                                       ("2M", 2 * 2**20), ("25.6k", 25_600), ("-1", -1)])
def test_sizes_take_vllm_suffixes(text, want):
    from voltllm.cli_args import size_arg

    assert size_arg("--max-model-len")(text) == want


@pytest.mark.parametrize("text", ["auto", "1.5", "k", "12x", ""])
def test_sizes_that_are_not_token_counts(text):
    import argparse

    from voltllm.cli_args import size_arg

    with pytest.raises(argparse.ArgumentTypeError, match="whole number of tokens"):
        size_arg("--max-model-len")(text)


def test_underscore_flag_names_parse_like_dashes(tiny):
    from voltllm.cli import dashed_flags

    argv = dashed_flags([tiny, "--device", "cpu", "--max_model_len=512", "--max_num_seqs", "8",
                         "--chat-template", "{{ my_var }}"])
    assert argv[3:] == ["--max-model-len=512", "--max-num-seqs", "8", "--chat-template", "{{ my_var }}"]
    cfg = _parse(*argv).create_engine_config()
    assert cfg.model.max_model_len == 512 and cfg.scheduler.max_num_seqs == 8


def test_model_given_twice_is_refused(tiny, tmp_path):
    assert _parse(tiny, "--model", tiny, "--device", "cpu").model == tiny  # the same one twice: fine
    with pytest.raises(ConfigError, match="given twice"):
        _parse(tiny, "--model", str(tmp_path), "--device", "cpu")


def test_load_formats_named_by_files(tiny):
    cfg = EngineArgs(model=tiny, device="cpu", load_format="safetensors").create_engine_config()
    assert cfg.model.load_format == "auto"
    for fmt in ("pt", "gguf"):  # the tiny model is a safetensors directory
        with pytest.raises(ConfigError, match=f"--load-format {fmt}: .* has no such weights"):
            EngineArgs(model=tiny, device="cpu", load_format=fmt).create_engine_config()
    with pytest.raises(ConfigError, match="--load-format must be one of"):
        EngineArgs(model=tiny, device="cpu", load_format="tensorizer").create_engine_config()


@pytest.mark.parametrize("field,value,match", [
    ("num_gpu_blocks_override", 0, "--num-gpu-blocks-override must be >= 1"),
    ("num_gpu_blocks_override", -5, "--num-gpu-blocks-override must be >= 1"),
    ("generation_config", "/nonexistent/gen", "--generation-config /nonexistent/gen: no generation_config.json"),
    ("tokenizer", "/nonexistent/tok", "--tokenizer /nonexistent/tok: no such file"),
])
def test_bad_paths_and_counts_are_refused_before_loading(tiny, field, value, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=tiny, device="cpu", **{field: value}).create_engine_config()


def test_on_off_flags_take_their_no_forms(tiny):
    args = _parse(tiny, "--device", "cpu", "--enforce-eager", "--no-enforce-eager", "--no-trust-remote-code")
    assert args.enforce_eager is False and args.trust_remote_code is False
    assert _parse(tiny, "--enforce-eager").enforce_eager is True


def test_attention_backend_and_mamba_mode_checked_before_loading(tiny, tmp_path):
    from tiny_models import make_tiny_hybrid

    with pytest.raises(ConfigError, match="--attention-backend FLASHINFER: not built"):
        EngineArgs(model=tiny, device="cpu", attention_backend="FLASHINFER").create_engine_config()
    assert _parse(tiny, "--device", "cpu", "--attention-backend", "FLASH_ATTN_V100").attention_backend == "TRITON_ATTN"
    # "all" has nothing to do on an attention-only model; a hybrid one has only align / none
    EngineArgs(model=tiny, device="cpu", mamba_cache_mode="all").create_engine_config()
    hybrid = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", seed=0, gen_seed=0)
    if hybrid is None:
        pytest.skip("this transformers has no qwen3_5")
    with pytest.raises(ConfigError, match="--mamba-cache-mode all: not built for hybrid models"):
        EngineArgs(model=hybrid, device="cpu", mamba_cache_mode="all").create_engine_config()


def test_none_means_the_default_for_fields_without_a_none_value():
    """vLLM's EngineArgs read None as "the default" (lm-evaluation-harness's vLLM backend passes max_num_seqs=None
    and block_size may come as None); fields whose None means something (max_model_len: the model's) keep it."""
    from voltllm.config import EngineArgs

    args = EngineArgs(model="m", max_num_seqs=None, block_size=None, gpu_memory_utilization=None, seed=None,
                      dtype=None, max_model_len=None, max_num_batched_tokens=None)
    plain = EngineArgs(model="m")
    assert (args.max_num_seqs, args.block_size, args.gpu_memory_utilization, args.seed, args.dtype) == (
        plain.max_num_seqs, plain.block_size, plain.gpu_memory_utilization, plain.seed, plain.dtype)
    assert args.max_model_len is None and args.max_num_batched_tokens is None
