"""`voltllm serve` flags: the seed system's two launch commands parse (and unbuilt capabilities are refused
by name, exit 2); server flags we cannot honour are refused clearly. No model is loaded here."""
from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

from server_helpers import REPO_ROOT, VOLTLLM

SEED_1 = """serve /models/Qwen3.8-27B-QUASAR-NVFP4 --host 127.0.0.1 --port 8000 --dtype half --tensor-parallel-size 4
--attention-backend FLASH_ATTN_V100 --kv-cache-dtype fp8_e4m3 --max-model-len 262144 --gpu-memory-utilization 0.8
--max-num-batched-tokens 8192 --max-num-seqs 4 --block-size 2048 --mamba-block-size 8192 --enable-prefix-caching
--mamba-cache-mode align --served-model-name qwen3.8-27b-dflash2 --limit-mm-per-prompt '{"image":0,"video":0}'
--enable-auto-tool-choice --tool-call-parser qwen3_coder --reasoning-parser qwen3
--default-chat-template-kwargs '{"enable_thinking":false}' --seed 0
--speculative-config '{"method":"dflash","model":"/models/Qwen3.8-27B-DFlash2","num_speculative_tokens":7,"kv_cache_dtype":"auto","attention_backend":"FLASH_ATTN_V100","draft_sample_method":"probabilistic","enforce_eager":false}'
--trust-remote-code"""

SEED_2 = """serve /models/Qwen3.8-Flash-Next-NVFP4 --tensor-parallel-size 4 --dtype half --kv-cache-dtype auto
--language-model-only --max-model-len 131072 --max-num-batched-tokens 8192 --max-num-seqs 1
--gpu-memory-utilization 0.90 --no-async-scheduling --mamba-cache-mode align --enable-prefix-caching
--speculative-config '{"method":"mtp","num_speculative_tokens":4}'"""

UNBUILT = ("--kv-cache-dtype", "--speculative-config")  # (-tp 4 is built: tensor parallelism)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny local model directory (config only; nothing here loads weights) with a 256K context."""
    d = tmp_path_factory.mktemp("tiny-model")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
           "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _run_many(argvs: list[list[str]], timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """Run several CLI invocations at once (each one pays the torch import)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen(VOLTLLM + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=REPO_ROOT) for argv in argvs]
    results = []
    for argv, p in zip(argvs, procs):
        out, err = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
    return results


def _seed_argv(text: str, model: str) -> list[str]:
    argv = shlex.split(text.replace("\n", " "))
    argv[1] = model  # the model path
    return [a.replace("/models/Qwen3.8-27B-DFlash2", model) for a in argv]


def test_seed_commands_parse_and_refuse_unbuilt_flags(tiny_model):
    bad_parser = ["serve", tiny_model, "--tool-call-parser", "nonexistent_parser", "--enable-auto-tool-choice"]
    bad_reasoning = ["serve", tiny_model, "--reasoning-parser", "nope"]
    mm = ["serve", tiny_model, "--limit-mm-per-prompt", '{"image": 2, "video": 1, "audio": 1}']
    auto_alone = ["serve", tiny_model, "--enable-auto-tool-choice"]
    bad_json = ["serve", tiny_model, "--default-chat-template-kwargs", "{not json"]
    r1, r2, r_parser, r_reason, r_mm, r_auto, r_json = _run_many(
        [_seed_argv(SEED_1, tiny_model), _seed_argv(SEED_2, tiny_model), bad_parser, bad_reasoning, mm, auto_alone,
         bad_json])
    for r in (r1, r2):
        assert r.returncode == 2, r.stderr
        assert "unrecognized arguments" not in r.stderr and "usage:" not in r.stderr, r.stderr
        assert "voltllm: error:" in r.stderr
        named = [flag for flag in UNBUILT if flag in r.stderr]
        assert named, f"the refusal should name the unbuilt flag: {r.stderr}"
    assert "--speculative-config" in r2.stderr  # its mtp method; -tp 4 itself is accepted for this llama
    assert r_parser.returncode == 2 and "--tool-call-parser" in r_parser.stderr and "nonexistent_parser" in r_parser.stderr
    assert "hermes" in r_parser.stderr  # lists what is available
    assert r_reason.returncode == 2 and "--reasoning-parser" in r_reason.stderr
    assert r_mm.returncode == 2 and "--limit-mm-per-prompt audio" in r_mm.stderr  # (images and videos are built)
    assert r_auto.returncode == 2 and "--tool-call-parser" in r_auto.stderr
    assert r_json.returncode == 2 and "--default-chat-template-kwargs" in r_json.stderr


def _serve_args(argv):
    import argparse

    from voltllm.cli import dashed_flags
    from voltllm.entrypoints.openai.cli_serve import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"), help="serve")
    return parser.parse_args(dashed_flags(["serve", *argv]))


@pytest.mark.parametrize("argv", [["--served-model-name", "foo", "/nonexistent/my-model"],
                                  ["--served-model-name", "foo", "Qwen/Qwen3-8B"],
                                  ["--served-model-name", "foo", "model.gguf"],
                                  ["--api-key", "k1", "Qwen/Qwen3-8B"]])
def test_model_after_a_many_valued_flag_is_refused(argv):
    """The option takes every word after it: MODEL there would become a second name and the embedded default
    model would be served under both."""
    from voltllm.config import ConfigError
    from voltllm.entrypoints.openai.cli_serve import check_server_flags

    with pytest.raises(ConfigError, match="put MODEL first"):
        check_server_flags(_serve_args(argv))


@pytest.mark.parametrize("argv", [["--served-model-name", "a", "b"], ["m", "--served-model-name", "a", "org/b"],
                                  ["--api-key", "k1", "k2"], ["m", "--api-key", "k1", "k/2"],
                                  ["--served-model-name", "a", "org/b", "--model", "m"],
                                  ["--served-model-name", "org/a"]])
def test_many_valued_flags_with_their_own_values(argv):
    from voltllm.entrypoints.openai.cli_serve import check_server_flags

    check_server_flags(_serve_args(argv))


def test_disable_frontend_multiprocessing_is_accepted():
    """vLLM's --disable-frontend-multiprocessing (older launch scripts pass it) parses, before or after MODEL, and
    changes nothing: the MODEL after it stays the model."""
    from voltllm.entrypoints.openai.cli_serve import check_server_flags

    for argv in (["--disable-frontend-multiprocessing", "m"], ["m", "--disable-frontend-multiprocessing"]):
        args = _serve_args(argv)
        assert args.disable_frontend_multiprocessing is True and args.model == "m"
        check_server_flags(args)
    assert _serve_args(["m"]).disable_frontend_multiprocessing is False


def test_config_file_flags_under_the_command_line(tmp_path):
    """`--config FILE.yaml` (vLLM's): keys with dashes or underscores, booleans, lists, mappings; the command line
    wins; bad files are refused by name."""
    from voltllm.cli import build_parser
    from voltllm.cli_config import merge_config
    from voltllm.config import ConfigError

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("served_model_name: [a, b]\nmodel: /m/dir\nmax-model-len: 4096\nport: 9001\n"
                   "enable_prefix_caching: false\nenforce_eager: true\ntrust_remote_code: false\n"
                   "hf_overrides: {rope_theta: 1000}\n")
    parser = build_parser()
    args = merge_config(parser, "serve", parser.parse_args(["serve", "--config", str(cfg), "--port", "9002"]))
    assert args.served_model_names == ["a", "b"] and args.model == "/m/dir" and args.max_model_len == 4096
    assert args.port == 9002  # the command line's
    assert args.enable_prefix_caching is False and args.enforce_eager is True and args.trust_remote_code is False
    assert args.hf_overrides == {"rope_theta": 1000}
    args = merge_config(parser, "serve", parser.parse_args(["serve", "/cli/model", "--config", str(cfg)]))
    assert args.model == "/cli/model"
    for text, match in (("nope_flag: 1\n", "unknown flag 'nope_flag'"), ("- a\n", "expected a mapping"),
                        ("a: [\n", "not valid YAML")):
        cfg.write_text(text)
        with pytest.raises(ConfigError, match=match):
            merge_config(parser, "serve", parser.parse_args(["serve", "--config", str(cfg)]))
    with pytest.raises(ConfigError, match="no such file"):
        merge_config(parser, "serve", parser.parse_args(["serve", "--config", str(tmp_path / "absent.yaml")]))
