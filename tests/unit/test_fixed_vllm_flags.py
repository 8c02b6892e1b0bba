"""vLLM engine flags voltllm takes at the value that is its own behaviour: they parse (serve and the offline
EngineArgs), and any other value is refused before the model is read, naming the flag and what voltllm does."""
from __future__ import annotations


import pytest

from flag_parsing import parse_engine_flags as _parse
from tiny_models import make_model
from voltllm.config import ConfigError, EngineArgs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_fixed")), "qwen3", max_position_embeddings=1024)


def test_vllm_guide_flags_at_voltllm_behaviour_parse(tiny):
    args = _parse(tiny, "--device", "cpu", "--distributed-executor-backend", "mp", "-dp", "1", "--cpu-offload-gb", "0",
                  "--scheduling-policy", "fcfs", "--preemption-mode", "recompute", "--tokenizer-mode", "hf",
                  "--structured-outputs-config", '{"backend": "xgrammar", "disable_fallback": true}',
                  "--guided-decoding-backend", "xgrammar", "--model-impl", "vllm", "--disable-sliding-window",
                  "--long-prefill-token-threshold", "0", "--safetensors-load-strategy", "lazy",
                  "--max-parallel-loading-workers", "2")
    assert (args.distributed_executor_backend, args.data_parallel_size, args.scheduling_policy) == ("mp", 1, "fcfs")
    assert args.structured_outputs_config == {"backend": "xgrammar", "disable_fallback": True}
    assert args.create_engine_config().model.max_model_len == 1024  # (qwen3 here turns no sliding window on)
    for backend in ("uni", None):  # uni: one rank, the engine process's own
        EngineArgs(model=tiny, device="cpu", distributed_executor_backend=backend).create_engine_config()
    compact = EngineArgs(model=tiny, device="cpu", tokenizer_mode="auto", model_impl="auto",
                         structured_outputs_config='{"backend": "auto", "disable_any_whitespace": true}')
    assert compact.create_engine_config().json_any_whitespace is False


def test_structured_outputs_any_whitespace_setting(tiny):
    """disable_any_whitespace false (vLLM's default) lets JSON grammars take free whitespace; voltllm's default is
    the compact form (true)."""
    free = _parse(tiny, "--device", "cpu", "--structured-outputs-config", '{"disable_any_whitespace": false}')
    assert free.create_engine_config().json_any_whitespace is True
    assert EngineArgs(model=tiny, device="cpu").create_engine_config().json_any_whitespace is False


@pytest.mark.parametrize("kwargs,match", [
    ({"distributed_executor_backend": "ray"}, "--distributed-executor-backend ray: Ray is not built"),
    ({"distributed_executor_backend": "external_launcher"}, "external_launcher: engines started by torchrun"),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2}, "uni: with 2 ranks"),
    ({"distributed_executor_backend": "threads"}, "threads: it must be mp"),
    ({"scheduling_policy": "lifo"}, "--scheduling-policy lifo: not a scheduling policy; use fcfs .* or priority"),
    ({"preemption_mode": "swap"}, "--preemption-mode swap: swapping .* not built: preempted requests are recomputed"),
    ({"tokenizer_mode": "slow"}, "--tokenizer-mode slow: transformers 5, which voltllm uses, always loads the fast"),
    ({"tokenizer_mode": "mistral"}, "--tokenizer-mode mistral: mistral_common tokenizers are not built"),
    ({"tokenizer_mode": "custom"}, r"--tokenizer-mode custom: not built \(voltllm takes auto, hf\)"),
    ({"structured_outputs_config": {"backend": "guidance"}}, "backend guidance: structured outputs run through xgr"),
    ({"structured_outputs_config": {"backend": "outlines"}}, "backend outlines: structured outputs run through xgr"),
    ({"structured_outputs_config": {"disable_any_whitespace": "no"}}, "disable_any_whitespace must be true or false"),
    ({"structured_outputs_config": {"disable_fallback": "yes"}}, "disable_fallback must be true or false"),
    ({"structured_outputs_config": {"reasoning_parser": "qwen3"}}, "reasoning_parser: give it as --reasoning-parser"),
    ({"structured_outputs_config": {"whitespace_pattern": " "}}, "whitespace_pattern: not built"),
    ({"structured_outputs_config": {"enable_in_reasoning": "yes"}}, "enable_in_reasoning must be true or false"),
    ({"reasoning_config": {"think_end_str": "</think>"}}, "--reasoning-config think_end_str: not a key voltllm"),
    ({"reasoning_config": {"reasoning_start_str": "<think>"}}, "--reasoning-config needs reasoning_end_str"),
    ({"reasoning_parser": "granite"}, "--reasoning-parser 'granite' is not built"),
    ({"structured_outputs_config": "[1]"}, "--structured-outputs-config must be a JSON object"),
    ({"guided_decoding_backend": "lm-format-enforcer"}, "--guided-decoding-backend lm-format-enforcer: structured"),
    ({"model_impl": "transformers"}, "--model-impl transformers: the Transformers modeling backend is not built"),
    ({"safetensors_load_strategy": "eager"}, "--safetensors-load-strategy eager: reading whole files into memory"),
    ({"safetensors_load_strategy": "prefetch"}, "--safetensors-load-strategy prefetch: reading files into the page"),
    ({"max_parallel_loading_workers": 1, "tensor_parallel_size": 2}, "--max-parallel-loading-workers 1: loading"),
])
def test_other_values_refused_before_the_model_is_read(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=str(tmp_path / "not-read"), device="cpu", **kwargs).create_engine_config()


def test_cli_refusal_exit_code(tiny, capsys):
    from voltllm.cli import main

    assert main(["generate", "hi", tiny, "--device", "cpu", "--preemption-mode", "swap"]) == 2
    assert "voltllm: error: --preemption-mode swap: swapping" in capsys.readouterr().err


def test_reasoning_config_refusals_exit_2(tiny, capsys):
    from voltllm.cli import main

    assert main(["generate", "hi", tiny, "--device", "cpu", "--reasoning-config", '{"reasoning_end_str": "</t>"}']) == 2
    assert "voltllm: error: --reasoning-config needs reasoning_start_str" in capsys.readouterr().err


def test_a_window_the_checkpoint_turns_on_is_served_or_capped(tmp_path, tiny, caplog, monkeypatch):
    """A llama-family checkpoint's sliding-window layers run windowed, with the whole context (their runs:
    tests/model/test_sliding_window.py); --disable-sliding-window caps the context at the window instead (full
    attention agrees up to it), as does an architecture whose layers take no window, with a warning."""
    windowed = make_model(str(tmp_path / "windowed"), "qwen2", use_sliding_window=True, sliding_window=256,
                          max_window_layers=0)
    with caplog.at_level("INFO", logger="voltllm"):
        assert EngineArgs(model=windowed, device="cpu").create_engine_config().model.max_model_len == 1024
    assert "sliding-window attention (256 tokens) in layers [0, 1, 2]" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="voltllm"):
        capped = EngineArgs(model=windowed, device="cpu", disable_sliding_window=True).create_engine_config()
    assert capped.model.max_model_len == 256 and "sliding-window" not in caplog.text
    assert capped.model.hf_config.sliding_window is None  # (its layers then attend to the whole context)
    with pytest.raises(ConfigError, match=r"--max-model-len 512 exceeds .*\(its sliding window, 256 tokens"):
        EngineArgs(model=windowed, device="cpu", disable_sliding_window=True, max_model_len=512).create_engine_config()
    import voltllm.model.models.registry as registry

    monkeypatch.setattr(registry, "attention_only", lambda hf_config: False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="voltllm"):
        assert EngineArgs(model=windowed, device="cpu").create_engine_config().model.max_model_len == 256
    assert "turns on sliding-window attention (256 tokens), which voltllm does not build for qwen2" in caplog.text
    monkeypatch.undo()
    # a checkpoint without a window on: nothing to cap
    assert EngineArgs(model=tiny, device="cpu", disable_sliding_window=True
                      ).create_engine_config().model.max_model_len == 1024
