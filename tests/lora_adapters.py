"""Tiny random PEFT LoRA adapters written by hand (adapter_config.json + adapter_model.safetensors, PEFT's names), and
the transformers reference with an adapter merged into the base weights (W + scaling * B A)."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the hybrids' Gated DeltaNet projections (Qwen3.5's names, then Qwen3-Next's)
GDN_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
HYBRID_TARGETS = ALL_TARGETS + GDN_TARGETS
_QWEN4_EXP = ("qwen4_exp", "qwen4_exp_text")  # (Qwen3.5's GDN and gated attention; a sparse MoE in every layer)
_HYBRIDS = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next") + _QWEN4_EXP


def _layer_shapes(cfg: Any, layer: int) -> dict[str, tuple[str, int, int]]:
    """PEFT module -> (its block, in, out) in decoder layer `layer` (the llama family or a hybrid)."""
    hybrid = cfg.model_type in _HYBRIDS
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    h, i = cfg.hidden_size, getattr(cfg, "intermediate_size", None)  # (none on Qwen4-Exp: MoE only)
    out: dict[str, tuple[str, int, int]] = {}
    if hybrid and cfg.layer_types[layer] == "linear_attention":
        nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        if cfg.model_type == "qwen3_next":
            out.update(in_proj_qkvz=("linear_attn", h, 2 * nk * dk + 2 * nv * dv),
                       in_proj_ba=("linear_attn", h, 2 * nv))
        else:
            out.update(in_proj_qkv=("linear_attn", h, 2 * nk * dk + nv * dv), in_proj_z=("linear_attn", h, nv * dv),
                       in_proj_b=("linear_attn", h, nv), in_proj_a=("linear_attn", h, nv))
        out["out_proj"] = ("linear_attn", nv * dv, h)
    else:  # a hybrid's q_proj gives [q | gate] per head
        out.update(q_proj=("self_attn", h, (2 if hybrid else 1) * q), k_proj=("self_attn", h, kv),
                   v_proj=("self_attn", h, kv), o_proj=("self_attn", q, h))
    if _sparse(cfg, layer):  # routed experts (targets "experts": every expert's), a shared expert's projections
        ei, si = cfg.moe_intermediate_size, getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        for e in range(cfg.num_experts):
            out.update({f"experts.{e}.gate_proj": ("mlp", h, ei), f"experts.{e}.up_proj": ("mlp", h, ei),
                        f"experts.{e}.down_proj": ("mlp", ei, h)})
        if si:
            out.update({"shared_expert.gate_proj": ("mlp", h, si), "shared_expert.up_proj": ("mlp", h, si),
                        "shared_expert.down_proj": ("mlp", si, h)})
    elif not hybrid or cfg.model_type == "qwen3_5":
        out.update(gate_proj=("mlp", h, i), up_proj=("mlp", h, i), down_proj=("mlp", i, h))
    return out


def _sparse(cfg: Any, layer: int) -> bool:
    if cfg.model_type in _QWEN4_EXP:
        return True
    if cfg.model_type in _HYBRIDS:
        from voltllm.model.models.qwen3_next import hybrid_is_moe_layer

        return hybrid_is_moe_layer(cfg, layer)
    from voltllm.model.models.llama import is_moe_layer

    return is_moe_layer(cfg, layer)


def _targeted(module: str, targets: Sequence[str]) -> bool:
    """Whether a layer's PEFT module is one of `targets` ("experts": every routed expert's gate / up / down;
    "shared_expert": the shared expert's)."""
    if module.startswith("experts."):
        return "experts" in targets
    if module.startswith("shared_expert."):
        return "shared_expert" in targets
    return module in targets


def make_adapter(path: str, model_path: str, rank: int = 8, alpha: float = 16, seed: int = 1,
                 targets: Sequence[str] = ALL_TARGETS, layers: Optional[Sequence[int]] = None, std: float = 0.1,
                 rslora: bool = False, extra_config: Optional[dict] = None,
                 extra_tensors: Optional[dict] = None) -> str:
    """A random LoRA adapter for the model at model_path (both A and B random, so its effect is large); each layer
    gets those of `targets` it has (a hybrid's attention or Gated DeltaNet modules; a dense MLP's gate_proj / up_proj
    / down_proj; a sparse MoE's routed experts: "experts", its shared expert: "shared_expert")."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    cfg = getattr(cfg, "text_config", None) or cfg  # (a vision-language checkpoint's text model)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (range(cfg.num_hidden_layers) if layers is None else layers):
        shapes = _layer_shapes(cfg, layer)
        for t in shapes:
            if not _targeted(t, targets):
                continue
            block, n_in, n_out = shapes[t]
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


def save_merged(model_path: str, adapter_path: str, out: str) -> str:
    """The checkpoint at model_path with the adapter merged into its weights, saved under `out` (tokenizer files
    copied): what a plain engine serves as the reference of the adapter."""
    import shutil

    merged_model(model_path, adapter_path).save_pretrained(out)
    for name in os.listdir(model_path):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(model_path, name), out)
    return out


def merged_copy(path: str, adapter: str, out: str) -> str:
    """The (single-file) checkpoint at path with the adapter merged into its weights (W + scaling * B A), at out: the
    reference an engine serving the adapter must match."""
    import glob
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    scaling = config["lora_alpha"] / config["r"]
    lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    (file,) = glob.glob(os.path.join(out, "*.safetensors"))
    sd = load_file(file)
    for key, a in lora.items():
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            sd[f"{module}.weight"] = sd[f"{module}.weight"] + scaling * (b.double() @ a.double()).float()
    save_file(sd, file, metadata={"format": "pt"})
    return out


def make_fused_expert_adapter(path: str, model_path: str, rank: int = 4, alpha: float = 8, seed: int = 1,
                              params: Sequence[str] = ("gate_up_proj", "down_proj"), std: float = 0.2) -> str:
    """A random adapter in PEFT's target_parameters form over transformers 5's fused 3D experts (every sparse MoE
    layer): one lora_A [r E, in] / lora_B [out, r E] pair per targeted parameter, named as PEFT nests the wrappers
    (the module's first parameter, gate_up_proj, under base_layer when both are targeted)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    cfg = getattr(cfg, "text_config", None) or cfg
    gen = torch.Generator().manual_seed(seed)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dims = {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        if not _sparse(cfg, layer):
            continue
        for param in params:
            nest = ".base_layer" if param == "gate_up_proj" and len(params) == 2 else ""
            name = f"base_model.model.model.layers.{layer}.mlp.experts{nest}"
            n_in, n_out = dims[param]
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank * e, n_in, generator=gen) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank * e, generator=gen) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "target_modules": [],
              "target_parameters": [f"mlp.experts.{p}" for p in params], "lora_dropout": 0.0, "bias": "none",
              "use_rslora": False, "use_dora": False, "base_model_name_or_path": model_path}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def merged_fused_model(model_path: str, adapter_path: str) -> Any:
    """transformers' model (fp32) with a fused-experts adapter merged the way PEFT's ParamWrapper computes its update:
    delta[e] = scaling * einsum("o r e, e r i -> e o i", B.reshape(out, r, E), A.reshape(E, r, in)), added to the 3D
    expert tensor ([E, out, in]: transformers' layout, which PEFT treats as not transposed)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with open(os.path.join(adapter_path, "adapter_config.json")) as f:
        cfg = json.load(f)
    scaling = cfg["lora_alpha"] / cfg["r"]
    tensors = load_file(os.path.join(adapter_path, "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            layer = int(key.split(".layers.")[1].split(".")[0])
            experts = model.model.layers[layer].mlp.experts
            param = experts.gate_up_proj if b.shape[0] == experts.gate_up_proj.shape[1] else experts.down_proj
            n_exp = param.shape[0]
            delta = torch.einsum("ore,eri->eoi", b.double().reshape(b.shape[0], -1, n_exp),
                                 a.double().reshape(n_exp, -1, a.shape[-1]))
            param += (scaling * delta).float()
    return model
