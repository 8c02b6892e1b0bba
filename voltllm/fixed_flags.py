"""vLLM engine flags that voltllm takes only at the value that is its own behaviour (ConfigError naming the flag and
what voltllm does otherwise). Each check says why that value is the true one; docs/cli.md has the same words.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from voltllm.config import ConfigError, parse_json_object


def check_fixed_flags(args: Any) -> None:
    """Raise ConfigError for the first of these flags `args` (EngineArgs) sets to a value voltllm does not run."""
    _executor_backend(args.distributed_executor_backend, args.tensor_parallel_size * args.pipeline_parallel_size)
    _one_of("--preemption-mode", args.preemption_mode, (None, "recompute"), {
        "swap": "swapping a preempted request's KV cache to CPU memory is not built: preempted requests are "
                "recomputed (their blocks freed, their tokens prefilled again)"})
    _one_of("--tokenizer-mode", args.tokenizer_mode, ("auto", "hf"), {
        "slow": "transformers 5, which voltllm uses, always loads the fast tokenizer (it ignores use_fast=False)",
        "mistral": "mistral_common tokenizers are not built: the checkpoint's Hugging Face tokenizer is used (auto)"})
    _structured_outputs(args.structured_outputs_config, args.guided_decoding_backend)
    _one_of("--model-impl", args.model_impl, ("auto", "vllm"), {
        "transformers": "the Transformers modeling backend is not built: voltllm runs its own implementations of the "
                        "architectures it supports (docs/models.md)"})
    _one_of("--safetensors-load-strategy", args.safetensors_load_strategy, (None, "lazy"), {
        "eager": "reading whole files into memory first is not built: safetensors files are memory-mapped (lazy)",
        "prefetch": "reading files into the page cache first is not built: safetensors files are memory-mapped (lazy)"})
    workers = args.max_parallel_loading_workers
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    if workers is not None and workers < ranks:
        raise ConfigError(f"--max-parallel-loading-workers {workers}: loading the {ranks} "
                          "ranks in batches is not built (every rank reads its weights at once); "
                          "leave it out or give at least the rank count (tensor x pipeline parallel size)")
    _newer_engine_flags(args)


def _newer_engine_flags(args: Any) -> None:
    """Flags of newer vLLM versions (0.11+) that guides pass, taken at voltllm's behaviour."""
    _one_of("--performance-mode", args.performance_mode, ("balanced",), {
        "interactivity": "latency tuning (finer CUDA-graph sizes for small batches) is not built: voltllm runs vLLM's "
                         "default tuning (balanced); for smaller batches' graphs give --cudagraph-capture-sizes",
        "throughput": "throughput tuning (larger batch limits) is not built: voltllm runs vLLM's default tuning "
                      "(balanced); raise --max-num-seqs / --max-num-batched-tokens instead"})
    _one_of("--logprobs-mode", args.logprobs_mode, ("raw_logprobs",), {
        mode: "voltllm returns the model's log-softmax before penalties, logit_bias, temperature and top-k / top-p "
              "(raw_logprobs; the grammar mask of structured outputs applied, as in vLLM); other modes are not built"
        for mode in ("raw_logits", "processed_logprobs", "processed_logits")})
    # (--disable-cascade-attn: either value; voltllm has no cascade attention, so there is nothing to disable)
    _one_of("--mamba-ssm-cache-dtype", args.mamba_ssm_cache_dtype, ("auto", "float32"), {
        dtype: "hybrid models keep their recurrent (SSM) state in float32 here; other dtypes are not built (auto or "
               "float32)" for dtype in ("float16", "bfloat16", "half")})
    _one_of("--mamba-cache-dtype", args.mamba_cache_dtype, ("auto",), {
        dtype: "hybrid models keep their convolution state in the model dtype and their SSM state in float32 (auto); "
               "one dtype for both is not built (--mamba-ssm-cache-dtype float32 is accepted)"
        for dtype in ("float32", "float16", "bfloat16", "half")})
    _one_of("--config-format", args.config_format, ("auto", "hf"), {
        "mistral": "Mistral's params.json format is not built: the checkpoint's Hugging Face config.json is read "
                   "(auto / hf)"})
    attention_backend_of(args)


def attention_backend_of(args: Any) -> Optional[str]:
    """--attention-backend, or vLLM's newer -ac/--attention-config '{"backend": ...}' (its one key built here);
    ConfigError for other keys or two different backends."""
    backend = _attention_config_backend(args)
    if (backend or "").upper() not in ("", "TRITON_ATTN", "TORCH_REF"):
        raise ConfigError(f"--attention-backend {backend}: not built here (TRITON_ATTN, TORCH_REF, or FLASH_ATTN_V100 "
                          "on the command line, an alias of TRITON_ATTN)")
    return backend


def _attention_config_backend(args: Any) -> Optional[str]:
    config = args.attention_config
    if config is None:
        return args.attention_backend
    config = parse_json_object("--attention-config", config)
    for key in config:
        if key != "backend":
            raise ConfigError(f"--attention-config {key}: not built (voltllm runs its own Triton attention kernels; "
                              "only backend is read, as --attention-backend takes it)")
    backend = config.get("backend")
    if backend == "FLASH_ATTN_V100":
        backend = "TRITON_ATTN"
    if backend is not None and args.attention_backend is not None and backend != args.attention_backend:
        raise ConfigError(f"--attention-config backend {backend} and --attention-backend {args.attention_backend} "
                          "differ: give one")
    return backend if backend is not None else args.attention_backend


def _executor_backend(backend: Optional[str], tp: int) -> None:
    if backend in (None, "mp"):
        return  # tensor-parallel ranks 1..N-1 are multiprocessing worker processes (voltllm.distributed)
    if backend == "uni" and tp == 1:
        return  # one rank: the model runs in the engine process
    why = {"uni": f"with {tp} ranks (tensor x pipeline parallel) the ranks are worker processes (mp)",
           "ray": "Ray is not built: tensor-parallel ranks are multiprocessing worker processes (mp)",
           "external_launcher": "engines started by torchrun are not built: voltllm spawns its tensor-parallel "
                                "ranks itself (mp)"}.get(backend, "it must be mp (or uni with one rank)")
    raise ConfigError(f"--distributed-executor-backend {backend}: {why}")


def _one_of(flag: str, value: Any, accepted: tuple, refused: dict[str, str]) -> None:
    if value in accepted:
        return
    shown = ", ".join(str(v) for v in accepted if v is not None)
    why = refused.get(value, f"not built (voltllm takes {shown})")
    raise ConfigError(f"{flag} {value}: {why}")


# --structured-outputs-config keys; structured outputs run through xgrammar (voltllm.structured)
_STRUCTURED_BACKENDS = ("auto", "xgrammar")
_XGRAMMAR_ONLY = "structured outputs run through xgrammar only (auto or xgrammar)"


def _structured_outputs(config: Any, guided_decoding_backend: Optional[str]) -> None:
    if guided_decoding_backend is not None and guided_decoding_backend not in _STRUCTURED_BACKENDS:
        raise ConfigError(f"--guided-decoding-backend {guided_decoding_backend}: {_XGRAMMAR_ONLY}")
    if config is None:
        return
    config = parse_json_object("--structured-outputs-config", config)
    for key, value in config.items():
        if key == "backend":
            if value not in _STRUCTURED_BACKENDS:
                raise ConfigError(f"--structured-outputs-config backend {value}: {_XGRAMMAR_ONLY}")
        elif key == "disable_fallback":
            if not isinstance(value, bool):
                raise ConfigError(f"--structured-outputs-config disable_fallback must be true or false, got {value!r}")
            # either way: xgrammar never falls back to another backend here
        elif key == "disable_any_whitespace":
            if not isinstance(value, bool):
                raise ConfigError(f"--structured-outputs-config disable_any_whitespace must be true or false, got "
                                  f"{json.dumps(value)}")
            # read by json_any_whitespace(): false lets JSON grammars take whitespace between tokens
        elif key == "enable_in_reasoning":
            if not isinstance(value, bool):
                raise ConfigError(f"--structured-outputs-config enable_in_reasoning must be true or false, got "
                                  f"{value!r}")
            # read by enable_in_reasoning(): whether grammars constrain the reasoning too (voltllm/reasoning_config.py)
        elif key == "reasoning_parser":
            raise ConfigError("--structured-outputs-config reasoning_parser: give it as --reasoning-parser")
        else:
            raise ConfigError(f"--structured-outputs-config {key}: not built (voltllm reads backend, disable_fallback, "
                              "disable_any_whitespace and enable_in_reasoning)")


def enable_in_reasoning(config: Any) -> bool:
    """--structured-outputs-config enable_in_reasoning (vLLM's, default false): grammars constrain from the first
    token, the reasoning included, rather than from the end of the reasoning (checked by _structured_outputs)."""
    return bool((parse_json_object("--structured-outputs-config", config) or {}).get("enable_in_reasoning", False))


def json_any_whitespace(config: Any) -> bool:
    """--structured-outputs-config disable_any_whitespace false: JSON grammars take any whitespace between JSON tokens
    (xgrammar's any_whitespace, vLLM's default). voltllm's default is true, the compact form: the same JSON in fewer
    tokens, and no model spending its tokens on whitespace inside an object (checked by _structured_outputs)."""
    return not (parse_json_object("--structured-outputs-config", config) or {}).get("disable_any_whitespace", True)
