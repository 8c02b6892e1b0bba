"""Engine flags shared by `voltllm serve | generate | bench` (vLLM names), mapped onto EngineArgs.

A flag whose capability is not built yet is still accepted here; EngineArgs.create_engine_config()
then refuses it with a message naming the flag, so nothing is silently ignored.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from voltllm.config import KV_CACHE_DTYPES, ConfigError, EngineArgs, parse_size


def _json_arg(flag: str, what: str, ok):
    """argparse type: a JSON value that `ok` accepts, else a message naming the flag and `what` it takes."""
    def parse(value: str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}: {e}") from None
        if not ok(parsed):
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {value}")
        return parsed
    return parse


def size_arg(flag: str, unit: str = "tokens", auto: bool = False):
    """argparse type for sizes written as vLLM accepts them: 8192, 32k (32,000), 32K (32,768), 1.5m, 4G (bytes).
    auto: "auto" and -1 are taken too, as "auto" (--max-model-len: fit to the KV cache)."""
    def parse(value: str):
        try:
            return parse_size(flag, value, unit, auto)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def compilation_config_arg(value: str):
    """argparse type for --compilation-config: a JSON object, or a bare number (vLLM's short form of {"mode": N})."""
    text = value.strip()
    if text.isdigit():
        return int(text)
    return json_object_arg("--compilation-config")(value)


def json_object_arg(flag: str):
    """argparse type for flags that take a JSON object (vLLM style)."""
    return _json_arg(flag, "a JSON object", lambda v: isinstance(v, dict))


def json_string_list(flag: str):
    """argparse type for flags that take a JSON list of strings (vLLM's CORS flags)."""
    return _json_arg(flag, "a JSON list of strings",
                     lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", dest="model_flag", default=None,
                   help="model path or Hugging Face Hub repo id (same as the positional MODEL)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path or Hub repo id (default: the model's)")
    g.add_argument("--revision", default=None, help="Hub model: branch, tag or commit (default: main)")
    g.add_argument("--tokenizer-revision", default=None,
                   help="Hub tokenizer (--tokenizer, else the model's repo): branch, tag or commit")
    g.add_argument("--download-dir", default=None, help="where Hub models are cached (default: Hugging Face's cache)")
    g.add_argument("--hf-token", nargs="?", const=True, default=None,
                   help="token for gated / private Hub repos; without a value: the one `hf auth login` stored")
    g.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    g.add_argument("--max-model-len", type=size_arg("--max-model-len", auto=True), default=None,
                   help="context length in tokens (8192, 32k = 32,000, 32K = 32,768; default: the model's); auto or "
                        "-1: the longest the KV cache holds after memory sizing, up to the model's")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=size_arg("--kv-cache-memory-bytes", unit="bytes"), default=None,
                   help="the KV cache's size in bytes (4G = 4 GiB, 4g = 4e9) instead of what "
                        "--gpu-memory-utilization leaves; on the CPU, the KV cache's size (default 2 GiB)")
    g.add_argument("--max-num-batched-tokens", type=size_arg("--max-num-batched-tokens"), default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="at most this many tokens of one request per step (0: no cap), so a long prompt leaves room "
                        "for the prompts behind it")
    g.add_argument("--max-num-partial-prefills", type=int, default=1,
                   help="above 1: --long-prefill-token-threshold defaults to 4%% of --max-model-len (vLLM's rule)")
    g.add_argument("--max-long-partial-prefills", type=int, default=1, help="at most --max-num-partial-prefills")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--prefix-caching-hash-algo", default="blake2b",
                   help="the prefix-cache block hash: blake2b (voltllm's, 128-bit), or vLLM's sha256, sha256_cbor, "
                        "xxhash, xxhash_cbor (the last three need the cbor2 / xxhash packages)")
    g.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of host memory (all -tp ranks together) keeping prefix-cache blocks the GPU evicts; a "
                        "later prompt with that prefix copies them back instead of recomputing them")
    g.add_argument("--kv-offloading-backend", default="native",
                   help="native: voltllm's CPU tier (vLLM's lmcache is not built)")
    w = p.add_argument_group("weight offloading to CPU memory (decoder layers streamed to the GPU each forward)")
    w.add_argument("--cpu-offload-gb", type=float, default=0,
                   help="GiB of decoder-layer weights per GPU kept in CPU memory (whole layers, spread out; 0: none)")
    w.add_argument("--cpu-offload-params", nargs="+", default=None,
                   help="offload only the tensors with these name segments (e.g. experts, mlp.down_proj)")
    w.add_argument("--offload-backend", default="auto",
                   help="auto = prefetch (copy layers into GPU slots ahead of their turn) | uva (kernels read the "
                        "weights in host memory in place; for MoE experts)")
    w.add_argument("--offload-group-size", type=int, default=0,
                   help="offload the last --offload-num-in-group layers of every N (instead of --cpu-offload-gb)")
    w.add_argument("--offload-num-in-group", type=int, default=1, help="layers offloaded per group")
    w.add_argument("--offload-prefetch-step", type=int, default=1,
                   help="offloaded layers copied ahead of their turn (GPU staging slots: this + 1)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    g.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=False,
                   help="fp8 KV cache: set each layer's k/v scale from the first forward's K/V amax "
                        "(checkpoint scales take precedence; ignored for a float cache)")
    g.add_argument("--calculate-key-offsets", action=argparse.BooleanOptionalAction, default=False,
                   help="fp8 KV cache: store keys minus each layer's per-channel key mean from the first forward "
                        "(attention is unchanged; less fp8 error for keys with a large mean, e.g. a QKV bias)")
    g.add_argument("--kv-cache-metrics", action=argparse.BooleanOptionalAction, default=False,
                   help="KV block residency histograms in GET /metrics: lifetime, idle time before eviction, reuse "
                        "gap (of a sampled share of the blocks)")
    g.add_argument("--kv-cache-metrics-sample", type=float, default=0.01,
                   help="the share of blocks --kv-cache-metrics follows, in (0, 1]")
    g.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction, default=False,
                   help="allow freeing the GPU between uses: LLM.sleep / wake_up, the server's POST /sleep?level=1|2, "
                        "POST /wake_up and GET /is_sleeping")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False, help="no CUDA graphs")
    g.add_argument("--compilation-config", "-cc", type=compilation_config_arg, default=None,
                   help='CUDA graphs as vLLM configures them, e.g. \'{"cudagraph_mode": "FULL_DECODE_ONLY", '
                        '"cudagraph_capture_sizes": [1, 2, 4, 8]}\' (no torch.compile here: docs/cli.md)')
    g.add_argument("--optimization-level", "-O", type=int, default=None, choices=[0, 1, 2, 3],
                   help="vLLM's -O0..-O3: 0 = no CUDA graphs; 2 and 3 = the default graphs; 1 is refused (docs/cli.md)")
    g.add_argument("--cudagraph-capture-sizes", nargs="+", type=int, default=None,
                   help="batch sizes the decode CUDA graphs are captured for")
    g.add_argument("--cuda-graph-sizes", nargs="+", type=int, default=None,
                   help="vLLM's older flag: one value N captures 1, 2, 4 and the multiples of 8 up to N; several "
                        "values are the sizes")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="largest decode CUDA graph batch size (default 512, and at most --max-num-seqs)")
    g.add_argument("--require-acceleration", action=argparse.BooleanOptionalAction, default=False,
                   help="refuse to start when a route this configuration expects is disabled (see voltllm check)")
    g.add_argument("--attention-backend", default=None, help="TRITON_ATTN | TORCH_REF | FLASH_ATTN_V100 (alias)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engines side by side, each a whole copy of the model on its own -tp GPUs; the server sends "
                        "each request to the least busy one, or to the one caching its prompt's beginning (serve and "
                        "run-batch)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--enable-expert-parallel", "-ep", action=argparse.BooleanOptionalAction, default=False,
                   help="MoE models under -tp: each rank holds whole routed experts (E / N, the first ranks one more) "
                        "instead of every expert's 1/N rows; attention and a shared expert stay split")
    g.add_argument("--expert-placement-strategy", default="linear", choices=["linear", "round_robin"],
                   help="linear: contiguous runs of experts per rank (round_robin falls back to it, as vLLM does for "
                        "models without expert groups)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill is always chunked to --max-num-batched-tokens per step (vLLM V1's behaviour)")
    g.add_argument("--swap-space", type=float, default=None,
                   help="accepted for vLLM compatibility: preempted requests are recomputed, never swapped")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="accepted for vLLM compatibility: tensor-parallel all-reduces use NCCL (gloo on the CPU)")
    g.add_argument("--quantization", "-q", default=None,
                   help="the model's method (gguf, awq, gptq, fp8, modelopt_fp4, bitsandbytes, ...; docs/cli.md): "
                        "keep its weights quantized on the GPU (without it: only when, dequantized, they would take "
                        "over half the usable memory); "
                        "fp8 / bitsandbytes on an fp16 / bf16 model quantizes it at load")
    g.add_argument("--speculative-config", type=json_object_arg("--speculative-config"), default=None)
    g.add_argument("--profiler-config", type=json_object_arg("--profiler-config"), default=None,
                   help='vLLM\'s: \'{"profiler": "torch", "torch_profiler_dir": "/abs/dir"}\' (or "cuda"): POST '
                        '/start_profile and /stop_profile, LLM.start_profile / stop_profile')
    g.add_argument("--kv-events-config", type=json_object_arg("--kv-events-config"), default=None,
                   help='vLLM\'s KV cache events over ZeroMQ, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
                        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (docs/cli.md)')
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="send an OpenTelemetry span per finished request (llm_request) to this OTLP collector: an "
                        "http(s) URL ending in /v1/traces uses OTLP/HTTP, anything else (HOST:PORT, grpc://HOST:PORT, "
                        "http(s)://HOST:PORT) OTLP/gRPC (docs/cli.md)")
    g.add_argument("--reasoning-config", type=json_object_arg("--reasoning-config"), default=None,
                   help='reasoning delimiters for thinking_token_budget, e.g. \'{"reasoning_start_str": "<think>", '
                   '"reasoning_end_str": "</think>"}\' (default: --reasoning-parser\'s)')
    g.add_argument("--hf-overrides", type=json_object_arg("--hf-overrides"), default=None,
                   help="JSON object of HF config fields to change, e.g. RoPE scaling for long context")
    g.add_argument("--hf-config-path", default=None,
                   help="the model's Hugging Face config from this directory, config .json file or Hub repo id (e.g. "
                        "a GGUF model's original repo) instead of its own; it must describe the same network")
    g.add_argument("--generation-config", default="auto")
    g.add_argument("--override-generation-config", type=json_object_arg("--override-generation-config"),
                   default=None, help='sampling defaults over the generation config, e.g. \'{"temperature": 0.6}\'')
    g.add_argument("--chat-template", default=None, help="a Jinja template or a path to one")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument("--compat", default="auto", choices=["auto", "none", "sm70", "sm75"],
                   help="force the route for GPUs without native bf16/fp8")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--mamba-block-size", type=int, default=None)
    g.add_argument("--mamba-cache-mode", default="align", choices=["align", "none", "all"])
    g.add_argument("--language-model-only", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--mmproj", default=None, metavar="PATH",
                   help="llama.cpp's vision projector file (mmproj-*.gguf) of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / "
                        "Qwen3.5 GGUF model (default: with an owner/name:QUANT model, the repo's projector, fetched "
                        "as llama.cpp's -hf does; else the one *mmproj*.gguf beside the model file)")
    g.add_argument("--no-mmproj", action="store_true", default=False,
                   help="llama.cpp's: no projector fetched from the Hub or looked for beside a GGUF model (text "
                        "only); --mmproj PATH still loads")
    g.add_argument("--enable-prompt-embeds", action=argparse.BooleanOptionalAction, default=False,
                   help="take prompts as embedding rows: /v1/completions' prompt_embeds (base64 of a torch.save()d "
                        "[tokens, hidden] tensor), offline {\"prompt_embeds\": tensor}")
    g.add_argument("--ignore-patterns", nargs="+", default=None, metavar="PATTERN",
                   help="glob patterns of the model's files (relative to its directory or repo) not to fetch or read "
                        "(default: original/*, the consolidated copies some repos carry)")
    g.add_argument("--pt-load-map-location", default="cpu", metavar="DEVICE",
                   help="where torch.load puts a pytorch_model*.bin checkpoint's tensors first (cpu, cuda, or a JSON "
                        "object such as '{\"cuda:1\": \"cuda:0\"}'), for checkpoints that load only there")
    g.add_argument("--use-tqdm-on-load", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar over the checkpoint's files (GGUF: its tensors) while the weights load")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy", "safetensors", "pt", "gguf",
                                                              "bitsandbytes"],
                   help="dummy: random weights at the model's shapes (benchmarks); safetensors / pt / gguf: as auto, "
                        "checked against the model's files; bitsandbytes: as auto for a bitsandbytes model")
    g.add_argument("--skip-tokenizer-init", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: first come, first served; priority: by each request's priority (lower first), then "
                        "arrival; the lowest-priority running request is preempted when KV blocks run out")
    pm = p.add_argument_group("pooling (embedding) models (voltllm/pooling/config.py)")
    pm.add_argument("--runner", default="auto",
                    help="auto | generate | pooling: one runner per engine; pooling serves embeddings (/v1/embeddings, "
                         "LLM.embed) instead of generating; auto: pooling for sentence-transformers checkpoints and "
                         "encoder architectures (...Model), else generate")
    pm.add_argument("--convert", default="auto",
                    help="auto | none | embed: embed runs a causal LM as an embedding model (implies --runner pooling)")
    pm.add_argument("--task", default=None,
                    help="vLLM's older flag: generate (or auto) | embed (= --runner pooling --convert embed)")
    pm.add_argument("--pooler-config", type=json_object_arg("--pooler-config"), default=None,
                    help='pooling models: \'{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true, '
                         '"dimensions": N}\' (default: the checkpoint\'s sentence-transformers pooler, else LAST, '
                         'normalized)')
    pm.add_argument("--override-pooler-config", type=json_object_arg("--override-pooler-config"), default=None,
                    help="vLLM's older name of --pooler-config")
    mm = p.add_argument_group("image and video input (Qwen3.5 and Qwen3-VL vision-language models; "
                              "voltllm/multimodal/)")
    mm.add_argument("--limit-mm-per-prompt", type=json_object_arg("--limit-mm-per-prompt"), default=None,
                    help='most items of each modality in one request, e.g. \'{"image": 2, "video": 1}\' (default '
                         '999 images and 999 videos; audio is not built: 0 only)')
    mm.add_argument("--mm-processor-kwargs", type=json_object_arg("--mm-processor-kwargs"), default=None,
                    help='the image / video processors\' settings over their configs, e.g. \'{"max_pixels": '
                         '1003520}\' or \'{"fps": 1, "max_frames": 64}\'')
    mm.add_argument("--media-io-kwargs", type=json_object_arg("--media-io-kwargs"), default=None,
                    help='the media loaders\' settings: \'{"video": {"num_frames": N}}\' (vLLM\'s default 32; -1: '
                         'every frame, then the processor samples by its fps) and "fps"')
    mm.add_argument("--allowed-local-media-path", default=None,
                    help="a directory whose files requests may name as file:// image / video URLs (trusted clients "
                         "only)")
    mm.add_argument("--allowed-media-domains", nargs="+", default=None,
                    help="the only hosts http(s) image / video URLs may name (default: any)")
    mm.add_argument("--mm-processor-cache-gb", type=float, default=4.0,
                    help="GiB of processed images and videos kept by their bytes, so a chat's earlier items are not "
                         "decoded and processed again each turn (0: none)")
    mm.add_argument("--disable-mm-preprocessor-cache", action="store_true", default=False,
                    help="vLLM's older switch for --mm-processor-cache-gb 0")
    lo = p.add_argument_group("LoRA adapters (voltllm/lora/; --lora-modules is a server flag)")
    lo.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
                    help="serve PEFT LoRA adapters on the attention and dense-MLP projections, chosen per request")
    lo.add_argument("--max-loras", type=int, default=1, help="most distinct adapters in one batch (GPU slots)")
    lo.add_argument("--max-lora-rank", type=int, default=16,
                    help="the largest adapter rank (1, 8, 16, 32, 64, 128, 256, 320 or 512); slots are sized for it")
    lo.add_argument("--max-cpu-loras", type=int, default=None,
                    help="adapters kept loaded in CPU memory (default: --max-loras; never fewer)")
    lo.add_argument("--lora-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                    help="auto: the model's dtype (the only one built)")
    # vLLM flags voltllm takes at the value that is its behaviour (voltllm/fixed_flags.py; docs/cli.md)
    f = p.add_argument_group("vLLM flags taken at voltllm's behaviour (other values refused)")
    f.add_argument("--distributed-executor-backend", default=None,
                   help="mp: tensor-parallel ranks are worker processes (uni: one rank)")
    f.add_argument("--preemption-mode", default=None, help="recompute: preempted requests are prefilled again")
    f.add_argument("--tokenizer-mode", default="auto", help="auto | hf: the checkpoint's Hugging Face tokenizer")
    f.add_argument("--structured-outputs-config", type=json_object_arg("--structured-outputs-config"), default=None,
                   help='\'{"backend": "xgrammar"}\' (auto | xgrammar)')
    f.add_argument("--guided-decoding-backend", default=None, help="vLLM's older flag: auto | xgrammar")
    f.add_argument("--model-impl", default="auto", help="auto | vllm: voltllm's own model implementations")
    f.add_argument("--enable-mfu-metrics", action=argparse.BooleanOptionalAction, default=False,
                   help="estimated FLOPs and bytes read / written per GPU: GET /metrics counters and the stats log's "
                        "TF/s and GB/s")
    f.add_argument("--disable-sliding-window", action=argparse.BooleanOptionalAction, default=False,
                   help="a checkpoint's sliding-window layers attend to the whole context instead; caps "
                        "--max-model-len at the window")
    f.add_argument("--safetensors-load-strategy", default=None, help="lazy: files are memory-mapped")
    f.add_argument("--max-parallel-loading-workers", type=int, default=None,
                   help="at least --tensor-parallel-size: every rank loads its weights at once")
    f.add_argument("--performance-mode", default="balanced", help="balanced: vLLM's default tuning")
    f.add_argument("--logprobs-mode", default="raw_logprobs",
                   help="raw_logprobs: the model's log-softmax before penalties, logit_bias and temperature")
    f.add_argument("--disable-cascade-attn", action=argparse.BooleanOptionalAction, default=False,
                   help="either value: there is no cascade attention here")
    f.add_argument("--mamba-cache-dtype", default="auto",
                   help="auto: conv state in the model dtype, SSM state in float32")
    f.add_argument("--mamba-ssm-cache-dtype", default="auto", help="auto | float32: the SSM state is float32")
    f.add_argument("--config-format", default="auto", help="auto | hf: the checkpoint's config.json")
    f.add_argument("--attention-config", "-ac", type=json_object_arg("--attention-config"), default=None,
                   help='vLLM\'s \'{"backend": NAME}\', as --attention-backend NAME')


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values: dict[str, Any] = {}
    for name in EngineArgs.field_names():
        if hasattr(ns, name):
            values[name] = getattr(ns, name)
    flag, positional = getattr(ns, "model_flag", None), getattr(ns, "model", None)
    if flag is not None and positional is not None and flag != positional:
        raise ConfigError(f"the model is given twice: --model {flag} and MODEL {positional}; give one")
    values["model"] = flag or positional
    if values.get("attention_backend") == "FLASH_ATTN_V100":
        values["attention_backend"] = "TRITON_ATTN"  # the seed system's name for its V100 kernels
    if isinstance(values.get("chat_template"), str):
        values["chat_template"] = load_chat_template(values["chat_template"])
    return EngineArgs(**values)


def load_chat_template(value: str) -> str:
    import os

    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value
