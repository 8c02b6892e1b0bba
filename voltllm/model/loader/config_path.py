"""--hf-config-path (vLLM's): the model's Hugging Face config read from another place (a directory, a config .json
file or a Hub repo id, of which only config.json is fetched) instead of the model's own (a GGUF file's metadata,
or the directory's config.json). Typical use: a GGUF file beside its original repo's config, so that the settings
the GGUF metadata lacks (RoPE scaling, generation limits) are the model authors'. The replacement must describe the
same network: the shapes both configs give are compared first, so a wrong config is a readable error, not a weight
shape mismatch halfway through the load."""
from __future__ import annotations

import os
from typing import Any, Optional

# the text model's fields that fix the weights' shapes (compared where both configs give them)
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "num_experts", "num_local_experts", "moe_intermediate_size")


class ConfigPathError(ValueError):
    pass


def read_config(path: str, download_dir: Optional[str] = None, token: Any = None,
                trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    from voltllm.model.loader import hub

    local = os.path.expanduser(path)
    if os.path.isdir(local) or (os.path.isfile(local) and local.endswith(".json")):
        where = local
    elif os.path.exists(local):
        raise ConfigPathError(f"--hf-config-path {path}: give a directory holding config.json, a config .json file "
                              "or a Hub repo id")
    elif hub.looks_like_repo_id(path):
        where = hub.fetch_repo(path, download_dir=download_dir, token=token, patterns=["config.json"])
    else:
        raise ConfigPathError(f"--hf-config-path {path}: no such file or directory (nor a Hub repo id)")
    try:
        return AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigPathError(f"--hf-config-path {path}: not a readable Hugging Face config ({e})") from None


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _quant_method(config: Any) -> Optional[str]:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    return q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", str(q))


def check_same_network(own: Any, given: Any, path: str, model_kind: str) -> None:
    """Refuse a replacement config whose architecture, shapes or quantization differ from the model's own."""
    differences = []
    own_text, given_text = _text(own), _text(given)
    if own_text.model_type != given_text.model_type:
        differences.append(f"model_type {given_text.model_type!r} (the model's: {own_text.model_type!r})")
    for name in SHAPE_FIELDS:
        mine, theirs = getattr(own_text, name, None), getattr(given_text, name, None)
        if mine is not None and theirs is not None and mine != theirs:
            differences.append(f"{name} {theirs} (the model's: {mine})")
    if _quant_method(given) != _quant_method(own):
        what = _quant_method(own) or ("GGUF blocks" if model_kind == "gguf" else "none")
        differences.append(f"quantization {_quant_method(given) or 'none'} (the model's: {what})")
    if differences:
        raise ConfigPathError(f"--hf-config-path {path} describes another network than the model: "
                              + "; ".join(differences))
