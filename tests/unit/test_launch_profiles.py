"""Launch profiles (`voltllm serve MODEL --profile NAME`): every shipped profile is valid for `serve` and builds an
engine config; the command line, even at a default value, wins over --config, which wins over the profiles (a later
one over an earlier one); bad names and files are refused by name."""
from __future__ import annotations

import os

import pytest

from tiny_models import make_model
from voltllm.config import ConfigError
from voltllm.profiles import load_profile, profile_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve_args(argv: list[str]):
    from voltllm.cli import build_parser, dashed_flags
    from voltllm.cli_config import merge_config

    parser = build_parser()
    argv = dashed_flags(["serve", *argv])
    return merge_config(parser, "serve", parser.parse_args(argv), argv)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_profiles")), "qwen3", max_position_embeddings=1024)


def test_the_shipped_profiles():
    assert profile_names() == ["code-editing", "llama3-tools", "long-context", "low-memory", "qwen3-tools",
                             "qwen3.5-tools"]
    with open(os.path.join(REPO, "docs", "cli.md")) as f:
        docs = f.read()
    for name in profile_names():
        profile = load_profile(name)
        assert profile.description and profile.flags
        assert f"`{name}`" in docs, f"docs/cli.md does not describe the profile {name}"


@pytest.mark.parametrize("name", profile_names())
def test_each_profile_builds_an_engine_config(tiny, name):
    from voltllm.cli_args import engine_args_from
    from voltllm.entrypoints.openai.cli_serve import check_server_flags

    args = _serve_args([tiny, "--device", "cpu", "--profile", name])
    check_server_flags(args)
    config = engine_args_from(args).create_engine_config()
    flags = load_profile(name).flags
    if flags.get("kv-cache-dtype"):
        assert config.cache.kv_cache_dtype == flags["kv-cache-dtype"] and config.cache.calculate_key_offsets
    if flags.get("max-model-len") == "auto":
        assert config.model.max_model_len_fit
    if "speculative-config" in flags:
        assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 5
    if "tool-call-parser" in flags:
        assert args.enable_auto_tool_choice and args.tool_call_parser == flags["tool-call-parser"]


def test_precedence(tmp_path):
    # a later profile over an earlier one
    args = _serve_args(["m", "--profile", "long-context", "--profile", "low-memory"])
    assert args.max_num_seqs == 32 and args.max_num_batched_tokens == 2048 and args.kv_cache_dtype == "fp8_e4m3"
    args = _serve_args(["m", "--profile", "low-memory", "--profile", "long-context"])
    assert args.max_num_seqs == 8
    # the command line wins, also when it gives a flag's default value (auto is --kv-cache-dtype's default)
    args = _serve_args(["m", "--profile", "long-context", "--kv-cache-dtype", "auto", "--max-num-seqs", "256",
                        "--no-calculate-kv-scales"])
    assert (args.kv_cache_dtype, args.max_num_seqs, args.calculate_kv_scales) == ("auto", 256, False)
    assert args.calculate_key_offsets is True and args.max_model_len == "auto"
    # --config over the profiles, the command line over --config
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-num-seqs: 4\nkv_cache_dtype: fp8_e5m2\n")
    args = _serve_args(["m", "--config", str(cfg), "--profile", "long-context", "--max-num-seqs", "2"])
    assert (args.max_num_seqs, args.kv_cache_dtype, args.max_model_len) == (2, "fp8_e5m2", "auto")


def test_a_profile_file_of_ones_own(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("description: my box\nflags:\n  max_num_seqs: 12\n  enforce-eager: true\n")
    args = _serve_args(["m", "--profile", str(mine)])
    assert args.max_num_seqs == 12 and args.enforce_eager is True


@pytest.mark.parametrize("text,match", [
    ("flags:\n  nope: 1\n", "unknown flag 'nope'"),
    ("flags:\n  model: /x\n", "cannot name the model"),
    ("flags:\n  profile: long-context\n", "cannot name --profile"),
    ("description: x\n", "expected a mapping with `description`"),
    ("flags: {}\nextra: 1\n", "and nothing else"),
    ("flags: [\n", "not valid YAML"),
])
def test_bad_profile_files(tmp_path, text, match):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=match):
        _serve_args(["m", "--profile", str(bad)])


def test_unknown_profile_names_the_profiles():
    with pytest.raises(ConfigError, match="no such profile; the profiles are: code-editing, llama3-tools, long-context"):
        _serve_args(["m", "--profile", "fastest"])
    with pytest.raises(ConfigError, match="no such file"):
        _serve_args(["m", "--profile", "/nonexistent/p.yaml"])


def test_run_batch_takes_profiles_and_config(tmp_path):
    from voltllm.cli import build_parser
    from voltllm.cli_config import merge_config

    cfg = tmp_path / "batch.yaml"
    cfg.write_text("max-num-seqs: 4\n")
    parser = build_parser()
    argv = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "m", "--profile", "qwen3-tools", "--profile",
            "long-context", "--config", str(cfg)]
    args = merge_config(parser, "run-batch", parser.parse_args(argv), argv)
    assert (args.tool_call_parser, args.kv_cache_dtype, args.max_num_seqs) == ("hermes", "fp8_e4m3", 4)
