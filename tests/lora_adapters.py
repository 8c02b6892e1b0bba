"""Tiny random PEFT LoRA adapters written by hand (adapter_config.json + adapter_model.safetensors, PEFT's names), and
the transformers reference with an adapter merged into the base weights (W + scaling * B A)."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """PEFT module -> (in, out) for the llama family."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def make_adapter(path: str, model_path: str, rank: int = 8, alpha: float = 16, seed: int = 1,
                 targets: Sequence[str] = ALL_TARGETS, layers: Optional[Sequence[int]] = None, std: float = 0.1,
                 rslora: bool = False, extra_config: Optional[dict] = None,
                 extra_tensors: Optional[dict] = None) -> str:
    """A random LoRA adapter for the model at model_path (both A and B random, so its effect is large)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    shapes = _shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (range(cfg.num_hidden_layers) if layers is None else layers):
        for t in targets:
            block = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            n_in, n_out = shapes[t]
            name = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * std
    tensors.update(extra_tensors or {})
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": rslora,
              "use_dora": False, "modules_to_save": None, "base_model_name_or_path": model_path,
              "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {}}
    config.update(extra_config or {})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def merged_model(model_path: str, adapter_path: Optional[str]) -> Any:
    """transformers' model (fp32, eval) with the adapter merged into its weights (None: the base model)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if adapter_path is None:
        return model
    with open(os.path.join(adapter_path, "adapter_config.json")) as f:
        cfg = json.load(f)
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = load_file(os.path.join(adapter_path, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            params[f"{module}.weight"] += scaling * (b.double() @ a.double()).float()
    return model
