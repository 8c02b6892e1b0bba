"""Well-known vLLM flags voltllm does not build are refused with a readable reason and exit 2 (voltllm/cli_unbuilt.py),
on the command line, in `--config` files and as LLM(...) keywords; flags voltllm does not know at all keep argparse's
"unrecognized arguments"."""
from __future__ import annotations

import pytest

from voltllm.cli import build_parser, main, option_strings
from voltllm.cli_unbuilt import INERT, UNBUILT_FLAGS, WHILE_SWITCHED_ON, screen_unbuilt_flags, unbuilt_flag_error


@pytest.mark.parametrize("argv,expected", [
    (["serve", "m", "--enable-lora", "--fully-sharded-loras"], "voltllm: error: --fully-sharded-loras: fully "
     "sharded LoRA weights are not built"),
    (["serve", "m", "--enable-lora-bias"], "voltllm: error: --enable-lora-bias: LoRA biases are not built"),
    (["serve", "m", "--speculative-model", "d", "--num-speculative-tokens", "4"],
     "voltllm: error: --speculative-model: an older vLLM flag: speculative decoding is configured with "
     "--speculative-config"),
    (["serve", "m", "--enable-reasoning", "--reasoning-parser", "qwen3"],
     "voltllm: error: --enable-reasoning: an older vLLM flag: --reasoning-parser NAME alone"),
    (["generate", "hi", "m", "--num-scheduler-steps", "8"], "voltllm: error: --num-scheduler-steps: multi-step"),
    (["serve", "m", "--enable-eplb"], "voltllm: error: --enable-eplb: the expert-parallel load balancer"),
])
def test_unbuilt_vllm_flags_exit_2_with_the_reason(capsys, argv, expected):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith(expected), err
    assert "usage:" not in err and "unrecognized" not in err


def test_every_table_flag_is_refused_and_none_is_defined_by_voltllm():
    known = option_strings(build_parser())
    assert not known & set(UNBUILT_FLAGS), "a built flag must leave the table"
    for flag, why in UNBUILT_FLAGS.items():
        # (those act only while a refused switch is on, or change nothing here: accepted at any value)
        if flag not in WHILE_SWITCHED_ON and flag not in INERT:
            assert unbuilt_flag_error(["serve", "m", flag, "7"], known) == f"{flag}: {why}"


@pytest.mark.parametrize("words", [["--no-fully-sharded-loras"], ["--enable-lora-bias=false"],
                                   ["--lora-extra-vocab-size", "256"], ["--no-enable-dbo"],
                                   ["--num-lookahead-slots", "0"], ["--scheduler-delay-factor=0"],
                                   ["--num-scheduler-steps", "1"], ["--no-enable-eplb"]])
def test_unbuilt_features_left_off_are_accepted_and_dropped(words):
    """vLLM runs these as voltllm does (the feature off, or the value that is voltllm's behaviour). They are dropped
    before parsing."""
    known = option_strings(build_parser())
    assert screen_unbuilt_flags(["serve", "m", *words, "--port", "9"], known) == (["serve", "m", "--port", "9"],
                                                                                   None)


def test_other_engineers_server_flags_are_not_in_the_table():
    for flag in ("--chat-template-content-format", "--return-tokens-as-token-ids", "--disable-fastapi-docs",
                 "--enable-request-id-headers", "--max-log-len", "--enable-log-outputs",
                 "--enable-server-load-tracking", "--kv-cache-memory-bytes", "--max-model-len"):
        assert flag not in UNBUILT_FLAGS


def test_a_flag_voltllm_defines_is_never_refused_from_the_table():
    assert unbuilt_flag_error(["serve", "--enable-eplb"], known={"--enable-eplb"}) is None
    assert unbuilt_flag_error(["serve", "m", "--", "--enable-eplb"]) is None  # after --: values
    assert unbuilt_flag_error(["generate", "--enable-eplb is off", "m"]) is None  # a value, not a flag


def test_unknown_flags_keep_argparse_message(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "m", "--no-such-flag-anywhere"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-flag-anywhere" in capsys.readouterr().err


def test_config_file_and_offline_llm_name_the_reason(tmp_path):
    from voltllm.cli_config import merge_config
    from voltllm.config import ConfigError
    from voltllm.entrypoints.llm import LLM

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("enable_eplb: true\n")
    parser = build_parser()
    with pytest.raises(ConfigError, match="serve.yaml: enable_eplb: the expert-parallel load balancer"):
        merge_config(parser, "serve", parser.parse_args(["serve", "--config", str(cfg)]))
    with pytest.raises(TypeError, match="enable_eplb: the expert-parallel load balancer .* is not built"):
        LLM("unused", enable_eplb=True)
    with pytest.raises(TypeError, match="unknown engine arguments: no_such_argument"):
        LLM("unused", no_such_argument=1)
    cfg.write_text("enable_lora: false\nmax_lora_rank: 16\ntask: generate\nmax-model-len: 77\n")
    assert merge_config(parser, "serve", parser.parse_args(["serve", "--config", str(cfg)])).max_model_len == 77


def test_offline_llm_takes_vllms_engine_keywords(tmp_path):
    """lm-evaluation-harness's vLLM arguments, and vLLM engine arguments that belong to its server side."""
    from tiny_models import make_model
    from voltllm import SamplingParams
    from voltllm.entrypoints.llm import LLM

    llm = LLM(make_model(str(tmp_path / "tiny"), "llama"), device="cpu", enable_lora=False, max_lora_rank=16,
              task="generate", disable_log_stats=True, max_logprobs=3, limit_mm_per_prompt={"image": 0})
    assert llm.generate("hi", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)[0].outputs[0].logprobs
    with pytest.raises(ValueError, match="logprobs 4: more than this LLM's max_logprobs"):
        llm.generate("hi", SamplingParams(max_tokens=2, logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match="--limit-mm-per-prompt audio.*not built"):  # (images and videos are)
        LLM("unused", limit_mm_per_prompt={"image": 1, "video": 1, "audio": 1})


def test_docs_list_every_unbuilt_flag():
    import os

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "cli.md")) as f:
        docs = f.read()
    assert [flag for flag in UNBUILT_FLAGS if f"`{flag}`" not in docs] == []
