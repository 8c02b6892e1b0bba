"""What runs under --tensor-parallel-size N > 1, checked once at configuration time (one-line reasons)."""
from __future__ import annotations

from typing import Any, Optional

import torch

# dense llama-family decoders (models/llama.py without sparse MoE layers)
TP_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def tensor_parallel_error(tp: int, hf_config: Any, device: torch.device, speculative: Any,
                          quantized_weights: str) -> Optional[str]:
    """Why this configuration cannot run with tensor parallelism `tp` (None: it can)."""
    flag = f"--tensor-parallel-size {tp}"
    if tp < 1:
        return f"--tensor-parallel-size must be >= 1, got {tp}"
    if tp == 1:
        return None
    kind = getattr(hf_config, "model_type", None)
    if kind not in TP_MODEL_TYPES:
        what = {"qwen3_moe": "MoE", "qwen3_next": "hybrid + MoE", "qwen3_5": "hybrid", "qwen3_5_text": "hybrid",
                "qwen3_5_moe": "hybrid + MoE", "qwen3_5_moe_text": "hybrid + MoE"}.get(kind, "this architecture")
        return (f"{flag}: tensor parallelism is built for dense {' / '.join(TP_MODEL_TYPES)} models, not {kind!r} "
                f"({what} is not supported under tensor parallelism)")
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inter = int(hf_config.intermediate_size)
    if heads % tp:
        return f"{flag}: the model's {heads} attention heads do not divide by {tp}"
    if kv % tp and tp % kv:
        return f"{flag}: the model's {kv} KV heads neither divide by {tp} nor divide it (needed to shard or replicate)"
    if inter % tp:
        return f"{flag}: the model's intermediate size {inter} does not divide by {tp}"
    if speculative is not None:
        return f"{flag}: speculative decoding (--speculative-config) is not supported under tensor parallelism"
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
