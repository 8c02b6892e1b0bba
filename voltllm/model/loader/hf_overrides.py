"""`--hf-overrides` (vLLM's flag): change fields of the model's Hugging Face config before the model is built.

The common use is long context through RoPE scaling, e.g. Qwen3 at 128K:
`--hf-overrides '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'`.
transformers 5 keeps RoPE settings in `rope_parameters` (with `rope_theta` inside); `rope_scaling` (the name model
cards and vLLM's docs use) and `rope_parameters` are both merged into it, so the checkpoint's rope_theta stays.
A dict given for a sub-config (`text_config`) is applied inside it, field by field.
"""
from __future__ import annotations

import logging
from typing import Any

from voltllm.model.layers.rotary import rope_parameters

logger = logging.getLogger("voltllm")

_ROPE_KEYS = ("rope_scaling", "rope_parameters")
# keys vLLM (and voltllm) read from the config that transformers' configs do not define: set without a warning
_VLLM_KEYS = ("classifier_from_token", "is_original_qwen3_reranker", "method", "use_pad_token", "is_matryoshka",
              "matryoshka_dimensions")


class HFOverrideError(ValueError):
    """An --hf-overrides value of the wrong shape (the message names the key)."""


def apply_hf_overrides(config: Any, overrides: dict, prefix: str = "") -> Any:
    """Set `overrides` on `config` in place (and return it)."""
    for key, value in overrides.items():
        name = prefix + key
        current = getattr(config, key, None)
        if key in _ROPE_KEYS or key == "rope_theta":
            _merge_rope(config, {"rope_theta": value} if key == "rope_theta" else value, name)
        elif isinstance(value, dict) and hasattr(current, "to_dict"):  # a sub-config: field by field
            apply_hf_overrides(current, value, name + ".")
        else:
            if not hasattr(config, key) and key not in _VLLM_KEYS:
                logger.warning("--hf-overrides: %s is not a field of the model's config; set anyway", name)
            setattr(config, key, value)
    return config


def _merge_rope(config: Any, scaling: Any, name: str) -> None:
    if not isinstance(scaling, dict):
        raise HFOverrideError(f"--hf-overrides: {name} must be an object, got {scaling!r}")
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:  # the older spelling
        scaling["rope_type"] = scaling.pop("type")
    params = rope_parameters(config)
    params.update(scaling)
    config.rope_parameters = params
