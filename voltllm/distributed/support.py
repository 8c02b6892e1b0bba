"""What runs under --tensor-parallel-size N > 1 and --pipeline-parallel-size N > 1, checked once at configuration time
(one-line reasons)."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

# llama-family decoders (models/llama.py; qwen3_moe's sparse layers split by every expert's intermediate rows, or
# by whole experts under --enable-expert-parallel: distributed/experts.py); a qwen3_vl / qwen3_vl_moe checkpoint runs
# as its text model (a qwen3 / qwen3_moe), a qwen2_vl / qwen2_5_vl one as a qwen2
TP_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen2_vl", "qwen2_5_vl")
# hybrids (models/qwen3_next.py: Gated DeltaNet + gated attention + dense or sparse MoE MLPs; models/qwen4_exp.py:
# the same mixers and MoE with hyper-connections, PLE and QSA); a multimodal qwen3_5 / qwen3_5_moe / qwen4_exp
# checkpoint runs as its text model
TP_HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp",
                   "qwen4_exp_text")
# speculative methods under TP: host n-gram and suffix drafts; the target's MTP module, a DFlash drafter and the EAGLE
# heads split over the ranks as its layers are (worker/mtp_runner.py, dflash_runner.py); a draft model runs unsharded
# beside rank 0's target shard
TP_SPEC_METHODS = ("ngram", "draft_model", "mtp", "dflash", "eagle", "eagle3", "suffix")
# speculative methods under PP: the host's drafts, a draft model, the target's MTP module, a DFlash drafter and an
# EAGLE-3 head, all on rank 0 (stage 0: the MTP reads the final norm's output of the last stage's rows, which come
# back to rank 0, and stage 0's embedding and LM head; DFlash and EAGLE-3 read several layers' outputs, which each
# stage adds to rows the hand-over carries back to rank 0: worker/aux_features.py); rank 0 verifies, and on a hybrid
# every stage keeps the accepted rows of its own layers' states, rank 0's counts broadcast as under TP
PP_SPEC_METHODS = ("ngram", "suffix", "draft_model", "mtp", "dflash", "eagle", "eagle3")


def expert_parallel_error(tp: int, hf_config: Any) -> Optional[str]:
    """Why --enable-expert-parallel cannot apply to this model at `tp` ranks (None: it can). As in vLLM, a model
    without routed experts is an error whatever the rank count, and with one rank the flag changes nothing."""
    from voltllm.distributed.experts import model_num_experts

    experts = model_num_experts(hf_config)
    if experts < 1:
        return (f"--enable-expert-parallel: the model ({getattr(hf_config, 'model_type', None)!r}) has no routed "
                "experts (expert parallelism places a mixture-of-experts model's experts on the ranks); drop it")
    if tp > 1 and experts < tp:
        return (f"--enable-expert-parallel: the model's {experts} experts are fewer than the {tp} ranks (each rank "
                f"holds whole experts); use --tensor-parallel-size {experts} or less, or drop the flag to split every "
                "expert's rows instead")
    return None


def tensor_parallel_error(tp: int, hf_config: Any, device: torch.device, speculative: Any,
                          quantized_weights: str, method: Optional[str] = None,
                          expert_parallel: bool = False) -> Optional[str]:
    """Why this configuration cannot run with tensor parallelism `tp` (None: it can). `quantized_weights` and
    `method`: ModelConfig's (weights kept quantized are split too, see quantized_split_error); expert_parallel:
    the routed experts are placed whole (their rows are not split)."""
    flag = f"--tensor-parallel-size {tp}"
    if tp < 1:
        return f"--tensor-parallel-size must be >= 1, got {tp}"
    if tp == 1:
        return None
    kind = getattr(hf_config, "model_type", None)
    if kind not in TP_MODEL_TYPES + TP_HYBRID_TYPES:
        return (f"{flag}: tensor parallelism is built for {' / '.join(TP_MODEL_TYPES + TP_HYBRID_TYPES)} models, "
                f"not {kind!r}")
    text = getattr(hf_config, "text_config", None) or hf_config  # (a multimodal checkpoint's text model)
    if kind in TP_HYBRID_TYPES:
        nk, nv = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
        if nk % tp:
            return f"{flag}: the model's {nk} Gated DeltaNet key heads do not divide by {tp}"
        if nv % tp:
            return f"{flag}: the model's {nv} Gated DeltaNet value heads do not divide by {tp}"
    if err := layer_split_error(tp, text, expert_parallel):
        return f"{flag}: {err}"
    if kind in ("qwen4_exp", "qwen4_exp_text") and (err := _qwen4_exp_split_error(tp, text)):
        return f"{flag}: {err}"
    if speculative is not None and speculative.method not in TP_SPEC_METHODS:
        return (f"{flag}: speculative method {speculative.method!r} is not supported under tensor parallelism "
                f"(use {' or '.join(TP_SPEC_METHODS)})")
    if quantized_weights == "quantized" and (err := quantized_split_error(tp, hf_config, method, expert_parallel)):
        return err
    if device.type == "cuda":
        first = device.index or 0
        count = torch.cuda.device_count()
        if first + tp > count:
            return f"{flag}: needs {tp} CUDA devices from cuda:{first}, but {count} are visible"
    elif device.type != "cpu":
        return f"{flag}: tensor parallelism runs on CUDA (NCCL) or the CPU (gloo), not {device.type}"
    return None


def layer_split_error(tp: int, cfg: Any, expert_parallel: bool = False) -> Optional[str]:
    """Why decoder layers of config `cfg` cannot be split over `tp` ranks (attention heads, KV heads, MLP widths), None
    if they can (a target's, or a drafter's split like it)."""
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % tp:
        return f"the model's {heads} attention heads do not divide by {tp}"
    if kv % tp and tp % kv:
        return f"the model's {kv} KV heads neither divide by {tp} nor divide it (needed to shard or replicate)"
    for name, width in _split_widths(cfg, expert_parallel).items():
        if width % tp:
            return f"the model's {name} {width} does not divide by {tp}"
    return None


def _qwen4_exp_split_error(tp: int, cfg: Any) -> Optional[str]:
    """Qwen4-Exp's own cuts (models/qwen4_exp.py): the PLE tables by each n-gram head's channels; the QSA raw keys
    packed into rows of a rank's KV heads."""
    if getattr(cfg, "ple_layer_ids", None):
        heads = (int(cfg.ngram_size) - 1) * int(cfg.heads_per_ngram)
        head_dim = int(getattr(cfg, "ple_embed_dim", None) or cfg.hidden_size) // heads
        if head_dim % tp:
            return f"the PLE n-gram heads' {head_dim} channels (split over the ranks) do not divide by {tp}"
    if getattr(cfg, "indexer_n_heads", None) is not None:
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        row = max(1, kv // tp) * int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        if int(cfg.indexer_head_dim) > row:
            return (f"a rank's KV cache rows ({max(1, kv // tp)} KV heads, {row} channels) cannot hold the QSA index "
                    f"keys of {cfg.indexer_head_dim} channels")
    return None


def _split_widths(cfg: Any, expert_parallel: bool = False) -> dict[str, int]:
    """The MLP widths split evenly over the ranks (each rank a 1/N share of the intermediate rows): the dense MLP's,
    and with sparse MoE layers every routed expert's (unless expert parallelism places them whole) and the shared
    expert's; those the config has (non-zero)."""
    widths = {"intermediate size": getattr(cfg, "intermediate_size", 0)}
    if int(getattr(cfg, "num_experts", 0) or 0) > 0:
        if not expert_parallel:
            widths["MoE intermediate size"] = getattr(cfg, "moe_intermediate_size", 0)
        widths["shared-expert intermediate size"] = getattr(cfg, "shared_expert_intermediate_size", 0)
    return {name: int(w) for name, w in widths.items() if w}


def _column_multiple(hf_config: Any, method: Optional[str]) -> Optional[tuple[int, str]]:
    """(inputs, what) at which the planes of a kept-quantized checkpoint can be cut along the inputs
    (gguf_planes.column_multiple), as far as the config tells; None where it does not say (act-order GPTQ is
    dequantized per layer; FP8 quantized at load cuts the unquantized weight)."""
    from voltllm.model.layers.gguf_planes import FP8_KIND, GROUP, NVFP4_KIND, column_multiple
    from voltllm.model.loader.int4_checkpoint import int4_scheme, quantization_method

    if method in ("awq", "gptq"):
        scheme = int4_scheme(hf_config)
        if scheme is None or scheme.desc_act:
            return None
        if scheme.group_size in (-1, 0):
            return -1, f"{method.upper()} with one scale per row (group_size {scheme.group_size})"
        return math.lcm(GROUP, scheme.group_size), f"{method.upper()} in groups of {scheme.group_size}"
    if method == "fp8":
        return None if quantization_method(hf_config) is None else (column_multiple(FP8_KIND), "FP8 (E4M3)")
    if method == "compressed-tensors":
        return _ct_column_multiple(hf_config)
    if method == "modelopt_fp4":
        return column_multiple(NVFP4_KIND), "NVFP4"
    if method == "gguf":  # per tensor type: 64 at least (K-quants 256, checked at load)
        return GROUP, "GGUF"
    if method == "bitsandbytes":  # 4-bit: per layer, blocks of 64 or 128 (checked at load); 8-bit: a row's scale
        from voltllm.model.loader.bnb_checkpoint import bnb_scheme  # repeated per 64 inputs

        scheme = bnb_scheme(hf_config, method)
        return None if scheme is None else (GROUP, f"bitsandbytes {scheme.bits}-bit")
    return None


def _ct_column_multiple(hf_config: Any) -> Optional[tuple[int, str]]:
    """_column_multiple for a compressed-tensors checkpoint: NVFP4's, or the least multiple every config group's
    planes allow (int4: whole groups; int8: Q8_0's 64, with zero points in groups whole groups (the int8 kinds), one
    scale per row repeated per 64; FP8: the FP8 planes' 128); int4 with one scale per row makes it -1. Layers
    dequantized at load (act-order, int8 zero points in groups not a multiple of 16) set none beyond 64."""
    from voltllm.model.layers.gguf_planes import FP8_KIND, GROUP, KINDS, NVFP4_KIND, column_multiple, int8_kind
    from voltllm.model.loader.compressed_tensors_checkpoint import INT8_GROUP_MULTIPLE, ct_scheme
    from voltllm.model.loader.nvfp4_checkpoint import nvfp4_scheme

    if nvfp4_scheme(hf_config) is not None:
        return column_multiple(NVFP4_KIND), "NVFP4"
    scheme = ct_scheme(hf_config)
    mult, whats = 1, []
    for w in scheme.groups if scheme else ():
        if w.act_order:
            continue
        whats.append(f"compressed-tensors {w.describe()}")
        if w.type == "float":
            mult = math.lcm(mult, column_multiple(FP8_KIND))
        elif w.num_bits == 8 and not w.symmetric and w.strategy == "group" and w.group_size % INT8_GROUP_MULTIPLE == 0:
            mult = math.lcm(mult, column_multiple(int8_kind(w.group_size, zero_points=True)))
        elif w.num_bits == 8:  # Q8_0's scale repeated per 32 inputs, or a row's scale and zero point per 64
            mult = math.lcm(mult, column_multiple(KINDS["Q8_0"]))
        elif w.strategy != "group":
            return -1, whats[-1]
        else:
            mult = math.lcm(mult, GROUP, w.group_size)
    return (mult, " / ".join(whats)) if whats else None


def quantized_split_error(tp: int, hf_config: Any, method: Optional[str],
                          expert_parallel: bool = False) -> Optional[str]:
    """Why the weights kept quantized cannot be split over `tp` ranks (None: they can). A row-parallel projection
    (o_proj, down_proj, GDN out_proj) gives each rank a band of its inputs, which must be whole blocks / groups of the
    quantized format wherever the whole weight is kept quantized (its inputs a multiple of them). Routed experts
    placed whole (expert_parallel) are not cut."""
    if tp <= 1:
        return None
    rule = _column_multiple(hf_config, method)
    if rule is None:
        return None
    mult, what = rule
    flag = f"--tensor-parallel-size {tp}"
    if mult < 0:
        return (f"{flag}: {what}: a row-parallel projection's scales span all its inputs, which cannot be split "
                "across ranks while kept quantized; drop --quantization to dequantize at load")
    cfg = getattr(hf_config, "text_config", None) or hf_config

    def get(name: str) -> int:
        return int(getattr(cfg, name, None) or 0)

    heads = get("num_attention_heads")
    inputs = {"attention heads x head_dim": heads * (get("head_dim") or get("hidden_size") // max(heads, 1)),
              "Gated DeltaNet value heads x value dim": get("linear_num_value_heads") * get("linear_value_head_dim"),
              **_split_widths(cfg, expert_parallel)}
    mlp = set(_split_widths(cfg, expert_parallel))
    for name, width in inputs.items():
        if not width or width % mult or width % tp:
            continue  # not kept quantized whole (dequantized per layer), or not divisible: tensor_parallel_error's
        if (width // tp) % mult == 0:
            continue
        if name in mlp and width // mult >= tp:
            continue  # split in whole groups instead, not all ranks the same (sharding.intermediate_split)
        return (f"{flag}: the model's {name} {width} / {tp} = {width // tp} inputs per rank is not a multiple of "
                f"{mult} ({what}: a row-parallel projection's quantized blocks cannot be split)"
                + (f", and its {width // mult} groups are fewer than the ranks" if name in mlp else "")
                + f"; use a tensor-parallel size that gives each rank a multiple of {mult}, or drop --quantization "
                "to dequantize at load")
    return None


def intermediate_alignment(tp: int, hf_config: Any, method: Optional[str], expert_parallel: bool = False) -> int:
    """The granularity the MLP / expert intermediate rows are split at (ParallelConfig.intermediate_align): the
    quantized group of the down projections' inputs where an even share would cut one (then the ranks get whole
    groups, not all the same number), else 1 (an even split). Routed experts placed whole (expert_parallel) have
    no say."""
    rule = _column_multiple(hf_config, method) if tp > 1 else None
    if rule is None or rule[0] < 0:
        return 1
    mult = rule[0]
    cfg = getattr(hf_config, "text_config", None) or hf_config
    uneven = [w for w in _split_widths(cfg, expert_parallel).values()
              if w % mult == 0 and w % tp == 0 and (w // tp) % mult]
    return mult if uneven else 1


def pipeline_parallel_error(args: Any, hf_config: Any, speculative: Any, runner: str,
                            device: torch.device) -> Optional[str]:
    """Why this configuration cannot run with --pipeline-parallel-size args.pipeline_parallel_size (None: it can).
    args: EngineArgs; runner: the resolved runner (generate / pooling); device: the resolved device."""
    pp = args.pipeline_parallel_size
    flag = f"--pipeline-parallel-size {pp}"
    if pp < 1:
        return f"--pipeline-parallel-size must be >= 1, got {pp}"
    if pp == 1:
        return None
    refused = [(speculative is not None and speculative.method not in PP_SPEC_METHODS,
                f"with --speculative-config method {getattr(speculative, 'method', None)!r} (built: "
                f"{', '.join(PP_SPEC_METHODS)})"),
               (bool(args.cpu_offload_gb) or bool(args.offload_group_size),
                "with weight offloading (--cpu-offload-gb, --offload-group-size)"),
               (bool(args.kv_offloading_size), "with --kv-offloading-size"),
               (runner == "pooling", "for pooling models")]
    for hit, what in refused:
        if hit:
            return f"{flag}: pipeline parallelism {what} is not built"
    from voltllm.distributed.pipeline import stage_layers
    from voltllm.model.models.registry import attention_only

    text = getattr(hf_config, "text_config", None) or hf_config
    layers = int(text.num_hidden_layers)
    if pp > layers:
        return f"{flag}: the model has only {layers} decoder layers (one stage holds at least one)"
    stages = stage_layers(layers, pp)
    vision = getattr(hf_config, "vision_config", None)
    deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or []) if vision is not None else 0
    if deepstack > stages[0][1]:  # (Qwen3-VL adds image rows after its first layers, which rank 0 must hold)
        return (f"{flag}: rank 0's {stages[0][1]} layers are fewer than the {deepstack} layers the vision tower's "
                "deepstack rows join; use fewer stages")
    if not attention_only(hf_config):  # a hybrid: every stage needs a KV cache and a recurrent state to size
        from voltllm.model.models.qwen3_next import hybrid_layer_types

        kinds = hybrid_layer_types(text)
        if getattr(hf_config, "model_type", None) in ("qwen4_exp", "qwen4_exp_text"):  # (its indexed attention)
            from voltllm.model.models.qwen4_exp import layer_kinds

            kinds = ["full_attention" if k == "indexed_attention" else k for k in layer_kinds(text)]
        for r, (start, end) in enumerate(stages):
            held = set(kinds[start:end])
            if held != {"full_attention", "linear_attention"}:
                return (f"{flag}: stage {r} (layers {start}-{end - 1}) would hold no "
                        f"{'full-attention' if 'full_attention' not in held else 'Gated DeltaNet'} layer, which is not "
                        "built; use fewer stages")
    if device.type == "cuda":  # (data-parallel engines of pp x tp ranks each, side by side from the first card)
        first, dp, ranks = device.index or 0, args.data_parallel_size, pp * args.tensor_parallel_size
        if first + dp * ranks > torch.cuda.device_count():
            need = f"{dp} x {ranks} = {dp * ranks}" if dp > 1 else f"{ranks}"
            return f"{flag}: needs {need} CUDA devices from cuda:{first}, but {torch.cuda.device_count()} are visible"
    return None
