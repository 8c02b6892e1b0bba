"""Well-known vLLM flags voltllm does not build: each one is refused with why (exit 2) instead of argparse's bare
"unrecognized arguments". A data table; cli.main consults it before parsing, `--config` files and LLM(...) too.

A flag voltllm's parser defines is never refused from here (its own check applies), so building one later only
means adding the flag.
"""
from __future__ import annotations

from typing import Iterable, Optional

_LORA_SHARDED = ("fully sharded LoRA weights are not built (under --tensor-parallel-size each rank cuts B of the "
                 "column-parallel and A of the row-parallel projections, as their base weights; "
                 "--no-fully-sharded-loras is what runs)")
_LORA_BIAS = "LoRA biases are not built (adapters with bias 'none' only)"
_LORA_LONG = "long-context LoRA (scaling factors) is not built (vLLM removed it too)"
_LORA_MM = "per-modality default LoRAs are not built"
_PROMPT_ADAPTERS = "prompt adapters are not built in voltllm (vLLM removed them too)"
_SPEC_OLD = ("an older vLLM flag: speculative decoding is configured with --speculative-config, e.g. "
             "'{\"model\": DRAFT, \"num_speculative_tokens\": 4}' or '{\"method\": \"ngram\", ...}' (docs/cli.md)")
_MULTI_STEP = ("multi-step scheduling (removed in vLLM V1) is not built; async scheduling, on by default, overlaps "
               "the host's work for the next step with the GPU's current one instead")
_MULTIMODAL = ("this multimodal setting is not built: image input is (Qwen3.5, Qwen3-VL, Qwen2.5-VL and Qwen2-VL; "
               "video for Qwen3.5 and Qwen3-VL; with --limit-mm-per-prompt, --mm-processor-kwargs, --media-io-kwargs, "
               "--allowed-local-media-path, --allowed-media-domains, --mm-processor-cache-gb); audio, embeddings as "
               "input and shared-memory processor caches are not")
_EPLB = ("the expert-parallel load balancer (redundant experts moved between ranks) is not built: "
         "--enable-expert-parallel places each rank's experts once, linearly")
_ALL2ALL = ("all-to-all token exchange (expert parallelism across data-parallel engines) is not built: under "
            "--enable-expert-parallel every -tp rank routes every token and one all-reduce sums the MoE output")
_DATA_PARALLEL = ("data parallelism over several nodes or API servers is not built: --data-parallel-size N runs N "
                  "engines on this machine behind one API server")
_KV_TRANSFER = "disaggregated prefill / KV cache transfer between engines is not built"
_DETAILED_TRACES = ("per-request model forward / execute times are not measured (a step runs many requests at once, "
                    "and timing its forward would wait for the device); --otlp-traces-endpoint's llm_request spans "
                    "carry each request's queue, prefill, decode and inference times")
_DBO = "dual-batch overlap (micro-batches overlapping expert-parallel communication) is not built"
_OWN_KERNELS = "voltllm runs its own Triton kernels (docs/kernels.md); vLLM's kernel and backend choices are not built"
_TOOL_SERVER = "built-in tools run by the server (gpt-oss's browser / python through MCP tool servers) are not built"

UNBUILT_FLAGS: dict[str, str] = {
    # LoRA (--enable-lora and its settings are built: voltllm/lora/)
    "--lora-extra-vocab-size": "adapters with extra vocabulary are not built (vLLM deprecated it)",
    "--fully-sharded-loras": _LORA_SHARDED, "--enable-lora-bias": _LORA_BIAS,
    "--long-lora-scaling-factors": _LORA_LONG, "--default-mm-loras": _LORA_MM,
    "--enable-prompt-adapter": _PROMPT_ADAPTERS, "--max-prompt-adapters": _PROMPT_ADAPTERS,
    "--max-prompt-adapter-token": _PROMPT_ADAPTERS, "--prompt-adapters": _PROMPT_ADAPTERS,
    # parallelism
    "--enable-eplb": _EPLB, "--eplb-config": _EPLB, "--all2all-backend": _ALL2ALL,
    "--data-parallel-size-local": _DATA_PARALLEL, "--data-parallel-address": _DATA_PARALLEL,
    "--data-parallel-rpc-port": _DATA_PARALLEL, "--data-parallel-backend": _DATA_PARALLEL,
    "--data-parallel-start-rank": _DATA_PARALLEL, "--data-parallel-hybrid-lb": _DATA_PARALLEL,
    "--data-parallel-external-lb": _DATA_PARALLEL,
    "--decode-context-parallel-size": "decode context parallelism is not built",
    "--headless": "headless engines (no API server, for multi-node data parallelism) are not built",
    "--api-server-count": "one API server process serves every request here (1); several are not built",
    "--data-parallel-rank": _DATA_PARALLEL, "--data-parallel-multi-port-external-lb": _DATA_PARALLEL,
    "--disable-nccl-for-dp-synchronization": _DATA_PARALLEL,
    "--enable-dbo": _DBO, "--dbo-decode-token-threshold": _DBO, "--dbo-prefill-token-threshold": _DBO,
    "--ray-workers-use-nsight": "Ray is not built: tensor-parallel ranks are multiprocessing worker processes",
    "--worker-cls": "custom worker classes are not built",
    "--worker-extension-cls": "custom worker classes are not built",
    # speculative decoding: vLLM's older flags
    "--speculative-model": _SPEC_OLD, "--num-speculative-tokens": _SPEC_OLD,
    "--speculative-draft-tensor-parallel-size": _SPEC_OLD, "--speculative-max-model-len": _SPEC_OLD,
    "--speculative-disable-by-batch-size": _SPEC_OLD, "--ngram-prompt-lookup-max": _SPEC_OLD,
    "--ngram-prompt-lookup-min": _SPEC_OLD, "--spec-decoding-acceptance-method": _SPEC_OLD,
    "--num-lookahead-slots": "an older vLLM flag of speculative decoding: --speculative-config reserves the slots; "
                             "drop it",
    # scheduling: vLLM's older or removed flags
    "--num-scheduler-steps": _MULTI_STEP, "--multi-step-stream-outputs": _MULTI_STEP,
    "--use-v2-block-manager": "an older vLLM flag (its v2 block manager became the only one): drop it; voltllm's "
                              "KV cache is paged in blocks as in vLLM V1",
    "--scheduler-delay-factor": "delaying prompts is not built: waiting requests are admitted at the next step",
    "--scheduler-cls": "custom scheduler classes are not built",
    "--max-seq-len-to-capture": "an older vLLM flag: voltllm's decode CUDA graphs cover every context up to "
                                "--max-model-len; drop it (batch sizes: --compilation-config)",
    # models and loading
    "--rope-scaling": "an older vLLM flag: give it as --hf-overrides '{\"rope_scaling\": {...}}'",
    "--rope-theta": "an older vLLM flag: give it as --hf-overrides '{\"rope_theta\": ...}'",
    "--tokenizer-pool-size": "an older vLLM flag (removed there): drop it",
    "--tokenizer-pool-type": "an older vLLM flag (removed there): drop it",
    "--model-loader-extra-config": "model loader plugins are not built",
    "--quantization-param-path": ("an older vLLM flag: fp8 KV cache scales come from the checkpoint or "
                                  "--calculate-kv-scales"),
    "--logits-processors": "custom logits processor classes are not built",
    # reasoning and tools: vLLM's older flags and plugins
    "--enable-reasoning": "an older vLLM flag: --reasoning-parser NAME alone turns reasoning parsing on",
    "--tool-parser-plugin": "tool parser plugins are not built (the built parsers: --tool-call-parser)",
    "--reasoning-parser-plugin": "reasoning parser plugins are not built (the built parsers: --reasoning-parser)",
    # multimodal
    "--mm-encoder-tp-mode": _MULTIMODAL,
    "--interleave-mm-strings": _MULTIMODAL, "--skip-mm-profiling": _MULTIMODAL,
    # disaggregation, observability
    "--mm-processor-cache-type": _MULTIMODAL, "--mm-shm-cache-max-object-size-mb": _MULTIMODAL,
    "--mm-encoder-attn-backend": _MULTIMODAL, "--enable-mm-embeds": _MULTIMODAL, "--video-pruning-rate": _MULTIMODAL,
    "--disable-chunked-mm-input": _MULTIMODAL, "--trust-request-mm-kwargs": _MULTIMODAL,
    # disaggregation, observability
    "--kv-transfer-config": _KV_TRANSFER,
    "--ec-transfer-config": "encoder-cache transfer between engines (multimodal disaggregation) is not built",
    "--collect-detailed-traces": _DETAILED_TRACES,
    "--aggregate-engine-logging": "one stats log line over the data-parallel engines is not built: each line is "
                                  "engine 0's client view of all engines' requests",
    "--enable-per-request-metrics": "per-request timing metrics in responses are not built (the same timings feed "
                                    "GET /metrics)",
    # kernels and engine internals of newer vLLM
    "--kernel-config": _OWN_KERNELS, "--moe-backend": _OWN_KERNELS, "--enable-flashinfer-autotune": _OWN_KERNELS,
    "--disable-hybrid-kv-cache-manager": "hybrid models' KV cache is always managed per layer kind here (attention "
                                         "pages and recurrent-state slots); one manager for every layer is not built",
    "--override-attention-dtype": "an attention dtype other than the model's is not built",
    "--kv-sharing-fast-prefill": "KV sharing across layers is not built",
    "--enable-return-routed-experts": "returning MoE routing decisions is not built",
    "--weight-transfer-config": "weight updates from a trainer (/update_weights) are not built",
    "--io-processor-plugin": "IO processor plugins are not built",
    "--logits-processor-pattern": "custom logits processor classes are not built",
    "--additional-config": "platform plugins' extra configuration is not built",
    # models and loading, newer flags
    "--code-revision": "remote code from another revision is not built (--revision fetches the model's)",
    # frontend (serve) flags of newer vLLM
    "--tool-server": _TOOL_SERVER,
    "--log-error-stack": "stack traces of error responses are not logged (500s are logged with their error)",
    "--enable-offline-docs": "vendored offline /docs assets are not built (/docs loads Swagger UI from a CDN)",
    "--grpc": "the gRPC server is not built (HTTP only)",
    "--tokens-only": "the tokens-in / tokens-out server (/inference/v1/generate only) is not built",
    "--fingerprint-mode": "system_fingerprint is always null here (vLLM's older behaviour)",
    "--fingerprint-value": "system_fingerprint is always null here (vLLM's older behaviour)",
    "--show-hidden-metrics-for-version": "voltllm hides no metric (accepted at any version)",
}

# vLLM's single-dash spellings of table flags
SHORT_ALIASES = {"-asc": "--api-server-count", "-dpn": "--data-parallel-rank"}


# Unbuilt features' settings that voltllm matches when the feature is off, as vLLM runs them then (lm-evaluation-
# harness passes enable_lora=False and max_lora_rank to every vLLM engine; LoRA is built now, and its settings are
# EngineArgs fields): a switch's off form, the settings that
# only act while their switch is on (which voltllm refuses), and the values that name what voltllm does.
SWITCHES_OFF = frozenset({"--enable-prompt-adapter", "--enable-eplb",
                          "--fully-sharded-loras", "--enable-lora-bias",
                          "--enable-dbo", "--disable-nccl-for-dp-synchronization", "--enable-mm-embeds",
                          "--disable-chunked-mm-input", "--trust-request-mm-kwargs",
                          "--aggregate-engine-logging", "--enable-per-request-metrics",
                          "--enable-flashinfer-autotune", "--disable-hybrid-kv-cache-manager",
                          "--kv-sharing-fast-prefill", "--enable-return-routed-experts",
                          "--log-error-stack",
                          "--enable-offline-docs", "--grpc", "--tokens-only",
                          "--data-parallel-multi-port-external-lb"})
WHILE_SWITCHED_ON = frozenset({"--lora-extra-vocab-size", "--max-prompt-adapters",
                               "--max-prompt-adapter-token", "--eplb-config", "--dbo-decode-token-threshold",
                               "--dbo-prefill-token-threshold"})
# accepted at any value: there is nothing here for them to change (voltllm hides no metric)
INERT = frozenset({"--show-hidden-metrics-for-version"})
VOLTLLM_VALUES = {"--num-scheduler-steps": ("1",), "--num-lookahead-slots": ("0",),
                  "--scheduler-delay-factor": ("0", "0.0"), "--api-server-count": ("1",),
                  # the vision tower runs whole on rank 0, which broadcasts its rows (worker/image_step.py): its
                  # weights are not split and its data is not divided, whichever mode is asked; both run it so
                  "--mm-encoder-tp-mode": ("weights", "data"),
                  "--fingerprint-mode": ("none",)}
_FALSE = ("false", "0", "no", "off")


def accepted_setting(flag: str, value: object) -> bool:
    """Whether an unbuilt vLLM flag at `value` (True for a bare switch, a string or a Python value) is what voltllm
    does anyway; `flag` dashed, without its --no- prefix."""
    if flag in WHILE_SWITCHED_ON or flag in INERT:
        return True
    if flag in SWITCHES_OFF:
        return value is False or value is None or str(value).lower() in _FALSE
    if flag in VOLTLLM_VALUES:
        return str(value).lower() in VOLTLLM_VALUES[flag]
    return False


def screen_unbuilt_flags(argv: list[str], known: Iterable[str] = ()) -> tuple[list[str], Optional[str]]:
    """(argv without the unbuilt vLLM flags it sets to what voltllm does anyway, `FLAG: why` for the first it does
    not, else None). Flags voltllm's parser defines (`known`) are left alone; words after `--` are values."""
    known = set(known)
    kept: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag = _flag_of(arg) or SHORT_ALIASES.get(arg.split("=", 1)[0])
        if arg == "--":
            return kept + argv[i:], None
        if flag is None or flag in known:
            kept.append(arg)
            i += 1
            continue
        off = flag.startswith("--no-")
        positive = "--" + flag[len("--no-"):] if off else flag  # (--no-enable-lora)
        message = UNBUILT_FLAGS.get(flag) or UNBUILT_FLAGS.get(positive)
        if message is None:
            kept.append(arg)
            i += 1
            continue
        if "=" in arg:
            value, used = arg.split("=", 1)[1], 1
        elif off or positive in SWITCHES_OFF:
            value, used = not off, 1
        else:
            value, used = (argv[i + 1], 2) if i + 1 < len(argv) and not argv[i + 1].startswith("--") else (None, 1)
        if not accepted_setting(positive, value):
            return argv, f"{flag}: {message}"
        i += used
    return kept, None


def _flag_of(arg: str) -> Optional[str]:
    """The flag a command-line word names (`--max-loras=4` -> `--max-loras`), None for a value."""
    if not arg.startswith("--"):
        return None
    return arg.split("=", 1)[0].split(".", 1)[0]


def unbuilt_flag_error(argv: Iterable[str], known: Iterable[str] = ()) -> Optional[str]:
    """`FLAG: why` for the first word of argv (underscores already dashed) that is an unbuilt vLLM flag voltllm's
    parser does not define (`known`: its option strings), at a value voltllm does not match; else None."""
    return screen_unbuilt_flags(list(argv), known)[1]


def unbuilt_setting_error(name: str, value: object = True) -> Optional[str]:
    """For a setting named without dashes (a `--config` file key, an LLM(...) keyword) at `value`: why it is not
    built, or None (not an unbuilt vLLM flag; or one at what voltllm does anyway: accepted_setting)."""
    flag = "--" + name.replace("_", "-")
    message = UNBUILT_FLAGS.get(flag)
    return None if message is None or accepted_setting(flag, value) else f"{name}: {message}"


def is_accepted_setting(name: str, value: object) -> bool:
    """An unbuilt vLLM setting (a `--config` key, an LLM(...) keyword) at what voltllm does anyway: to be dropped."""
    flag = "--" + name.replace("_", "-")
    return flag in UNBUILT_FLAGS and accepted_setting(flag, value)
