"""Flags of newer vLLM versions (the API audit's list) give a clear answer, never argparse's bare "unrecognized
arguments": accepted at the value that is voltllm's behaviour, refused with the reason, or built. Checked through
`voltllm serve /nonexistent ...`, which parses and checks every flag before it looks for the model."""
from __future__ import annotations

import logging

import pytest

from voltllm.cli import build_parser, main, option_strings
from voltllm.cli_unbuilt import SHORT_ALIASES, UNBUILT_FLAGS

MISSING = "model '/nonexistent' not found"

# every flag the audit found unrecognized (its section 9)
AUDIT_FLAGS = """
--performance-mode --attention-config -ac --trust-request-chat-template --logprobs-mode --stream-interval
--mm-processor-cache-type --mamba-ssm-cache-dtype --mamba-cache-dtype --disable-cascade-attn --kernel-config
--moe-backend --enable-flashinfer-autotune --prefix-caching-hash-algo --data-parallel-rank -dpn
--profiler-config --tool-server --exclude-tools-when-tool-choice-none --enable-tokenizer-info-endpoint --uds
--ssl-ca-certs --ssl-cert-reqs --ssl-ciphers --enable-ssl-refresh --log-config-file
--disable-access-log-for-endpoints --enable-log-deltas --enable-offline-docs --middleware
--h11-max-incomplete-event-size --h11-max-header-count --grpc --enable-per-request-metrics
--mm-shm-cache-max-object-size-mb --mm-encoder-attn-backend --enable-mm-embeds --video-pruning-rate
--disable-chunked-mm-input --trust-request-mm-kwargs --enable-dbo --dbo-decode-token-threshold
--dbo-prefill-token-threshold --disable-nccl-for-dp-synchronization --data-parallel-multi-port-external-lb -asc
--kv-cache-metrics --enable-mfu-metrics --show-hidden-metrics-for-version --aggregate-engine-logging
--enable-return-routed-experts --weight-transfer-config --ec-transfer-config --io-processor-plugin
--logits-processor-pattern --additional-config --override-attention-dtype --kv-sharing-fast-prefill
--hf-config-path --code-revision --config-format --ignore-patterns --use-tqdm-on-load --pt-load-map-location
--disable-hybrid-kv-cache-manager --log-error-stack --tokens-only --fingerprint-mode --fingerprint-value""".split()


def test_every_flag_of_the_audit_is_known():
    known = option_strings(build_parser())
    assert [f for f in AUDIT_FLAGS if f not in known and f not in UNBUILT_FLAGS and f not in SHORT_ALIASES] == []


def _serve(capsys, *words: str) -> str:
    logging.getLogger("voltllm").handlers.clear()
    assert main(["serve", "/nonexistent", *words]) == 2
    err = capsys.readouterr().err
    assert "unrecognized" not in err and "usage:" not in err, err
    return err


@pytest.mark.parametrize("words", [
    ["--performance-mode", "balanced"], ["--logprobs-mode", "raw_logprobs"], ["--stream-interval", "4"],
    ["--disable-cascade-attn"], ["--no-disable-cascade-attn"], ["--mamba-ssm-cache-dtype", "float32"],
    ["--mamba-cache-dtype", "auto"], ["--config-format", "hf"], ["-ac", '{"backend": "TRITON_ATTN"}'],
    ["-ac.backend", "TORCH_REF"], ["--attention-config", '{"backend": "FLASH_ATTN_V100"}'],
    ["--api-server-count", "1"], ["-asc", "1"], ["--mm-encoder-tp-mode", "data"], ["--max-logprobs", "-1"],
    ["--trust-request-chat-template"], ["--exclude-tools-when-tool-choice-none"], ["--enable-tokenizer-info-endpoint"],
    ["--disable-access-log-for-endpoints", "/health,/metrics"], ["--no-enable-log-deltas"],
    ["--enable-log-deltas"], ["--show-hidden-metrics-for-version", "0.10"], ["--no-enable-flashinfer-autotune"],
    ["--fingerprint-mode", "none"], ["--no-use-tqdm-on-load"], ["--uds", "/tmp/voltllm-test.sock"],
    ["--prefix-caching-hash-algo", "sha256"], ["--h11-max-incomplete-event-size", "65536"],
    ["--h11-max-header-count", "100"], ["--ignore-patterns", "original/*", "*.pt"],
    ["--pt-load-map-location", "cuda"], ["--pt-load-map-location", '{"cuda:1": "cuda:0"}'],
])
def test_accepted_at_voltllms_behaviour(capsys, words):
    assert MISSING in _serve(capsys, *words)


@pytest.mark.parametrize("words,message", [
    (["--performance-mode", "throughput"], "--performance-mode throughput: throughput tuning"),
    (["--performance-mode", "interactivity"], "--performance-mode interactivity: latency tuning"),
    (["--logprobs-mode", "processed_logprobs"], "--logprobs-mode processed_logprobs: voltllm returns the model's"),
    (["--mamba-ssm-cache-dtype", "bfloat16"], "--mamba-ssm-cache-dtype bfloat16: hybrid models keep"),
    (["--mamba-cache-dtype", "float32"], "--mamba-cache-dtype float32: hybrid models keep their convolution"),
    (["--config-format", "mistral"], "--config-format mistral: Mistral's params.json format is not built"),
    (["-ac", '{"flash_attn_version": 3}'], "--attention-config flash_attn_version: not built"),
    (["-ac", '{"backend": "FLASHINFER"}'], "--attention-backend FLASHINFER: not built here"),
    (["-ac", '{"backend": "TORCH_REF"}', "--attention-backend", "TRITON_ATTN"], "--attention-config backend TORCH_REF"),
    (["--api-server-count", "2"], "--api-server-count: one API server process"),
    (["-asc", "4"], "--api-server-count: one API server process"),
    (["-dpn", "1"], "--data-parallel-rank: data parallelism over several nodes"),
    (["--stream-interval", "0"], "--stream-interval must be >= 1"),
    (["--max-logprobs", "-2"], "--max-logprobs must be >= 0, or -1"),
    (["--no-trust-request-chat-template"], "--no-trust-request-chat-template: refusing a request's chat_template"),
    (["--profiler-config", '{"profiler": "torch"}'], '--profiler-config profiler "torch" needs torch_profiler_dir'),
    (["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "rel"}'],
     "--profiler-config torch_profiler_dir must be an absolute path"),
    (["--profiler-config", '{"profiler": "nsys"}'], "--profiler-config profiler 'nsys': use"),
    (["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/tmp/x", "delay": 3}'],
     "--profiler-config: unknown keys ['delay']"),
    (["--tool-server", "demo"], "--tool-server: built-in tools run by the server"),
    (["--h11-max-header-count", "0"], "--h11-max-header-count must be >= 1, got 0"),
    (["--prefix-caching-hash-algo", "md5"], "--prefix-caching-hash-algo must be one of blake2b, sha256, "),
    (["--mm-processor-cache-type", "shm"], "--mm-processor-cache-type: this multimodal setting is not built"),
    (["--enable-flashinfer-autotune"], "--enable-flashinfer-autotune: voltllm runs its own Triton kernels"),
    (["--fingerprint-mode", "full"], "--fingerprint-mode: system_fingerprint is always null here"),
    (["--ssl-ca-certs", "/etc/hostname"], "--ssl-ca-certs applies to HTTPS: add --ssl-certfile"),
    (["--ssl-certfile", "/etc/hostname", "--ssl-cert-reqs", "2"], "--ssl-cert-reqs 2 checks client certificates: "
                                                                  "add --ssl-ca-certs"),
    (["--ssl-certfile", "/etc/hostname", "--ssl-ciphers", "NO-SUCH-CIPHER"], "--ssl-ciphers 'NO-SUCH-CIPHER': "
                                                                             "OpenSSL knows none"),
    (["--log-config-file", "/nonexistent.json"], "--log-config-file /nonexistent.json: no such file"),
    (["--uds", "/nonexistent-dir/x.sock"], "--uds /nonexistent-dir/x.sock: its directory does not exist"),
])
def test_refused_with_the_reason(capsys, words, message):
    err = _serve(capsys, *words)
    assert f"voltllm: error: {message}" in err, err


def test_log_config_file_must_be_a_dict_config(capsys, tmp_path):
    bad = tmp_path / "log.json"
    bad.write_text("[1]")
    assert "--log-config-file" in _serve(capsys, "--log-config-file", str(bad)) and "dictConfig" in \
        _serve(capsys, "--log-config-file", str(bad))
    good = tmp_path / "good.json"
    good.write_text('{"version": 1, "disable_existing_loggers": false}')
    assert MISSING in _serve(capsys, "--log-config-file", str(good))


def test_offline_engine_args_take_the_newer_engine_flags(tmp_path):
    """The engine flags are EngineArgs fields, so LLM(...) and --config files take them too."""
    from voltllm.config import ConfigError, EngineArgs

    with pytest.raises(ConfigError, match="--performance-mode throughput"):
        EngineArgs(model=str(tmp_path / "not-read"), device="cpu", performance_mode="throughput").create_engine_config()
    with pytest.raises(ConfigError, match="--attention-config backend FLASHINFER|--attention-backend FLASHINFER"):
        EngineArgs(model=str(tmp_path / "not-read"), device="cpu",
                   attention_config={"backend": "FLASHINFER"}).create_engine_config()
