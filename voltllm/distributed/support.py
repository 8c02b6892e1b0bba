"""What runs under --tensor-parallel-size N > 1, checked once at configuration time (one-line reasons)."""
from __future__ import annotations

from typing import Any, Optional

import torch

# dense llama-family decoders (models/llama.py without sparse MoE layers)
TP_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# dense hybrids (models/qwen3_next.py: Gated DeltaNet + gated attention + dense MLP); a multimodal qwen3_5
# checkpoint runs as its text model
TP_HYBRID_TYPES = ("qwen3_5", "qwen3_5_text")
# speculative methods under TP: host n-grams, and a draft model run unsharded beside rank 0's target shard
TP_SPEC_METHODS = ("ngram", "draft_model")


def tensor_parallel_error(tp: int, hf_config: Any, device: torch.device, speculative: Any,
                          quantized_weights: str) -> Optional[str]:
    """Why this configuration cannot run with tensor parallelism `tp` (None: it can)."""
    flag = f"--tensor-parallel-size {tp}"
    if tp < 1:
        return f"--tensor-parallel-size must be >= 1, got {tp}"
    if tp == 1:
        return None
    kind = getattr(hf_config, "model_type", None)
    if kind not in TP_MODEL_TYPES + TP_HYBRID_TYPES:
        what = {"qwen3_moe": "MoE", "qwen3_next": "hybrid + MoE", "qwen3_5_moe": "hybrid + MoE",
                "qwen3_5_moe_text": "hybrid + MoE"}.get(kind, "this architecture")
        return (f"{flag}: tensor parallelism is built for dense {' / '.join(TP_MODEL_TYPES + TP_HYBRID_TYPES)} "
                f"models, not {kind!r} ({what} is not supported under tensor parallelism)")
    if kind in TP_HYBRID_TYPES:
        hf_config = getattr(hf_config, "text_config", None) or hf_config
        if int(getattr(hf_config, "num_experts", 0) or 0) > 0:
            return f"{flag}: {kind!r} with sparse MoE layers (hybrid + MoE) is not supported under tensor parallelism"
        nk, nv = int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads)
        if nk % tp:
            return f"{flag}: the model's {nk} Gated DeltaNet key heads do not divide by {tp}"
        if nv % tp:
            return f"{flag}: the model's {nv} Gated DeltaNet value heads do not divide by {tp}"
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inter = int(hf_config.intermediate_size)
    if heads % tp:
        return f"{flag}: the model's {heads} attention heads do not divide by {tp}"
    if kv % tp and tp % kv:
        return f"{flag}: the model's {kv} KV heads neither divide by {tp} nor divide it (needed to shard or replicate)"
    if inter % tp:
        return f"{flag}: the model's intermediate size {inter} does not divide by {tp}"
    if speculative is not None and speculative.method not in TP_SPEC_METHODS:
        # MTP and DFlash draft from the target's own hidden states through its (vocabulary-sharded) embedding / head
        return (f"{flag}: speculative method {speculative.method!r} is not supported under tensor parallelism "
                f"(use {' or '.join(TP_SPEC_METHODS)})")
    if quantized_weights != "dequantized":
        return (f"{flag}: weights kept quantized are not supported under tensor parallelism; drop --quantization to "
                "dequantize them at load")
    if device.type == "cuda":
        first = device.index or 0
        count = torch.cuda.device_count()
        if first + tp > count:
            return f"{flag}: needs {tp} CUDA devices from cuda:{first}, but {count} are visible"
    elif device.type != "cpu":
        return f"{flag}: tensor parallelism runs on CUDA (NCCL) or the CPU (gloo), not {device.type}"
    return None
