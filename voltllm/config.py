"""Typed configuration: EngineArgs (flat, vLLM flag names) -> frozen EngineConfig (validated).

No behaviour is switched by environment variables; every knob is a field here.
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch

from voltllm.cuda_graph_config import CudaGraphConfig
from voltllm.model.loader.load_options import DEFAULT_IGNORE_PATTERNS

if TYPE_CHECKING:
    from voltllm.multimodal.config import MultiModalConfig

logger = logging.getLogger("voltllm")


class ConfigError(ValueError):
    """A configuration the engine cannot run; the message says which flag and why."""


_DTYPES = {
    "half": torch.float16, "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float": torch.float32, "float32": torch.float32, "fp32": torch.float32,
}
# Experiment knob (benchmarks/set_and_run.py A/B runs, tests): a quantized checkpoint's weights (GGUF, AWQ, GPTQ,
# FP8, NVFP4, bitsandbytes 4-bit) on the GPU are kept quantized (1), dequantized at load (0), or chosen by size (-1,
# the default: "auto")
KEEP_QUANTIZED = -1
# --quantization values: the checkpoint's own method, under vLLM's names (the *_marlin names pick vLLM's kernels
# for the same checkpoints; here they mean the same as awq / gptq; vLLM turns `modelopt` into `modelopt_fp4` for an
# NVFP4 checkpoint, and only NVFP4 ones are read here)
QUANTIZATION_ALIASES = {"gguf": "gguf", "awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
                        "fp8": "fp8", "modelopt": "modelopt_fp4", "modelopt_fp4": "modelopt_fp4",
                        "compressed-tensors": "compressed-tensors", "bitsandbytes": "bitsandbytes"}
# the methods read, as ModelConfig.quantization names them
_READ_METHODS = ("gguf", "awq", "gptq", "fp8", "modelopt_fp4", "compressed-tensors", "bitsandbytes")
# --scheduling-policy (vLLM's): fcfs, or priority (each request's `priority`, lower first, then arrival)
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "float16", "bfloat16", "float32")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # path of an HF directory or a .gguf file
    tokenizer: str
    served_model_name: str
    dtype: torch.dtype
    max_model_len: int
    hf_config: Any  # transformers.PretrainedConfig
    trust_remote_code: bool = False
    seed: int = 0
    generation_config: str = "auto"
    override_generation_config: Optional[dict] = None  # sampling defaults merged over generation_config's
    chat_template: Optional[str] = None
    language_model_only: bool = False
    # a GGUF model's vision projector file (llama.cpp's mmproj-*.gguf: --mmproj, or the one beside the model file);
    # None: none (a text-only model, a Hugging Face directory, or --language-model-only)
    mmproj: Optional[str] = None
    load_format: str = "auto"  # auto | dummy (random weights at the checkpoint's shapes, for benchmarks)
    use_tqdm_on_load: bool = True  # --use-tqdm-on-load: a progress bar over the checkpoint's files while loading
    # --ignore-patterns / --pt-load-map-location: the checkpoint's files left out, and where torch.load puts a .bin
    # checkpoint's tensors first (model/loader/load_options.py)
    ignore_patterns: tuple[str, ...] = DEFAULT_IGNORE_PATTERNS
    pt_load_map_location: Any = "cpu"
    enable_prompt_embeds: bool = False  # --enable-prompt-embeds: prompts as embedding rows (engine/prompt_embeds.py)
    skip_tokenizer_init: bool = False
    # the quantization method ("gguf", "awq", "gptq", "fp8", "modelopt_fp4" (NVFP4), "compressed-tensors" (NVFP4,
    # int4, int8 or FP8 layers: model/loader/compressed_tensors_checkpoint.py), "bitsandbytes" (NF4 / FP4, kept
    # quantized like the others; int8 always dequantized at load); None: unquantized), from the file itself (or fp8 /
    # bitsandbytes at load)
    quantization: Optional[str] = None
    # a quantized checkpoint's weights: "quantized" (they stay quantized on the GPU, model/layers/quantized_linear.py;
    # --quantization METHOD), "dequantized" (to the compute dtype at load: the CPU, unquantized checkpoints,
    # architectures without quantized layers), or "auto" (a GPU without the flag: quantized when the dequantized
    # weights would crowd the card, worker/runner.py)
    quantized_weights: str = "dequantized"
    # --max-model-len auto (or -1): max_model_len is the model's maximum until the KV cache is sized, then lowered
    # to the tokens the cache holds (worker/runner.py fit_max_model_len)
    max_model_len_fit: bool = False
    # generate | pooling (--runner / --convert / --task, voltllm/pooling/config.py): one runner per engine, as vLLM's
    runner: str = "generate"
    pooler: Optional[Any] = None  # a pooling engine's pooling.config.PoolerConfig

    @property
    def architecture(self) -> str:
        return getattr(self.hf_config, "model_type", "unknown")

    def weights_source(self) -> Any:
        """The model's loader.ModelSource, with its load options (what the workers read the weights from)."""
        from voltllm.model.loader import resolve_model

        return resolve_model(self.model, ignore_patterns=self.ignore_patterns,
                             pt_map_location=self.pt_load_map_location)

    @property
    def prompt_embeds_width(self) -> Optional[int]:
        """The hidden size prompt embeddings must have (None: --enable-prompt-embeds is off)."""
        return self.hf_config.get_text_config().hidden_size if self.enable_prompt_embeds else None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "blake2b"  # --prefix-caching-hash-algo (cache/prefix.py HASH_ALGOS)
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # fp8 caches: k/v scales from the first real forward (attention/kv_spec.py)
    calculate_key_offsets: bool = False  # fp8 caches: keys stored centered on the first forward's mean (kv_spec.py)
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: Optional[int] = None
    # --kv-cache-memory-bytes: the KV cache's size (recurrent-state slots included), instead of the share left by
    # --gpu-memory-utilization; on the CPU it replaces cpu_kv_cache_bytes
    kv_cache_memory_bytes: Optional[int] = None
    cpu_kv_cache_bytes: int = 2 << 30
    mamba_block_size: Optional[int] = None
    mamba_cache_mode: str = "align"
    # --kv-offloading-size: GiB of host memory for the prefix cache's CPU tier, all tensor-parallel ranks together
    # (vLLM's meaning; None: off); --kv-offloading-backend: "native" (voltllm's own, cache/cpu_offload.py)
    kv_offloading_size: Optional[float] = None
    kv_offloading_backend: str = "native"
    # --kv-cache-metrics: the residency of a --kv-cache-metrics-sample share of the blocks (cache/residency.py;
    # 0: off)
    kv_cache_metrics_sample: float = 0.0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 4096
    async_scheduling: bool = True
    # --scheduling-policy: the waiting queue's order and the preemption victim (engine/request_queue.py)
    policy: SchedulingPolicy = "fcfs"
    # --long-prefill-token-threshold: at most this many of a request's tokens per step (0: no cap), so one long
    # prompt leaves room in each step for the prompts that arrive after it (vLLM's rule)
    long_prefill_token_threshold: int = 0


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device
    compat: str = "none"  # none | sm70 | sm75 : the route for GPUs without native bf16/fp8
    enforce_eager: bool = False
    attention_backend: Optional[str] = None
    require_acceleration: bool = False  # refuse to start when an expected route is disabled (voltllm.acceleration)
    # prompt steps (prefill chunks, mixed batches) of up to this many tokens replay piecewise CUDA graphs
    # (voltllm.worker.prompt_graphs); None: by the layers' width and the GPU's speed (prompt_graphs.auto_max_tokens);
    # 0 turns them off, as --enforce-eager does
    prompt_graph_max_tokens: Optional[int] = None
    # the CUDA graphs --compilation-config / -O / --cuda-graph-sizes ask for (voltllm.cuda_graph_config); with mode NONE
    # enforce_eager is set too, and without prompt graphs prompt_graph_max_tokens is 0
    cuda_graphs: CudaGraphConfig = field(default_factory=CudaGraphConfig)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks: the engine's runner is rank 0, 1..N-1 are worker processes (distributed/)
    # rows at which MLP / expert intermediate dimensions are split: 1 (evenly), or a quantized group where an even
    # share would cut one (distributed.sharding.intermediate_split)
    intermediate_align: int = 1
    # --enable-expert-parallel where it applies (a MoE model over ranks > 1; with one rank vLLM's flag changes
    # nothing, so it is False there): each rank holds whole routed experts, placed linearly (distributed/experts.py)
    enable_expert_parallel: bool = False
    # --data-parallel-size: engines (each with its tensor-parallel ranks) serving one API server, each a whole copy of
    # the model on its own GPUs (engine/data_parallel.py); the offline LLM and the in-process bench run one
    data_parallel_size: int = 1
    data_parallel_rank: int = 0  # this engine's index among them (rank_config sets it)
    # --pipeline-parallel-size: the decoder layers cut into this many stages, one rank each (distributed/pipeline.py)
    pipeline_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        """The engine's ranks (processes, one GPU each): its tensor-parallel ranks times its pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def global_seed(self, seed: int) -> int:
        """The seed of a process's global RNG (unseeded requests' sampling): --seed, offset by the data-parallel
        engine's index, so engines do not draw the same numbers (the ranks of one engine share it: they sample
        alike)."""
        return seed + self.data_parallel_rank


# --max-lora-rank values (vLLM's): the rank every slot is padded to
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    """--enable-lora and its settings (voltllm/lora/): adapters per batch (GPU slots), the rank slots are sized for,
    adapters kept in CPU memory, and the dtype of their weights (the model's)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    lora_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: Optional[Any] = None  # engine.speculative.SpeculativeConfig (--speculative-config)
    quantization: Optional[str] = None
    lora: Optional[LoRAConfig] = None  # --enable-lora (None: off)
    # --reasoning-parser / --reasoning-config: the reasoning's delimiters as token ids (reasoning_config.py; None:
    # neither given); the Frontend hands them to the requests that need them
    reasoning: Optional[Any] = None
    # --structured-outputs-config disable_any_whitespace false: JSON grammars take whitespace between tokens
    json_any_whitespace: bool = False
    # --cpu-offload-gb / --offload-group-size: decoder layers kept in CPU memory (weight_offload_config.py; None: off)
    weight_offload: Optional[Any] = None
    # image input's settings (--limit-mm-per-prompt, --mm-processor-kwargs, the media flags); text-only models ignore
    # them
    multimodal: "MultiModalConfig" = field(default_factory=lambda: _default_multimodal())
    # --enable-sleep-mode: sleep(level) / wake_up(tags) free and restore the weights' and the KV cache's device memory
    # (worker/sleep_mode.py)
    enable_sleep_mode: bool = False
    # --profiler-config: the engine's profiler between start_profile and stop_profile (profiling.py; None: off)
    profiler: Optional[Any] = None
    # --enable-mfu-metrics: each step's estimated FLOPs and bytes per GPU into the stats (perf_metrics.py)
    enable_mfu_metrics: bool = False
    # --kv-events-config: the prefix cache's KV events published over ZeroMQ (kv_events_config.KVEventsConfig; None:
    # off, nothing collected, no socket)
    kv_events: Optional[Any] = None
    # --otlp-traces-endpoint: where the API process (or the offline LLM) sends each finished request's span
    # (tracing_config.OtlpTracesConfig; None: off). The engine process does not read it.
    otlp_traces: Optional[Any] = None


def _default_multimodal() -> "MultiModalConfig":
    from voltllm.multimodal.config import MultiModalConfig  # (it imports this module's ConfigError)

    return MultiModalConfig()


@dataclass
class EngineArgs:
    """Flat arguments, one per CLI flag (vLLM names with '-' for '_')."""

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    revision: Optional[str] = None  # Hub repo ids only (loader/hub.py)
    tokenizer_revision: Optional[str] = None
    download_dir: Optional[str] = None
    hf_token: Any = None  # str, or True: the stored login
    served_model_name: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Union[int, str, None] = None  # tokens; "auto" or -1: what the KV cache holds, up to the model's
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: Optional[int] = None  # bytes for the KV cache; replaces --gpu-memory-utilization's share
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "blake2b"  # cache/prefix.py HASH_ALGOS
    seed: int = 0
    trust_remote_code: bool = False
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    calculate_key_offsets: bool = False
    kv_cache_metrics: bool = False  # vLLM's: KV block residency histograms (cache/residency.py)
    kv_cache_metrics_sample: float = 0.01
    enforce_eager: bool = False
    compilation_config: Optional[Any] = None  # JSON object, dict or vLLM's bare mode number (voltllm.cuda_graph_config)
    optimization_level: Optional[int] = None  # -O N (None: vLLM's default, 2)
    cuda_graph_sizes: Optional[list[int]] = None  # vLLM's older flag: one value N is 1, 2, 4, 8, 16, ... N
    cudagraph_capture_sizes: Optional[list[int]] = None
    max_cudagraph_capture_size: Optional[int] = None
    attention_backend: Optional[str] = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engines side by side (serve / run-batch; engine/data_parallel.py)
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # -ep: MoE layers' routed experts placed whole on the -tp ranks
    expert_placement_strategy: str = "linear"  # linear (round_robin falls back to it, as in vLLM for these models)
    enable_chunked_prefill: Optional[bool] = None  # None / True: chunked (the only mode); False is refused
    swap_space: Optional[float] = None  # accepted (no-op): preemption recomputes
    disable_custom_all_reduce: bool = False  # accepted (no-op): all-reduces always go through NCCL / gloo
    quantization: Optional[str] = None
    speculative_config: Optional[Any] = None
    hf_overrides: Optional[Any] = None  # JSON object (or dict): fields of the HF config to change (RoPE scaling, ...)
    hf_config_path: Optional[str] = None  # the HF config from another directory / file / Hub repo (config_path.py)
    generation_config: str = "auto"
    override_generation_config: Optional[Any] = None  # JSON object: sampling defaults over generation_config's
    chat_template: Optional[str] = None
    device: str = "auto"
    compat: str = "auto"
    num_gpu_blocks_override: Optional[int] = None
    mamba_block_size: Optional[int] = None
    mamba_cache_mode: str = "align"
    kv_offloading_size: Optional[float] = None  # GiB of host memory for evicted prefix-cache blocks (all TP ranks)
    kv_offloading_backend: str = "native"  # native (lmcache is not built)
    # weight offloading to CPU memory (vLLM's flags; voltllm/weight_offload_config.py, worker/weight_offload.py)
    cpu_offload_gb: float = 0
    cpu_offload_params: Optional[Any] = None  # names (list, or one comma-separated string)
    offload_backend: str = "auto"  # auto (= prefetch) | prefetch | uva
    offload_group_size: int = 0
    offload_num_in_group: int = 1
    offload_prefetch_step: int = 1
    language_model_only: bool = False
    # llama.cpp's --mmproj: the vision projector file of a GGUF model (default: the projector fetched with an
    # owner/name:QUANT Hub model, else the *mmproj*.gguf beside the model file)
    mmproj: Optional[str] = None
    # llama.cpp's --no-mmproj: no projector fetched or looked for beside the model (text only; --mmproj still loads)
    no_mmproj: bool = False
    async_scheduling: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority (SCHEDULING_POLICIES)
    load_format: str = "auto"
    use_tqdm_on_load: bool = True
    ignore_patterns: Any = None  # glob patterns (a list, or one string); None: original/*
    pt_load_map_location: Any = "cpu"  # a device, or a JSON object / dict of devices (torch.load's map_location)
    enable_prompt_embeds: bool = False  # vLLM's: prompts as embedding rows (engine/prompt_embeds.py)
    skip_tokenizer_init: bool = False
    require_acceleration: bool = False
    # vLLM flags taken at the value that is voltllm's behaviour, refused at others (voltllm/fixed_flags.py)
    distributed_executor_backend: Optional[str] = None  # mp (uni with one rank)
    preemption_mode: Optional[str] = None  # recompute
    tokenizer_mode: str = "auto"  # auto | hf: the checkpoint's Hugging Face (fast) tokenizer
    structured_outputs_config: Optional[Any] = None  # JSON object: backend auto | xgrammar
    guided_decoding_backend: Optional[str] = None  # vLLM's older flag: auto | xgrammar
    # reasoning models (vLLM's): the parser (serve's --reasoning-parser) and --reasoning-config's JSON object
    # (reasoning_start_str / reasoning_end_str); voltllm/reasoning_config.py
    reasoning_parser: Optional[str] = None
    reasoning_config: Optional[Any] = None
    model_impl: str = "auto"  # auto | vllm: voltllm's own model implementations
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1  # > 1: the threshold defaults to 4% of --max-model-len (vLLM's rule)
    max_long_partial_prefills: int = 1
    safetensors_load_strategy: Optional[str] = None  # lazy (memory-mapped)
    max_parallel_loading_workers: Optional[int] = None  # >= tensor_parallel_size: every rank loads at once
    performance_mode: str = "balanced"  # vLLM's default tuning (the others are not built)
    logprobs_mode: str = "raw_logprobs"  # logprobs of the model's distribution, before any sampling processor
    disable_cascade_attn: bool = False  # no cascade attention is built: either value
    mamba_cache_dtype: str = "auto"  # recurrent state: conv state in the model dtype, SSM state in float32
    mamba_ssm_cache_dtype: str = "auto"  # auto | float32: the SSM state is always float32
    config_format: str = "auto"  # auto | hf: the checkpoint's Hugging Face config.json
    attention_config: Optional[Any] = None  # -ac: {"backend": ...} only (as --attention-backend)
    # a checkpoint's sliding-window layers attend over the whole context instead, and --max-model-len is capped at the
    # window, as vLLM does (_resolve_sliding_window)
    disable_sliding_window: bool = False
    profiler_config: Optional[Any] = None  # vLLM's: {"profiler": "torch", "torch_profiler_dir": ...} (profiling.py)
    enable_mfu_metrics: bool = False  # vLLM's: estimated FLOPs / bytes per GPU in the metrics (perf_metrics.py)
    # vLLM's KV cache events over ZeroMQ: a JSON object, dict or kv_events_config.KVEventsConfig
    kv_events_config: Optional[Any] = None
    # vLLM's OpenTelemetry request spans: the OTLP collector's endpoint (tracing_config.py: it picks the exporter)
    otlp_traces_endpoint: Optional[str] = None
    # pooling (embedding) models, vLLM's flags: --runner auto | generate | pooling, --convert auto | none | embed, the
    # older --task (generate, embed, ...), and --pooler-config (older name --override-pooler-config)
    runner: str = "auto"
    convert: str = "auto"
    task: Optional[str] = None
    pooler_config: Optional[Any] = None  # JSON object or dict: pooling_type, normalize / use_activation, dimensions
    override_pooler_config: Optional[Any] = None
    # --enable-sleep-mode: LLM.sleep / wake_up and the server's /sleep, /wake_up, /is_sleeping (worker/sleep_mode.py)
    enable_sleep_mode: bool = False
    # LoRA adapters (voltllm/lora/); the other settings apply only with enable_lora (off, they are not checked, as
    # vLLM builds no LoRA config then: lm-evaluation-harness passes enable_lora=False with a max_lora_rank)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None  # None: --max-loras
    lora_dtype: str = "auto"  # auto: the model's dtype (the only one taken)
    # image and video input (vLLM's flags; voltllm/multimodal/config.py): items per prompt by modality (JSON object),
    # the image / video processors' settings (JSON object), the media loaders' (JSON object: video num_frames / fps),
    # the directory file:// URLs may read, the hosts http(s) URLs may name
    limit_mm_per_prompt: Optional[Any] = None
    mm_processor_kwargs: Optional[Any] = None
    media_io_kwargs: Optional[Any] = None
    allowed_local_media_path: Optional[str] = None
    allowed_media_domains: Optional[Any] = None
    mm_processor_cache_gb: float = 4.0  # processed images / videos kept by their bytes (0: none)
    disable_mm_preprocessor_cache: bool = False  # vLLM's older switch for --mm-processor-cache-gb 0

    def _refuse_unbuilt(self) -> None:
        """Flags whose capability is not built yet: refused by name before the model is even read."""
        from voltllm.fixed_flags import check_fixed_flags

        check_fixed_flags(self)
        from voltllm.reasoning_config import check_reasoning_flags

        check_reasoning_flags(self.reasoning_parser, self.reasoning_config)
        if self.enable_chunked_prefill is False:
            raise ConfigError("--no-enable-chunked-prefill: prefill is always chunked here (each step computes at most "
                              "--max-num-batched-tokens tokens, as vLLM V1 does); scheduling whole prompts only is "
                              "not built")
        if self.quantization is not None and self.quantization not in QUANTIZATION_ALIASES:
            raise ConfigError(f"--quantization {self.quantization}: this quantization method is not built yet (built: "
                              f"{', '.join(QUANTIZATION_ALIASES)})")

    def _resolve_reasoning(self, tokenizer: str) -> Any:
        """--reasoning-parser / --reasoning-config as token ids (the tokenizer is loaded for them, only then)."""
        from voltllm.fixed_flags import enable_in_reasoning
        from voltllm.reasoning_config import resolve_reasoning

        def load():
            from voltllm.model.loader import load_tokenizer

            return load_tokenizer(tokenizer, self.trust_remote_code)

        return resolve_reasoning(self.reasoning_parser, self.reasoning_config,
                                 enable_in_reasoning(self.structured_outputs_config), self.skip_tokenizer_init, load)

    def _resolve_speculators(self, spec: Optional[dict]) -> tuple[Optional[str], Optional[str], Optional[dict]]:
        """The model to serve, its revision and --speculative-config after vLLM's speculators handling
        (engine/speculators.py): --model naming a speculators EAGLE-3 / EAGLE-1 head serves the verifier its config
        names, with the head as the drafter (--revision is the head's); a speculators head as --speculative-config's
        "model" gets its method (eagle3, eagle) and the head's drafts per step unless given."""
        from voltllm.engine import speculators
        from voltllm.engine.speculative import SpeculativeConfigError

        try:
            if spec:
                spec = speculators.detect(spec, self.download_dir, self.hf_token, self.trust_remote_code)
            head = speculators.probe(self.model, self.revision, self.download_dir, self.hf_token,
                                     self.trust_remote_code)
            if head is None:
                return self.model, self.revision, spec
            spec = speculators.speculative_config_for_model(head, self.model, self.revision, spec)
            ver = speculators.verifier(head)
        except SpeculativeConfigError as e:
            raise ConfigError(str(e)) from None
        logger.info("--model %s is a speculators %s head: serving its verifier %s with the head as drafter",
                    self.model, "EAGLE-3" if spec["method"] == "eagle3" else "EAGLE-1", ver)
        return ver, None, spec

    def _resolve_tokenizer(self, source: Any, model: Optional[str]) -> str:
        """--tokenizer (a path or a Hub repo id), else the model's own; --tokenizer-revision fetches the tokenizer
        files of that revision from the Hub (of --tokenizer, or of the model's repo: `model`)."""
        from voltllm.model.loader import hub

        name = self.tokenizer or (model if self.tokenizer_revision else None)
        if name is None:
            return source.tokenizer_path
        if hub.looks_like_repo_id(name):
            return hub.fetch_repo(name, self.tokenizer_revision, self.download_dir, self.hf_token,
                                  self.trust_remote_code, tokenizer_only=True)
        if self.tokenizer_revision:
            raise ConfigError(f"--tokenizer-revision applies to Hugging Face Hub tokenizers; {name!r} is a local path")
        path = os.path.expanduser(name)
        if not os.path.exists(path):
            raise ConfigError(f"--tokenizer {name}: no such file or directory (nor a Hub repo id of the form "
                              "org/name)")
        return path

    def _resolve_dflash(self, spec: Any, hf_config: Any) -> Any:
        """A DFlash drafter's local path and config, checked against the target (engine/dflash.py)."""
        from voltllm.engine.dflash import resolve_dflash
        from voltllm.engine.speculative import SpeculativeConfigError

        try:
            return resolve_dflash(spec, hf_config, self.download_dir, self.hf_token)
        except SpeculativeConfigError as e:
            raise ConfigError(str(e)) from None

    def _resolve_eagle3(self, spec: Any, hf_config: Any) -> Any:
        """An EAGLE-3 head's local path and config, checked against the target (engine/eagle3.py)."""
        from voltllm.engine.eagle3 import resolve_eagle3
        from voltllm.engine.speculative import SpeculativeConfigError

        try:
            return resolve_eagle3(spec, hf_config, self.download_dir, self.hf_token)
        except SpeculativeConfigError as e:
            raise ConfigError(str(e)) from None

    def _resolve_eagle1(self, spec: Any, hf_config: Any) -> Any:
        """An EAGLE-1 head's local path and config, checked against the target (engine/eagle1.py)."""
        from voltllm.engine.eagle1 import resolve_eagle1
        from voltllm.engine.speculative import SpeculativeConfigError

        try:
            return resolve_eagle1(spec, hf_config, self.download_dir, self.hf_token)
        except SpeculativeConfigError as e:
            raise ConfigError(str(e)) from None

    def _resolve_draft(self, spec: Any, hf_config: Any, tokenizer: str) -> Any:
        """A draft model's local path and config, checked against the target (engine/draft_model.py)."""
        from voltllm.engine.draft_model import resolve_draft
        from voltllm.engine.speculative import SpeculativeConfigError

        try:
            return resolve_draft(spec, hf_config, None if self.skip_tokenizer_init else tokenizer, self.download_dir,
                                 self.hf_token, self.trust_remote_code)
        except SpeculativeConfigError as e:
            raise ConfigError(str(e)) from None

    def _resolve_cuda_graphs(self) -> CudaGraphConfig:
        """--compilation-config / -O / --cuda-graph-sizes / --enforce-eager, checked before the model is read."""
        from voltllm.cuda_graph_config import CompilationConfigError, resolve_cuda_graphs

        try:
            return resolve_cuda_graphs(self.compilation_config, self.optimization_level, self.cuda_graph_sizes,
                                       self.cudagraph_capture_sizes, self.max_cudagraph_capture_size,
                                       self.enforce_eager)
        except CompilationConfigError as e:
            raise ConfigError(str(e)) from None

    def _resolve_runner(self, hf_config: Any, model_path: str, spec: Any,
                        tokenizer_path: Optional[str] = None) -> tuple[str, Any]:
        """(runner, PoolerConfig or None) from --runner / --convert / --task / --pooler-config (pooling/config.py)."""
        from voltllm.model.models.registry import attention_only
        from voltllm.pooling.config import PoolerConfigError, resolve_pooler_config, resolve_runner

        given = self.pooler_config if self.pooler_config is not None else self.override_pooler_config
        if self.pooler_config is not None and self.override_pooler_config is not None \
                and self.pooler_config != self.override_pooler_config:
            raise ConfigError("--override-pooler-config is the older name of --pooler-config: give one")
        if isinstance(given, str):
            given = parse_json_object("--pooler-config", given)
        try:
            runner, task = resolve_runner(self.task, self.runner, self.convert, hf_config, model_path)
            if runner == "generate":
                if given is not None:
                    raise ConfigError("--pooler-config applies to pooling models: add --runner pooling")
                return runner, None
            pooler = resolve_pooler_config(given, model_path, hf_config, task, tokenizer_path or model_path,
                                           self.trust_remote_code)
        except PoolerConfigError as e:
            raise ConfigError(str(e)) from None
        if not attention_only(hf_config):
            raise ConfigError(f"--runner pooling: embedding models are built for the attention-only architectures "
                              f"(llama, qwen2, qwen3, qwen3_moe), not {getattr(hf_config, 'model_type', None)!r}")
        if spec is not None:
            raise ConfigError("--speculative-config: a pooling model generates nothing to speculate on; drop it")
        logger.info("pooling (%s) model: %s", "classification" if pooler.classifier else "embedding",
                    pooler.describe())
        return runner, pooler

    def _expert_parallel(self, tp: int, hf_config: Any) -> bool:
        """Whether the routed experts are placed whole on the ranks (ParallelConfig.enable_expert_parallel):
        --enable-expert-parallel on a MoE model at -tp > 1. Refused for a model without experts, as vLLM does."""
        from voltllm.distributed.support import expert_parallel_error

        if self.expert_placement_strategy not in ("linear", "round_robin"):
            raise ConfigError(f"--expert-placement-strategy {self.expert_placement_strategy}: not a placement; use "
                              "linear (or round_robin)")
        if not self.enable_expert_parallel:
            return False
        if err := expert_parallel_error(tp, hf_config):
            raise ConfigError(err)
        if tp == 1:
            logger.info("--enable-expert-parallel changes nothing with one rank (it holds every expert), as in vLLM")
            return False
        if self.expert_placement_strategy == "round_robin":
            # vLLM places round-robin only for models with expert groups (DeepSeek-style), which no MoE model voltllm
            # runs has, and falls back to linear with a warning otherwise
            logger.warning("--expert-placement-strategy round_robin needs a model with expert groups; the experts are "
                           "placed linearly (as vLLM does for this model)")
        return True
    def _resolve_lora(self, config: EngineConfig) -> LoRAConfig:
        """--enable-lora's settings, checked against the model and the rest of the configuration."""
        from voltllm.lora.adapter import lora_architecture_error

        if err := lora_architecture_error(config.model.hf_config):
            raise ConfigError(f"--enable-lora: {err}")
        for flag, value in (("--max-loras", self.max_loras), ("--max-lora-rank", self.max_lora_rank),
                            ("--max-cpu-loras", self.max_cpu_loras)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"{flag} must be an integer, got {value!r}")
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be >= 1 (adapters in one batch), got {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ConfigError(f"--max-lora-rank {self.max_lora_rank}: must be one of "
                              f"{', '.join(map(str, MAX_LORA_RANKS))} (vLLM's values)")
        cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        if cpu < self.max_loras:
            raise ConfigError(f"--max-cpu-loras {cpu} must be >= --max-loras {self.max_loras}")
        dtype = config.model.dtype
        if self.lora_dtype != "auto" and _DTYPES.get(self.lora_dtype) != dtype:
            raise ConfigError(f"--lora-dtype {self.lora_dtype}: adapters run in the model's dtype here "
                              f"({str(dtype).replace('torch.', '')}); use auto")
        if config.model.runner != "generate":
            raise ConfigError("--enable-lora with --runner pooling: adapters for embedding models are not built")
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu, dtype)

    def __post_init__(self) -> None:
        # vLLM's EngineArgs take None for "the default" (its fields default to None and are filled in later):
        # lm-evaluation-harness passes max_num_seqs=None unless told a batch size. A None for a field that has no
        # None value of its own is read as that field's default.
        for f in fields(self):
            if getattr(self, f.name) is None and f.default is not None and f.default is not MISSING \
                    and "None" not in str(f.type) and "Optional" not in str(f.type) and str(f.type) != "Any":
                setattr(self, f.name, f.default)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def _resolve_mmproj(self, source: Any, hf_config: Any) -> tuple[Optional[str], Any]:
        """A GGUF model's vision projector (--mmproj, else the one fetched with an owner/name:QUANT Hub model, else a
        *mmproj*.gguf beside the model file; none with --no-mmproj) and the multimodal config of the two files
        (model/loader/gguf_mmproj.py); (None, hf_config) without one."""
        if source.kind != "gguf":
            for flag, given in (("--mmproj " + str(self.mmproj), self.mmproj), ("--no-mmproj", self.no_mmproj)):
                if given:
                    raise ConfigError(f"{flag}: a projector file goes with a GGUF model file; {source.path} is a "
                                      "Hugging Face directory (its vision tower is in its safetensors; "
                                      "--language-model-only serves its text model alone)")
            return None, hf_config
        from voltllm.model.loader.gguf_loader import gguf_architecture
        from voltllm.model.loader.gguf_mmproj import MMPROJ_LM_ARCHS, find_mmproj, multimodal_config, read_mmproj

        if self.language_model_only or (self.no_mmproj and not self.mmproj):
            return None, hf_config
        try:
            if self.mmproj is None and gguf_architecture(source.path) not in MMPROJ_LM_ARCHS:
                return None, hf_config  # (a projector beside a text-only model is not looked for)
            if self.mmproj is None and source.hub_repo is not None:
                path = source.mmproj  # fetched with the model (none: hub.fetch_projector said why)
                if path is None:
                    return None, hf_config
            else:
                path = find_mmproj(source.path, self.mmproj)
                if path is None:
                    logger.warning("%s is a vision-language model's GGUF file, but no projector file (*mmproj*.gguf) "
                                   "is beside it: it serves text only; give its projector with --mmproj PATH for "
                                   "image input", source.path)
                    return None, hf_config
            return path, multimodal_config(source.path, hf_config, read_mmproj(path))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _config_from_path(self, own: Any, source: Any, mmproj: Optional[str]) -> Any:
        """--hf-config-path's config in place of the model's own, once it is found to describe the same network."""
        from voltllm.model.loader.config_path import ConfigPathError, check_same_network, read_config

        if mmproj is not None:
            raise ConfigError("--hf-config-path with a GGUF model's vision projector is not built (the projector's "
                              "vision settings join the GGUF file's config): add --language-model-only or --no-mmproj")
        try:
            given = read_config(self.hf_config_path, self.download_dir, self.hf_token, self.trust_remote_code)
            check_same_network(own, given, self.hf_config_path, source.kind)
        except ConfigPathError as e:
            raise ConfigError(str(e)) from None
        logger.info("the model's config from --hf-config-path %s", self.hf_config_path)
        return given

    def _prefix_caching_hash_algo(self) -> str:
        """--prefix-caching-hash-algo, refused when unknown or when its package is missing."""
        from voltllm.cache.prefix import check_hash_algo

        try:
            check_hash_algo(self.prefix_caching_hash_algo)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return self.prefix_caching_hash_algo

    def _load_options(self) -> tuple[tuple[str, ...], Any]:
        """(--ignore-patterns, --pt-load-map-location), refused when malformed."""
        from voltllm.model.loader.load_options import ignore_patterns_of, map_location_of

        try:
            return ignore_patterns_of(self.ignore_patterns), map_location_of(self.pt_load_map_location)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _kv_metrics_sample(self) -> float:
        """--kv-cache-metrics' sampling share (0: off); --kv-cache-metrics-sample must be in (0, 1]."""
        sample = self.kv_cache_metrics_sample
        if isinstance(sample, bool) or not isinstance(sample, (int, float)) or not 0.0 < sample <= 1.0:
            raise ConfigError(f"--kv-cache-metrics-sample must be in (0, 1], got {sample!r}")
        return float(sample) if self.kv_cache_metrics else 0.0

    def _resolve_profiler(self) -> Any:
        """--profiler-config as a profiling.ProfilerConfig (None: off)."""
        if self.profiler_config is None:
            return None
        from voltllm.profiling import ProfilerConfig, ProfilerError

        try:
            return ProfilerConfig.from_dict(parse_json_object("--profiler-config", self.profiler_config))
        except ProfilerError as e:
            raise ConfigError(str(e)) from None

    def _resolve_kv_events(self) -> Any:
        """--kv-events-config as a kv_events_config.KVEventsConfig (None: no events)."""
        if self.kv_events_config is None:
            return None
        from voltllm.kv_events_config import resolve_kv_events

        return resolve_kv_events(self.kv_events_config, self.data_parallel_size)

    def _resolve_otlp_traces(self) -> Any:
        """--otlp-traces-endpoint as a tracing_config.OtlpTracesConfig (None: no tracing)."""
        if self.otlp_traces_endpoint is None:
            return None
        from voltllm.tracing_config import resolve_otlp_traces

        return resolve_otlp_traces(self.otlp_traces_endpoint)

    def _resolve_sliding_window(self, hf_config: Any) -> Optional[int]:
        """A checkpoint whose layers include sliding-window ones (voltllm.model.sliding_window): the llama-family
        architectures run them (the window's keys only; KV is kept for the whole context); with
        --disable-sliding-window every layer attends to the whole context and the context is capped at the window,
        where the two agree (vLLM's cap), as it is for an architecture without windowed layers. Returns the window
        that caps the context, else None."""
        from voltllm.model.models.registry import attention_only
        from voltllm.model.sliding_window import layer_window, model_window, turn_off

        text = getattr(hf_config, "text_config", None) or hf_config
        window = model_window(text)
        if window is None:
            return None
        if attention_only(hf_config) and not self.disable_sliding_window:
            logger.info("sliding-window attention (%d tokens) in layers %s", window,
                        [i for i in range(text.num_hidden_layers) if layer_window(text, i)])
            return None
        if not self.disable_sliding_window:
            logger.warning("this checkpoint turns on sliding-window attention (%d tokens), which voltllm does not "
                           "build for %s: the context is capped at the window, where full attention gives the same "
                           "result (as --disable-sliding-window)", window, getattr(hf_config, "model_type", "it"))
        turn_off(text)
        return window

    def _refuse_qwen4_exp_unbuilt(self, hf_config: Any, method: Optional[str], spec: Any, runner: str) -> None:
        if (what := _qwen4_exp_unbuilt(self, hf_config, method, spec, runner)) is not None:
            raise ConfigError(f"Qwen4-Exp ({hf_config.model_type}): {what} is not built for this model")

    def create_engine_config(self) -> EngineConfig:
        from voltllm.model.loader import ModelLoadError, load_hf_config, resolve_model
        from voltllm.multimodal.processor import ImageProcessor
        from voltllm.multimodal.support import image_input_refusal, takes_videos

        self._refuse_unbuilt()
        from voltllm.multimodal.config import resolve_multimodal

        multimodal = resolve_multimodal(self.limit_mm_per_prompt, self.mm_processor_kwargs,
                                        self.allowed_local_media_path, self.allowed_media_domains,
                                        self.media_io_kwargs, self.mm_processor_cache_gb,
                                        self.disable_mm_preprocessor_cache)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy {self.scheduling_policy}: not a scheduling policy; use fcfs (first "
                              "come, first served) or priority (by each request's priority, then arrival)")
        graphs = self._resolve_cuda_graphs()
        profiler = self._resolve_profiler()  # (before the model is resolved: a bad value fails at once)
        hash_algo = self._prefix_caching_hash_algo()  # (likewise)
        kv_events = self._resolve_kv_events()  # (likewise)
        otlp_traces = self._resolve_otlp_traces()  # (likewise)
        spec_dict = parse_json_object("--speculative-config", self.speculative_config)
        model_ref, revision, spec_dict = self._resolve_speculators(spec_dict)
        ignore_patterns, map_location = self._load_options()  # (likewise)
        try:
            source = resolve_model(model_ref, revision, self.download_dir, self.hf_token, self.trust_remote_code,
                                   projector=not (self.mmproj or self.no_mmproj or self.language_model_only),
                                   ignore_patterns=ignore_patterns, pt_map_location=map_location)
        except ModelLoadError as e:
            if model_ref == self.model:
                raise
            raise ConfigError(f"--model {self.model} is a speculators EAGLE-3 head whose verifier {model_ref} cannot "
                              f"be loaded ({e}); give the verifier (or a copy of it) as --model, with "
                              f"--speculative-config '{{\"model\": \"{self.model}\"}}'") from None
        load_format = _resolve_load_format(self.load_format, source)
        tokenizer = self._resolve_tokenizer(source, model_ref)
        hf_config = load_hf_config(source, trust_remote_code=self.trust_remote_code)
        mmproj, hf_config = self._resolve_mmproj(source, hf_config)
        if self.hf_config_path is not None:
            hf_config = self._config_from_path(hf_config, source, mmproj)
        overrides = parse_json_object("--hf-overrides", self.hf_overrides)
        if overrides:
            from voltllm.model.loader.hf_overrides import HFOverrideError, apply_hf_overrides

            try:
                apply_hf_overrides(hf_config, overrides)
            except HFOverrideError as e:
                raise ConfigError(str(e)) from None
        method = _resolve_quantization(self.quantization, source.kind, hf_config)
        _check_bnb_load_format(self.load_format, method)
        spec = _resolve_speculative(spec_dict, hf_config)
        if (spec is not None and getattr(hf_config, "model_type", None) in ("qwen4_exp", "qwen4_exp_text")
                and spec.method in QWEN4_EXP_SPEC_UNBUILT):  # (before the drafter is resolved)
            raise ConfigError(f"Qwen4-Exp ({hf_config.model_type}): {QWEN4_EXP_SPEC_UNBUILT[spec.method]} is not "
                              "built for this model")
        if spec is not None and spec.uses_draft_model:
            spec = self._resolve_draft(spec, hf_config, tokenizer)
        elif spec is not None and spec.uses_dflash:
            spec = self._resolve_dflash(spec, hf_config)
        elif spec is not None and spec.uses_mtp:
            _check_mtp(hf_config, source, load_format)
        elif spec is not None and spec.uses_eagle3:
            spec = self._resolve_eagle3(spec, hf_config)
        elif spec is not None and spec.uses_eagle1:
            spec = self._resolve_eagle1(spec, hf_config)
        runner, pooler = self._resolve_runner(hf_config, source.path, spec, tokenizer)
        if self.enable_prompt_embeds and runner == "pooling":
            raise ConfigError("--enable-prompt-embeds with --runner pooling: prompt embeddings for pooling models are "
                              "not built (generation models take them)")
        if getattr(hf_config, "model_type", None) in ("qwen4_exp", "qwen4_exp_text"):
            self._refuse_qwen4_exp_unbuilt(hf_config, method, spec, runner)
        device = _resolve_device(self.device)
        # None on the CPU; below sm_70 a ConfigError; over mixed cards the oldest's (the route must run on all)
        capability = _run_capability(device, self.tensor_parallel_size * self.pipeline_parallel_size
                                     * self.data_parallel_size)
        compat = _resolve_compat(self.compat, device, capability)
        dtype = _resolve_dtype(self.dtype, hf_config, device, compat, capability)

        derived_max = _max_positions(hf_config)
        window = self._resolve_sliding_window(hf_config)
        if window is not None and window < derived_max:  # (full attention capped at the window: the same result)
            derived_max = window
        asked = None if self.max_model_len is None else parse_size("--max-model-len", self.max_model_len, auto=True)
        fit = asked == "auto"
        max_model_len = derived_max if asked is None or fit else asked  # 0 is an error
        if max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {max_model_len} (or auto / -1: what the KV "
                              "cache holds)")
        if max_model_len > derived_max:
            raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's maximum context "
                              + (f"(its sliding window, {window} tokens: voltllm runs full attention up to it)"
                                 if derived_max == window else f"({derived_max} positions in its config)"))
        if spec is not None:  # (a draft model with fewer positions drafts up to them; plain decoding beyond, as vLLM)
            spec = replace(spec, max_model_len=speculative_max_len(
                spec.max_model_len, _max_positions(spec.draft_hf_config) if spec.uses_draft_model else None,
                max_model_len))
        kv_bytes = (None if self.kv_cache_memory_bytes is None
                    else parse_size("--kv-cache-memory-bytes", self.kv_cache_memory_bytes, "bytes"))
        if kv_bytes is not None and kv_bytes < 1:
            raise ConfigError(f"--kv-cache-memory-bytes must be >= 1, got {kv_bytes}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        from voltllm.attention.kv_spec import FP8_KV_DTYPES, kv_cache_dtype_error  # fp8*: uint8 cache

        if kv_err := kv_cache_dtype_error(self.kv_cache_dtype, dtype, _no_bf16_reason(device, compat, capability)):
            raise ConfigError(kv_err)
        calculate_kv_scales = self.calculate_kv_scales
        if calculate_kv_scales and self.kv_cache_dtype not in FP8_KV_DTYPES:
            logger.warning("--calculate-kv-scales is ignored: --kv-cache-dtype %s is not an fp8 cache (scales apply "
                           "to fp8_e4m3 / fp8_e5m2 only)", self.kv_cache_dtype)
            calculate_kv_scales = False
        calculate_key_offsets = self.calculate_key_offsets
        if calculate_key_offsets and self.kv_cache_dtype not in FP8_KV_DTYPES:
            logger.warning("--calculate-key-offsets is ignored: --kv-cache-dtype %s is not an fp8 cache",
                           self.kv_cache_dtype)
            calculate_key_offsets = False
        from voltllm.fixed_flags import attention_backend_of, json_any_whitespace

        attention_backend = attention_backend_of(self)  # (its name checked with the fixed flags, before the model)
        from voltllm.model.models.registry import attention_only

        if self.mamba_cache_mode not in ("align", "none") and not attention_only(hf_config):
            raise ConfigError(f"--mamba-cache-mode {self.mamba_cache_mode}: not built for hybrid models; align (state "
                              "snapshots at --mamba-block-size boundaries) or none")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError(f"--num-gpu-blocks-override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(self.generation_config, "generation_config.json")):
            raise ConfigError(f"--generation-config {self.generation_config}: no generation_config.json there "
                              "(auto: the model's; vllm: none)")
        batched = (max(2048, min(max_model_len, 8192)) if self.max_num_batched_tokens is None
                   else parse_size("--max-num-batched-tokens", self.max_num_batched_tokens))
        if batched < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {batched}")

        quantized_weights = _quantized_weights(method, self.quantization, hf_config, device, load_format)
        from voltllm.distributed.support import intermediate_alignment, quantized_split_error, tensor_parallel_error

        tp = self.tensor_parallel_size
        ep = self._expert_parallel(tp, hf_config)
        if quantized_weights == "auto" and tensor_parallel_error(tp, hf_config, device, spec, "dequantized",
                                                                 expert_parallel=ep) is None \
                and (split_err := quantized_split_error(tp, hf_config, method, ep)):
            # TP shards weights kept quantized too, but not across a quantized block: "auto" falls back to dense
            logger.warning("%s weights are dequantized at load: %s", method, split_err)
            quantized_weights = "dequantized"
        if tp_err := tensor_parallel_error(tp, hf_config, device, spec, quantized_weights, method, ep):
            raise ConfigError(tp_err)
        _check_draft_tensor_parallel(spec, tp, self.pipeline_parallel_size)
        _check_data_parallel(self.data_parallel_size, tp, self.enable_expert_parallel, device)
        from voltllm.distributed.support import pipeline_parallel_error

        if pp_err := pipeline_parallel_error(self, hf_config, spec, runner, device):
            raise ConfigError(pp_err)
        gen_override = _generation_override(self.override_generation_config)
        model_name = self.served_model_name or (model_ref or "SmolLM2-135M-Instruct")
        model = ModelConfig(
            model=source.path, tokenizer=tokenizer, served_model_name=model_name,
            dtype=dtype, max_model_len=max_model_len, hf_config=hf_config,
            trust_remote_code=self.trust_remote_code, seed=self.seed, generation_config=self.generation_config,
            override_generation_config=gen_override,
            chat_template=self.chat_template, language_model_only=self.language_model_only, mmproj=mmproj,
            load_format=load_format, use_tqdm_on_load=self.use_tqdm_on_load,
            ignore_patterns=ignore_patterns, pt_load_map_location=map_location,
            enable_prompt_embeds=self.enable_prompt_embeds,
            skip_tokenizer_init=self.skip_tokenizer_init,
            quantization=method,
            quantized_weights=quantized_weights, max_model_len_fit=fit, runner=runner, pooler=pooler)
        prefix_caching = self.enable_prefix_caching
        if prefix_caching and pooler is not None and pooler.reads_every_token:
            # (vLLM's choice too) a prefix-cache hit skips tokens whose hidden states MEAN / CLS pool
            logger.info("prefix caching is off: %s pooling needs every prompt token computed", pooler.pooling_type)
            prefix_caching = False
        offload_gib = _resolve_kv_offloading(self.kv_offloading_size, self.kv_offloading_backend, prefix_caching,
                                             self.enable_prefix_caching, attention_only(hf_config),
                                             self.mamba_cache_mode, self.data_parallel_size)
        cache = CacheConfig(
            block_size=self.block_size, enable_prefix_caching=prefix_caching,
            prefix_caching_hash_algo=hash_algo,
            kv_cache_dtype=self.kv_cache_dtype, calculate_kv_scales=calculate_kv_scales,
            calculate_key_offsets=calculate_key_offsets,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override, mamba_block_size=self.mamba_block_size,
            mamba_cache_mode=self.mamba_cache_mode, kv_cache_memory_bytes=kv_bytes,
            kv_offloading_size=offload_gib, kv_offloading_backend=self.kv_offloading_backend,
            kv_cache_metrics_sample=self._kv_metrics_sample())
        sched = SchedulerConfig(max_num_batched_tokens=batched, max_num_seqs=self.max_num_seqs,
                                max_model_len=max_model_len,
                                # speculation proposes from the host's tokens: a step waits for the one before;
                                # with host drafts and a dynamic schedule that turns it off at some batch sizes, the
                                # steps there overlap (EngineCore._may_draft)
                                async_scheduling=self.async_scheduling and (spec is None or _async_with(spec)),
                                policy=self.scheduling_policy,
                                long_prefill_token_threshold=_long_prefill_threshold(
                                    self.long_prefill_token_threshold, self.max_num_partial_prefills,
                                    self.max_long_partial_prefills, max_model_len))
        from voltllm.cuda_graph_config import CompilationConfigError, fit_to_batch_budget

        try:
            graphs = fit_to_batch_budget(graphs, batched)
        except CompilationConfigError as e:
            raise ConfigError(str(e)) from None
        from voltllm.weight_offload_config import resolve_weight_offload

        weight_offload = resolve_weight_offload(self.cpu_offload_gb, self.cpu_offload_params, self.offload_backend,
                                                self.offload_group_size, self.offload_num_in_group,
                                                self.offload_prefetch_step, self.enable_lora)
        streamed = weight_offload is not None and weight_offload.backend == "prefetch"
        if streamed and graphs.prompt_graphs and device.type == "cuda":
            # (a piecewise graph ends at every attention call, but a prefetched layer's copy joins the main stream a
            # layer or more later: the copy stream cannot stay forked across pieces)
            logger.info("piecewise prompt CUDA graphs are off with weight offloading (decode graphs stay on)")
        dev = DeviceConfig(device=device, compat=compat, enforce_eager=not graphs.decode_graphs,
                           attention_backend=attention_backend, require_acceleration=self.require_acceleration,
                           prompt_graph_max_tokens=None if graphs.prompt_graphs and not streamed else 0,
                           cuda_graphs=graphs)
        config = EngineConfig(model=model, cache=cache, scheduler=sched, device=dev,
                              parallel=ParallelConfig(self.tensor_parallel_size, intermediate_align=(
                                  intermediate_alignment(tp, hf_config, method, ep)
                                  if quantized_weights != "dequantized" else 1), enable_expert_parallel=ep,
                                  data_parallel_size=self.data_parallel_size,
                                  pipeline_parallel_size=self.pipeline_parallel_size),
                              speculative=spec,
                              quantization=method, json_any_whitespace=json_any_whitespace(
                                  self.structured_outputs_config), weight_offload=weight_offload,
                              multimodal=multimodal)
        if image_input_refusal(config) is None:
            # (built here too, so that a processor the model's files or --mm-processor-kwargs break fails at start)
            ImageProcessor.from_model(model.model, hf_config, multimodal.mm_processor_kwargs, takes_videos(config),
                                      model.mmproj)
        if self.enable_lora:
            config = replace(config, lora=self._resolve_lora(config))
        if self.enable_sleep_mode:
            from voltllm.worker.sleep_mode import sleep_mode_refusal

            if why := sleep_mode_refusal(config):
                raise ConfigError(f"--enable-sleep-mode: {why}")
            config = replace(config, enable_sleep_mode=True)
        reasoning = self._resolve_reasoning(tokenizer)
        if reasoning is not None:
            config = replace(config, reasoning=reasoning)
        if profiler is not None:
            config = replace(config, profiler=profiler)
        if self.enable_mfu_metrics:
            config = replace(config, enable_mfu_metrics=True)
        if kv_events is not None:
            config = replace(config, kv_events=kv_events)
        if otlp_traces is not None:
            config = replace(config, otlp_traces=otlp_traces)
        if self.require_acceleration:  # ConfigError naming each expected-but-disabled route
            from voltllm.acceleration import require_acceleration

            require_acceleration(config)
        return config


def speculative_max_len(given: Optional[int], draft_positions: Optional[int], target_len: int) -> Optional[int]:
    """The longest sequence that drafts, as vLLM derives it: --speculative-config max_model_len when given (at most a
    draft model's positions and --max-model-len), else a draft model's positions where fewer than --max-model-len;
    None: no limit but --max-model-len's."""
    if given is not None:
        if draft_positions is not None and given > draft_positions:
            raise ConfigError(f"--speculative-config max_model_len {given} exceeds the draft model's "
                              f"{draft_positions} positions")
        if given > target_len:
            raise ConfigError(f"--speculative-config max_model_len {given} exceeds --max-model-len {target_len}")
        return given
    return draft_positions if draft_positions is not None and draft_positions < target_len else None


def _async_with(spec: Any) -> bool:
    """Speculation that keeps async scheduling for its steps without drafts: a dynamic schedule with K = 0 for some
    batch sizes (any method: host drafts, or a drafter on the device, whose per-step work reads only the device's
    tokens; EngineCore._may_draft finishes the step in flight before one that may draft)."""
    return any(k == 0 for _, _, k in spec.draft_schedule)


def _long_prefill_threshold(threshold: Any, partial: Any, long_partial: Any, max_model_len: int) -> int:
    """--long-prefill-token-threshold as the scheduler's per-request cap (0: none), vLLM's way: with
    --max-num-partial-prefills above 1 and no threshold given, 4% of --max-model-len."""
    for flag, value, least in (("--long-prefill-token-threshold", threshold, 0),
                               ("--max-num-partial-prefills", partial, 1),
                               ("--max-long-partial-prefills", long_partial, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{flag} must be an integer >= {least}, got {value!r}")
    if long_partial > partial:
        raise ConfigError(f"--max-long-partial-prefills {long_partial} must be <= --max-num-partial-prefills {partial}")
    if partial > 1:
        if threshold == 0:
            threshold = int(max_model_len * 0.04)
        elif threshold > max_model_len:
            raise ConfigError(f"--long-prefill-token-threshold {threshold} cannot be greater than --max-model-len "
                              f"{max_model_len}")
        logger.info("concurrent partial prefills: --max-num-partial-prefills %d, --max-long-partial-prefills %d, "
                    "--long-prefill-token-threshold %d", partial, long_partial, threshold)
    return threshold


def parse_json_object(flag: str, value: Any) -> Optional[dict]:
    """A JSON-object flag's value (given as JSON text or a dict) as a dict; None when not given."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} must be a JSON object: {e}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {type(parsed).__name__}")
    return parsed


def _resolve_kv_offloading(size_gib: Optional[float], backend: str, prefix_caching: bool, asked_prefix: bool,
                           attention_only: bool, mamba_cache_mode: str, dp: int) -> Optional[float]:
    """--kv-offloading-size / --kv-offloading-backend: the CPU tier's GiB (None: off), or a ConfigError where it
    cannot run."""
    if backend == "lmcache":
        raise ConfigError("--kv-offloading-backend lmcache: the LMCache connector is not built; native (the default) "
                          "keeps evicted prefix-cache blocks in CPU memory")
    if backend != "native":
        raise ConfigError(f"--kv-offloading-backend {backend}: not a backend; native (vLLM's other one, lmcache, is "
                          "not built)")
    if size_gib is None:
        return None
    if isinstance(size_gib, bool) or not isinstance(size_gib, (int, float)) or not math.isfinite(size_gib) \
            or size_gib <= 0:
        raise ConfigError(f"--kv-offloading-size must be a number of GiB > 0, got {size_gib!r}")
    if not prefix_caching:
        why = ("--no-enable-prefix-caching turns the prefix cache off" if not asked_prefix else
               "this pooling model's MEAN / CLS pooling turns prefix caching off")
        raise ConfigError(f"--kv-offloading-size: the CPU tier keeps prefix-cache blocks, and {why}; drop one of them")
    if not attention_only and mamba_cache_mode == "none":
        raise ConfigError("--kv-offloading-size: --mamba-cache-mode none keeps no recurrent-state snapshots, so this "
                          "hybrid model has no prefix cache for the CPU tier to extend; use --mamba-cache-mode align "
                          "(the default) or drop --kv-offloading-size")
    from voltllm.cache.cpu_offload import host_available_bytes

    available = host_available_bytes()
    if available is not None and size_gib * dp * 2**30 > available:
        engines = f" x {dp} data-parallel engines" if dp > 1 else ""
        raise ConfigError(f"--kv-offloading-size {size_gib:g} GiB{engines}: this host has {available / 2**30:.1f} GiB "
                          "of memory available (MemAvailable in /proc/meminfo); lower --kv-offloading-size")
    return float(size_gib)


def _check_draft_tensor_parallel(spec: Any, tp: int, pp: int) -> None:
    """A drafter runs split as the target is (draft_tensor_parallel_size the target's --tensor-parallel-size; absent:
    MTP, DFlash and the EAGLE heads) or whole on rank 0 (1; absent: a draft model); under -pp whole on rank 0 (1 or
    absent). A drafter split must split like the target: its heads and widths, and a draft model's architecture."""
    want = getattr(spec, "draft_tensor_parallel_size", None)
    draft_cfg = getattr(spec, "draft_hf_config", None)
    if spec is not None and spec.drafter_split(SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp)) \
            and draft_cfg is not None and getattr(draft_cfg, "num_attention_heads", None):
        from voltllm.distributed.support import TP_MODEL_TYPES, layer_split_error

        kind = getattr(draft_cfg, "model_type", None)
        if spec.method == "draft_model" and kind not in TP_MODEL_TYPES:
            raise ConfigError(f"--speculative-config draft_tensor_parallel_size {want}: a {kind!r} draft model is not "
                              f"split under tensor parallelism (built for {' / '.join(TP_MODEL_TYPES)}); pass 1 to "
                              "run it whole on rank 0")
        if err := layer_split_error(tp, draft_cfg):  # (the MTP module's layer is the target's, checked with it)
            raise ConfigError(f"--speculative-config: the {spec.method} drafter cannot be split over the "
                              f"--tensor-parallel-size {tp} ranks like the target ({err}); pass "
                              "\"draft_tensor_parallel_size\": 1 to run it whole on rank 0")
    if want is None or want == 1:
        return
    if pp > 1:
        raise ConfigError(f"--speculative-config draft_tensor_parallel_size {want}: under --pipeline-parallel-size the "
                          f"{spec.method} drafter runs whole on rank 0 (1 or leave it out)")
    if want != tp:
        raise ConfigError(f"--speculative-config draft_tensor_parallel_size {want}: the {spec.method} drafter is split "
                          f"as the target is ({tp}, its --tensor-parallel-size) or runs whole on rank 0 (1)")


def _check_data_parallel(dp: int, tp: int, expert_parallel: bool, device: torch.device) -> None:
    """--data-parallel-size: engines of -tp ranks each, side by side on their own GPUs (engine k on the dp * tp
    devices from the first one's index + k * tp); on the CPU every engine runs there."""
    if dp < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {dp}")
    if dp == 1:
        return
    if expert_parallel:
        raise ConfigError(f"--data-parallel-size {dp} with --enable-expert-parallel: experts spread over the ranks of "
                          "several data-parallel engines (all-to-all) are not built; -ep places experts over one "
                          "engine's -tp ranks, so drop -ep or use --data-parallel-size 1")
    if device.type == "cuda":
        first, count = device.index or 0, torch.cuda.device_count()
        if first + dp * tp > count:
            raise ConfigError(f"--data-parallel-size {dp} x --tensor-parallel-size {tp}: needs {dp * tp} CUDA devices "
                              f"from cuda:{first}, but {count} are visible")


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is visible")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {device!r}") from None
    count = torch.cuda.device_count() if dev.type == "cuda" else 0
    if dev.type == "cuda" and dev.index is not None and dev.index >= count:
        raise ConfigError(f"--device {device}: {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1}; "
                          "CUDA_VISIBLE_DEVICES numbers the cards it lists from 0, in its order)")
    return dev


# the methods built for hybrid (Gated DeltaNet) targets: their verification keeps a recurrent state per verified
# position and keeps the accepted one's (voltllm/worker/hybrid_spec.py). Today that is every method of
# engine/speculative.py's METHODS; one added there stays refused for hybrids until it is listed here
HYBRID_SPEC_METHODS = ("ngram", "draft_model", "dflash", "mtp", "eagle", "eagle3", "suffix")


# the quantized checkpoints built for Qwen4-Exp (as for the Qwen3.5-MoE hybrid): kept quantized on a GPU, dequantized
# at load on the CPU; GGUF (no Qwen4-Exp GGUF layout) and bitsandbytes are not
QWEN4_EXP_QUANT_METHODS = ("awq", "gptq", "fp8", "modelopt_fp4", "compressed-tensors")


# speculative methods not built for Qwen4-Exp (ngram, suffix and draft_model are: docs/hybrid.md "Qwen4-Exp")
QWEN4_EXP_SPEC_UNBUILT = {
    "dflash": "DFlash speculation (--speculative-config method dflash: its drafter reads target layers' hidden states, "
              "and Qwen4-Exp's residual is hc_count hyper-connection streams wide; built: ngram, suffix, draft_model)",
    "eagle": "EAGLE-1 speculation (--speculative-config method eagle: not run on this model; built: ngram, suffix, "
             "draft_model)",
    "eagle3": "EAGLE-3 speculation (--speculative-config method eagle3: its head reads target layers' hidden states, "
              "and Qwen4-Exp's residual is hc_count hyper-connection streams wide; built: ngram, suffix, draft_model)",
    "mtp": "MTP speculation (--speculative-config method mtp: the checkpoint's mtp.* module is not loaded; built: "
           "ngram, suffix, draft_model)",
}


def _qwen4_exp_unbuilt(args: Any, hf_config: Any, method: Optional[str], spec: Any, runner: str) -> Optional[str]:
    """What of this launch is not built for Qwen4-Exp (voltllm/model/models/qwen4_exp.py), or None."""
    if args.pipeline_parallel_size > 1 and args.enable_lora:  # (each built alone; together not yet run)
        return "LoRA (--enable-lora) under pipeline parallelism (--pipeline-parallel-size)"
    if method is not None and method not in QWEN4_EXP_QUANT_METHODS:
        return f"{method} quantization (built: {', '.join(QWEN4_EXP_QUANT_METHODS)} checkpoints)"
    if spec is not None and (why := QWEN4_EXP_SPEC_UNBUILT.get(spec.method)) is not None:
        return why
    if spec is not None and args.pipeline_parallel_size > 1:  # (each built alone; together not yet run)
        return "speculative decoding (--speculative-config) under pipeline parallelism (--pipeline-parallel-size)"
    if runner != "generate":
        return f"--runner {runner}"
    return None


def _resolve_speculative(spec: Optional[dict], hf_config: Any) -> Any:
    """--speculative-config as a SpeculativeConfig (None when not given), for attention-only targets, and for hybrid
    ones with the methods of HYBRID_SPEC_METHODS."""
    if not spec:
        return None
    from voltllm.engine.speculative import SpeculativeConfig, SpeculativeConfigError
    from voltllm.model.models.registry import attention_only

    try:
        parsed = SpeculativeConfig.from_dict(spec)
    except SpeculativeConfigError as e:
        raise ConfigError(str(e)) from None
    if not attention_only(hf_config) and parsed.method not in HYBRID_SPEC_METHODS:
        raise ConfigError(f"--speculative-config method {parsed.method} is not built for hybrid targets "
                          f"({getattr(hf_config, 'model_type', None)!r}; built for them: "
                          f"{', '.join(HYBRID_SPEC_METHODS)})")
    return parsed


def _check_mtp(hf_config: Any, source: Any, load_format: str) -> None:
    """MTP speculation: the target and its checkpoint carry a usable MTP module (engine/mtp.py)."""
    from voltllm.engine.mtp import check_mtp_checkpoint, check_mtp_target
    from voltllm.engine.speculative import SpeculativeConfigError

    try:
        check_mtp_target(hf_config)
        check_mtp_checkpoint(source, load_format)
    except SpeculativeConfigError as e:
        raise ConfigError(str(e)) from None


def _resolve_quantization(flag: Optional[str], kind: str, hf_config: Any) -> Optional[str]:
    """The checkpoint's quantization method (what it is, not what the flag says); --quantization must agree, except
    `fp8` / `bitsandbytes` on an unquantized llama-family checkpoint, which quantizes it at load."""
    from voltllm.model.loader.bnb_checkpoint import BnbCheckpointError, bnb_scheme
    from voltllm.model.loader.compressed_tensors_checkpoint import CTCheckpointError, ct_scheme
    from voltllm.model.loader.fp8_checkpoint import FP8CheckpointError, fp8_scheme
    from voltllm.model.loader.int4_checkpoint import Int4CheckpointError, int4_scheme, quantization_method
    from voltllm.model.loader.nvfp4_checkpoint import NVFP4CheckpointError, nvfp4_scheme
    from voltllm.model.models.registry import attention_only

    method = "gguf" if kind == "gguf" else quantization_method(hf_config)
    try:
        if method == "modelopt":  # NVFP4 is the variant read; others raise
            method = nvfp4_scheme(hf_config).method
        elif method == "compressed-tensors" and nvfp4_scheme(hf_config) is None:
            ct_scheme(hf_config)  # int4 / int8 / FP8 layouts; others raise
        if method is not None and method not in _READ_METHODS:
            raise ConfigError(f"the checkpoint is quantized with {method!r}: reading it is not built yet (built: GGUF "
                              "files, 4-bit AWQ and 4- / 8-bit GPTQ checkpoints, FP8 checkpoints, NVFP4 checkpoints "
                              "of ModelOpt and compressed-tensors, compressed-tensors int4 / int8 / FP8 checkpoints, "
                              "bitsandbytes 4- / 8-bit checkpoints)")
        int4_scheme(hf_config) if method in ("awq", "gptq") else fp8_scheme(hf_config) if method == "fp8" else None
        bnb_scheme(hf_config) if method == "bitsandbytes" else None
    except (Int4CheckpointError, FP8CheckpointError, NVFP4CheckpointError, CTCheckpointError, BnbCheckpointError) as e:
        raise ConfigError(str(e)) from None
    wanted = QUANTIZATION_ALIASES.get(flag) if flag is not None else None
    if wanted in ("fp8", "bitsandbytes") and method is None:
        if not attention_only(hf_config):  # (the hybrids' GDN projections have no at-load path)
            raise ConfigError(f"--quantization {flag} quantizes the projections at load for the llama / qwen2 / qwen3 "
                              f"/ qwen3_moe architectures only, not {getattr(hf_config, 'model_type', None)!r}")
        return wanted
    if wanted is not None and wanted != method:
        what = {"awq": "an AWQ checkpoint", "gptq": "a GPTQ checkpoint", "gguf": "a GGUF file",
                "fp8": "an FP8 checkpoint", "modelopt_fp4": "a ModelOpt NVFP4 checkpoint",
                "compressed-tensors": "a compressed-tensors checkpoint",
                "bitsandbytes": "a bitsandbytes checkpoint"}.get(method, "not a quantized checkpoint")
        raise ConfigError(f"--quantization {flag}: the model is {what}"
                          + (" (--quantization gguf needs a .gguf model file)" if wanted == "gguf" else ""))
    return method


# vLLM's --load-format values that name the files a checkpoint already has: the same as auto when they match
_FILE_FORMATS = {"safetensors": ("hf", "*.safetensors"), "pt": ("hf", "pytorch_model*.bin"), "gguf": ("gguf", None)}


def _resolve_load_format(fmt: str, source: Any) -> str:
    """auto / dummy as given; safetensors / pt / gguf checked against the model's files, then auto; bitsandbytes
    (vLLM's loader of bitsandbytes weights, which `--quantization bitsandbytes` implies) is auto once
    _check_bnb_load_format has seen the method."""
    if fmt in ("auto", "dummy", "bitsandbytes"):
        return "auto" if fmt == "bitsandbytes" else fmt
    if fmt not in _FILE_FORMATS:
        raise ConfigError(f"--load-format must be one of auto, dummy, {', '.join(_FILE_FORMATS)}, bitsandbytes; got "
                          f"{fmt!r}")
    kind, pattern = _FILE_FORMATS[fmt]
    if source.kind != kind or (pattern and not glob.glob(os.path.join(source.path, pattern))):
        raise ConfigError(f"--load-format {fmt}: {source.path} has no such weights (auto picks what it has)")
    return "auto"


def _check_bnb_load_format(fmt: str, method: Optional[str]) -> None:
    """--load-format bitsandbytes reads bitsandbytes weights: a bitsandbytes checkpoint, or one quantized at load
    with --quantization bitsandbytes."""
    if fmt == "bitsandbytes" and method != "bitsandbytes":
        raise ConfigError(f"--load-format bitsandbytes reads bitsandbytes checkpoints (or quantizes an unquantized one "
                          f"with --quantization bitsandbytes); this model is "
                          f"{'quantized with ' + repr(method) if method else 'not quantized'}: drop the flag")


def _quantized_weights(method: Optional[str], flag: Optional[str], hf_config: Any, device: torch.device,
                       load_format: str) -> str:
    """ModelConfig.quantized_weights: kept quantized only on a GPU, for architectures with quantized layers
    (models/registry.py), always with --quantization, else by size (worker/runner.py)."""
    from voltllm.model.models.registry import supports_quantized_layers

    if method is None or device.type != "cuda" or load_format != "auto" or KEEP_QUANTIZED == 0:
        return "dequantized"
    if not supports_quantized_layers(hf_config):
        logger.warning("%s weights are dequantized at load: quantized layers are not built for model type %r",
                       method, getattr(hf_config, "model_type", None))
        return "dequantized"
    return "quantized" if flag is not None or KEEP_QUANTIZED == 1 else "auto"


def _gpu_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """The GPU's compute capability (None on the CPU). Below sm_70 nothing here runs (Triton and the torch builds
    voltllm targets stop at sm_70): refused, rather than sent down the sm75 route."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (7, 0):
        name = torch.cuda.get_device_properties(device).name
        raise ConfigError(f"{name} (sm_{major}{minor}) is not supported: voltllm needs a GPU of sm_70 (V100) or "
                          "newer; run on the CPU with --device cpu")
    return major, minor


def _run_capability(device: torch.device, cards: int) -> Optional[tuple[int, int]]:
    """The compute capability the run's route and dtype follow: over the cards it uses (-tp x -dp from --device's
    index, as far as they are visible: the count is checked later), the lowest, so that a V100 beside an RTX 3090
    gets the compat route and fp16 it needs, whichever card CUDA lists first. None on the CPU."""
    if device.type != "cuda":
        return None
    first = device.index or 0
    last = max(first + 1, min(first + cards, torch.cuda.device_count()))
    caps = {i: _gpu_capability(torch.device("cuda", i)) for i in range(first, last)}
    lowest = min(caps.values())
    if len(set(caps.values())) > 1:
        logger.warning("mixed GPUs (%s): the kernel route and dtype follow the oldest, sm_%d%d, on every card",
                       ", ".join(f"cuda:{i} sm_{c[0]}{c[1]}" for i, c in caps.items()), *lowest)
    return lowest


def _resolve_compat(compat: str, device: torch.device, capability: Optional[tuple[int, int]] = None) -> str:
    from voltllm.platform import auto_compat

    if compat not in ("auto", "none", "sm70", "sm75"):
        raise ConfigError(f"--compat must be auto, none, sm70 or sm75, got {compat!r}")
    if compat in ("sm70", "sm75") and device.type != "cuda":
        # the CPU runs the plain-PyTorch reference: a GPU kernel route would silently do nothing there
        raise ConfigError(f"--compat {compat} selects a GPU kernel route, but the device is the CPU (--device cpu, "
                          "or no GPU visible); drop --compat (or pass auto)")
    if compat != "auto":
        return compat
    return auto_compat(capability)


def _no_bf16_reason(device: torch.device, compat: str, capability: Optional[tuple[int, int]]) -> Optional[str]:
    """What lacks bf16 here (None: bf16 runs): the compat route, or a GPU below sm_80 whatever --compat says (torch
    has no bf16 attention kernels there). The CPU runs bf16 in torch."""
    if device.type != "cuda":
        return None
    if compat != "none":
        return f"the {compat} route"
    if capability is not None and tuple(capability) < (8, 0):
        return f"this GPU (sm_{capability[0]}{capability[1]}, below sm_80)"
    return None


def _resolve_dtype(dtype: str, hf_config: Any, device: torch.device, compat: str,
                   capability: Optional[tuple[int, int]] = None) -> torch.dtype:
    no_bf16 = _no_bf16_reason(device, compat, capability)
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # half types are slow and imprecise on CPUs
        cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg, str):
            cfg = _DTYPES.get(cfg)
        if no_bf16 is not None:
            if cfg == torch.bfloat16:  # fp16's range is narrower: say so, and how to keep bf16's
                logger.info("the checkpoint is bfloat16; it runs in float16 because %s has no bf16 (--dtype float32 "
                            "keeps its range, at twice the memory)", no_bf16)
            return torch.float16
        return cfg if cfg in (torch.float16, torch.bfloat16) else torch.float16
    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype must be auto, half, float16, bfloat16 or float32, got {dtype!r}")
    resolved = _DTYPES[dtype]
    if resolved == torch.bfloat16 and no_bf16 is not None:
        raise ConfigError(f"--dtype {dtype}: {no_bf16} has no bf16; use --dtype half (or float32)")
    return resolved


def _max_positions(hf_config: Any) -> int:
    """The context the config allows: its max positions, stretched by static RoPE scaling as vLLM derives it
    (yarn: original_max_position_embeddings x factor; linear: max positions x factor)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return _rope_scaled(hf_config, value)
    text = getattr(hf_config, "text_config", None)
    if text is not None:
        return _max_positions(text)
    return 4096


_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(flag: str, value: Any, unit: str = "tokens", auto: bool = False) -> Any:
    """A size as vLLM writes one: 8192, 32k (32,000), 32K (32,768), 1.5m, 4G; an int passes through. auto: "auto"
    (any case) and -1 give "auto" (--max-model-len: fit to the KV cache)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return "auto" if auto and value == -1 else value
    text = str(value).strip()
    if auto and text.lower() in ("auto", "-1"):
        return "auto"
    scale = _SIZE_SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        amount = float(number) * scale if scale != 1 else int(number)
    except ValueError:
        amount = None
    if amount is None or amount != int(amount) or isinstance(value, bool):
        example = "8192, 32k or 32K" if unit == "tokens" else "4294967296, 4G or 4g"
        raise ConfigError(f"{flag} takes a whole number of {unit} like {example}" + (" or auto" if auto else "")
                          + f", got {value!r}")
    return int(amount)




def _rope_scaled(hf_config: Any, max_positions: int) -> int:
    from voltllm.model.layers.rotary import rope_parameters

    params = rope_parameters(hf_config)
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 1.0:
        return max_positions
    if params.get("rope_type") == "yarn":
        return int(int(params.get("original_max_position_embeddings") or max_positions) * factor)
    if params.get("rope_type") == "linear":  # (not "dynamic": its frequencies change with the length at run time,
        return int(max_positions * factor)      # which one precomputed table cannot follow past max positions)
    return max_positions


def _generation_override(value: Any) -> Optional[dict]:
    """--override-generation-config: a JSON object of sampling defaults, each checked like a request's field."""
    from voltllm.engine.frontend import GENERATION_DEFAULT_KEYS
    from voltllm.sampling.params import SamplingParams, SamplingParamsError

    override = parse_json_object("--override-generation-config", value)
    if not override:
        return None
    unknown = sorted(set(override) - set(GENERATION_DEFAULT_KEYS))
    if unknown:
        raise ConfigError(f"--override-generation-config: {', '.join(unknown)} not supported (the keys are "
                          f"{', '.join(GENERATION_DEFAULT_KEYS)})")
    try:
        SamplingParams(**override)
    except (SamplingParamsError, TypeError) as e:
        raise ConfigError(f"--override-generation-config: {e}") from None
    return dict(override)
