"""model_type -> model class. A new architecture is a new file plus one line here."""
from __future__ import annotations

from typing import Any

import torch

from voltllm.model.models.llama import LlamaForCausalLM
from voltllm.model.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from voltllm.model.models.qwen4_exp import Qwen4ExpForCausalLM

_MODELS = {
    "llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM, "qwen3_moe": LlamaForCausalLM,
    # Qwen3-VL: its text model is a qwen3 / qwen3_moe (the vision tower runs beside it: worker/image_step.py)
    "qwen3_vl": LlamaForCausalLM, "qwen3_vl_moe": LlamaForCausalLM,
    # Qwen2-VL / Qwen2.5-VL: a qwen2 text model
    "qwen2_vl": LlamaForCausalLM, "qwen2_5_vl": LlamaForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM, "qwen3_5": Qwen3_5ForCausalLM, "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM, "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    # Qwen4-Exp: hyper-connections, PLE, QSA (a qwen4_exp multimodal checkpoint runs as its text model)
    "qwen4_exp": Qwen4ExpForCausalLM, "qwen4_exp_text": Qwen4ExpForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def attention_only(hf_config: Any) -> bool:
    """Whether every layer's per-request state is the paged KV cache (no recurrent state)."""
    return _MODELS.get(getattr(hf_config, "model_type", None)) is LlamaForCausalLM


def supports_quantized_layers(hf_config: Any) -> bool:
    """Whether the architecture takes a quantized LinearMethod (else quantized checkpoints are dequantized at load):
    every one here (llama family and the hybrids)."""
    return getattr(hf_config, "model_type", None) in _MODELS


def build_model(hf_config: Any, dtype: torch.dtype, max_positions: int, linear_method: Any = None,
                tp: Any = None, headless: bool = False, classifier: Any = None, pp: Any = None) -> torch.nn.Module:
    """linear_method: a LinearMethod for the projections (quantized weights kept quantized,
    supports_quantized_layers); None: dense weights. tp: this rank's tensor-parallel group (every architecture here,
    weights dense or kept quantized; what a configuration may split: voltllm.distributed.support). headless: no LM
    head (a pooling model's: it computes no logits; attention-only architectures); classifier: a headless model's
    classification head (voltllm.pooling.classifier.ClassifierConfig). pp: this rank's pipeline stage
    (voltllm.distributed.pipeline.PipelineStage): only its decoder layers are built."""
    arch = getattr(hf_config, "model_type", None)
    if arch not in _MODELS:
        raise ValueError(f"model type {arch!r} is not supported (supported: {', '.join(supported_architectures())})")
    if headless:
        if _MODELS[arch] is not LlamaForCausalLM:
            raise ValueError(f"model type {arch!r}: pooling models are built for attention-only architectures")
        return LlamaForCausalLM(hf_config, dtype, max_positions, linear_method, tp=tp, headless=True,
                                classifier=classifier)
    if tp is not None or pp is not None:
        return _MODELS[arch](hf_config, dtype, max_positions, linear_method, tp=tp, pp=pp)
    if linear_method is not None:
        return _MODELS[arch](hf_config, dtype, max_positions, linear_method)
    return _MODELS[arch](hf_config, dtype, max_positions)
