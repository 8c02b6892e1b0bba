"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) and checking it against the model.

A PEFT adapter holds, per adapted projection, lora_A [r, in] and lora_B [out, r]; the projection becomes
W + scaling * B A, scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). voltllm merges q / k / v into one qkv
projection and gate / up into one gate_up, so each PEFT module maps onto shards (slices of output rows) of one of
our Linears (`peft_modules`, `projection_shapes`): B's rows go where the module's weight rows went when the
checkpoint was loaded, A is the module's (the same A for each shard of one module). The hybrids (qwen3_5 / qwen3_5_moe /
qwen3_next / qwen4_exp) adapt their gated attention (q_proj: [q_h | gate_h] per head, as qkv_proj's shard 0 holds it),
their Gated DeltaNet projections (in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, Qwen3-Next's head-grouped
in_proj_qkvz / in_proj_ba, out_proj: gdn.in_proj_pieces) and their dense MLPs. A sparse MoE layer's routed experts take
adapters in PEFT's per-expert form (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`) or its fused form over
transformers 5's 3D expert tensors (target_parameters `mlp.experts.gate_up_proj` / `down_proj`, rewritten per expert
by _per_expert_form): they are not Linears, so
they are kept apart (`LoRAAdapter.experts`, `expert_shapes`; lora/experts.py applies them); a shared expert's
projections are Linears like a dense MLP's (`mlp.shared_expert.gate_up_proj` / `down_proj`). What this version does not
build is refused by name: embedding / LM-head LoRA (lora_embedding_*, modules_to_save, target_modules naming
embed_tokens / lm_head), the
router (mlp.gate) and the shared expert's gate, DoRA, LoRA biases, per-module ranks / alphas, ranks above
--max-lora-rank; on Qwen4-Exp its hyper-connection (attn_hyper_connection / mlp_hyper_connection /
hyper_connection_mixer), PLE (ple.key_proj / ple.value_proj) and QSA indexer (index_qk_proj) linears.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from voltllm.lora.request import LoRARequest

# Qwen4-Exp (models/qwen4_exp.py): Qwen3.5's gated attention and Gated DeltaNet, a sparse MoE with a shared expert in
# every layer; its hyper-connection, PLE, QSA indexer and router linears take no adapters (refused by name)
QWEN4_EXP_ARCHITECTURES = ("qwen4_exp", "qwen4_exp_text")
HYBRID_ARCHITECTURES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next") + \
    QWEN4_EXP_ARCHITECTURES
# the architectures whose projections take adapters (models/llama.py, models/qwen3_next.py)
# (Qwen3-VL: its text model, a qwen3 / qwen3_moe; Qwen2-VL / Qwen2.5-VL: a qwen2; adapters on the vision tower are
# refused by name)
LORA_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen2_vl",
                      "qwen2_5_vl") + HYBRID_ARCHITECTURES

# PEFT module (the projection's name in Hugging Face's model) -> (our Linear inside the decoder layer, its shard)
PEFT_PROJECTIONS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
                    "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
                    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
                    "down_proj": ("mlp.down_proj", 0)}
_BUILT = ("q_proj, k_proj, v_proj, o_proj, the dense MLPs', the MoE experts' (per expert) and shared experts' "
          "gate_proj, up_proj, down_proj and the hybrids' Gated DeltaNet in_proj_* / out_proj")
# Qwen4-Exp's linears that take no adapters: (a PEFT module's name part, what it is)
_QWEN4_EXP_REFUSED = (("attn_hyper_connection", "hyper-connection"), ("mlp_hyper_connection", "hyper-connection"),
                      ("hyper_connection_mixer", "hyper-connection"), ("ple.key_proj", "PLE"),
                      ("ple.value_proj", "PLE"), ("index_qk_proj", "QSA indexer"))
# a routed expert's PEFT module inside a decoder layer's MLP: mlp.experts.{e}.{gate,up,down}_proj
_EXPERT_MODULE = re.compile(r"experts\.(?P<expert>\d+)\.(?P<kind>gate|up|down)_proj")
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[A-Za-z0-9_]+)?\.weight")
_LAYER_MODULE = re.compile(r"layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp|linear_attn)\.(?P<proj>[A-Za-z0-9_.]+)")


class LoRAAdapterError(ValueError):
    """An adapter this engine cannot serve; the message names the adapter and what."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """No adapter at the path (no such directory, or no adapter_config.json in it): vLLM's "not found" case, which
    /v1/load_lora_adapter answers 404 where an adapter that fails its checks is a 400."""


@dataclass(frozen=True)
class ProjectionShape:
    in_features: int
    shard_sizes: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """Part of a PEFT module on one of our Linears: its B rows `rows` (in order; None: all) are `shard` of `linear`."""
    linear: str
    shard: int
    rows: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class ExpertShape:
    """A sparse MoE layer's routed experts, whole: E experts of hidden -> inter (gate, up) -> hidden (down)."""
    num_experts: int
    hidden: int
    inter: int


# per (expert, "gate" | "up" | "down"): (A [r, in], B^T scaled [r, out]), as `LoRAAdapter.weights`' pairs
ExpertPairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LoRAAdapter:
    """A checked adapter, ready to copy into a slot: per Linear of ours, per shard, (A [r, in], B^T scaled [r, n])
    in the LoRA dtype (B^T so that a slot's copy is one contiguous block; the scaling is folded into it); per sparse
    MoE layer ("layers.{i}.mlp.experts"), its routed experts' pairs. has_experts: whether the whole adapter (before a
    pipeline stage or a rank took its part) adapts routed experts: its steps run eagerly on every rank alike."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    experts: dict[str, ExpertPairs] = field(default_factory=dict)
    has_experts: bool = False

    def pin(self) -> "LoRAAdapter":
        """Page-locked copies (CUDA): the slot copies then run without the host waiting for the GPU."""
        self.weights = {name: {s: (a.pin_memory(), bt.pin_memory()) for s, (a, bt) in shards.items()}
                        for name, shards in self.weights.items()}
        self.experts = {name: {k: (a.pin_memory(), bt.pin_memory()) for k, (a, bt) in pairs.items()}
                        for name, pairs in self.experts.items()}
        return self


def lora_architecture_error(hf_config: Any) -> Optional[str]:
    arch = getattr(hf_config, "model_type", None)
    if arch in LORA_ARCHITECTURES:
        return None
    return (f"LoRA adapters are built for the {', '.join(LORA_ARCHITECTURES)} architectures (their attention, "
            f"Gated DeltaNet and dense-MLP projections), not {arch!r}")


def _is_hybrid(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) in HYBRID_ARCHITECTURES


def projection_shapes(hf_config: Any) -> dict[str, ProjectionShape]:
    """Our Linears that take adapters ("layers.{i}.self_attn.qkv_proj", ...) and their whole shapes (what an adapter
    is checked against; under tensor parallelism each rank then cuts it, lora/sharding.py). A sparse MoE layer's
    routed experts are not Linears (`expert_shapes`); its shared expert's projections are."""
    return _layout(hf_config)[0]


def expert_shapes(hf_config: Any) -> dict[str, ExpertShape]:
    """The sparse MoE layers' routed experts ("layers.{i}.mlp.experts") and their whole shapes."""
    return _layout(hf_config)[2]


def peft_modules(hf_config: Any) -> dict[str, tuple[Piece, ...]]:
    """PEFT module inside the decoder stack ("layers.{i}.self_attn.q_proj", "layers.{i}.linear_attn.in_proj_qkv",
    ...) -> where its B rows go in our Linears."""
    return _layout(hf_config)[1]


def _layout(hf_config: Any) -> tuple[dict[str, ProjectionShape], dict[str, tuple[Piece, ...]],
                                     dict[str, ExpertShape]]:
    from voltllm.model.models.llama import is_moe_layer

    hybrid = _is_hybrid(hf_config)
    cfg = getattr(hf_config, "text_config", None) or hf_config  # (a vision-language checkpoint's text model)
    if hybrid:
        from voltllm.model.models.qwen3_next import (hybrid_is_moe_layer, hybrid_layer_types, hybrid_variant,
                                                     text_config)
        cfg = text_config(hf_config)
        kinds = hybrid_layer_types(cfg)
    qwen4_exp = getattr(hf_config, "model_type", None) in QWEN4_EXP_ARCHITECTURES
    if qwen4_exp:  # (its own layer kinds: "indexed_attention" layers are gated attention; a sparse MoE in each layer)
        from voltllm.model.models.qwen4_exp import layer_kinds

        kinds = layer_kinds(cfg)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    hidden, q, kv = cfg.hidden_size, heads * head_dim, kv_heads * head_dim
    shapes: dict[str, ProjectionShape] = {}
    modules: dict[str, tuple[Piece, ...]] = {}
    experts: dict[str, ExpertShape] = {}

    def whole(layer: int, block: str, peft: str, linear: str, shard: int) -> None:
        modules[f"layers.{layer}.{block}.{peft}"] = (Piece(f"layers.{layer}.{linear}", shard),)

    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        if hybrid and kinds[i] == "linear_attention":
            from voltllm.model.layers.gdn import in_proj_pieces

            nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            shapes[p + "linear_attn.in_proj"] = ProjectionShape(hidden, (nk * dk, nk * dk, nv * dv, nv * dv, nv, nv))
            shapes[p + "linear_attn.out_proj"] = ProjectionShape(nv * dv, (hidden,))
            names = (("in_proj_qkvz", "in_proj_ba") if hybrid_variant(cfg) == "qwen3_next" else
                     ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
            for name in names:
                modules[p + "linear_attn." + name] = tuple(Piece(p + "linear_attn.in_proj", shard, rows) for
                                                           shard, rows in in_proj_pieces(name, nk, nv, dk, dv))
            whole(i, "linear_attn", "out_proj", "linear_attn.out_proj", 0)
        else:
            # a hybrid's gated attention: q_proj's rows are [q_h | gate_h] per head, qkv_proj's shard 0 as loaded
            shapes[p + "self_attn.qkv_proj"] = ProjectionShape(hidden, ((2 if hybrid else 1) * q, kv, kv))
            shapes[p + "self_attn.o_proj"] = ProjectionShape(q, (hidden,))
            for peft in ("q_proj", "k_proj", "v_proj", "o_proj"):
                whole(i, "self_attn", peft, *PEFT_PROJECTIONS[peft])
        if not (qwen4_exp or (hybrid_is_moe_layer(cfg, i) if hybrid else is_moe_layer(cfg, i))):
            inter = cfg.intermediate_size
            shapes[p + "mlp.gate_up_proj"] = ProjectionShape(hidden, (inter, inter))
            shapes[p + "mlp.down_proj"] = ProjectionShape(inter, (hidden,))
            for peft in ("gate_proj", "up_proj", "down_proj"):
                whole(i, "mlp", peft, *PEFT_PROJECTIONS[peft])
        else:
            experts[p + "mlp.experts"] = ExpertShape(cfg.num_experts, hidden, cfg.moe_intermediate_size)
            shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
            if shared:  # (Qwen3-Next / Qwen3.5-MoE / Qwen4-Exp: a dense SwiGLU MLP beside the routed experts)
                shapes[p + "mlp.shared_expert.gate_up_proj"] = ProjectionShape(hidden, (shared, shared))
                shapes[p + "mlp.shared_expert.down_proj"] = ProjectionShape(shared, (hidden,))
                for peft in ("gate_proj", "up_proj", "down_proj"):
                    linear, shard = PEFT_PROJECTIONS[peft]
                    whole(i, "mlp", "shared_expert." + peft, "mlp.shared_expert." + linear.split(".")[1], shard)
    return shapes, modules, experts


def lora_scaling(rank: int, alpha: float, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def read_adapter(req: LoRARequest, hf_config: Any, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at req.lora_path, checked against the model (hf_config) and --max-lora-rank; LoRAAdapterError
    naming what is not built or does not fit."""
    where = f"LoRA adapter {req.lora_name!r} ({req.lora_path})"
    if not os.path.isdir(req.lora_path):
        raise LoRAAdapterNotFoundError(f"{where}: no such directory")
    config_path = os.path.join(req.lora_path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise LoRAAdapterNotFoundError(f"{where}: no adapter_config.json (a PEFT LoRA adapter directory is "
                                       "expected)")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{where}: adapter_config.json is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{where}: adapter_config.json must hold a JSON object")
    rank, alpha = _check_config(cfg, where, max_rank)
    scaling = lora_scaling(rank, alpha, bool(cfg.get("use_rslora")))
    tensors = _read_tensors(req.lora_path, where)
    shapes, modules, experts = _layout(hf_config)
    tensors = _per_expert_form(tensors, rank, experts, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = _module_of(key, where, hf_config, modules, experts)
        pairs.setdefault(module, {})[kind] = tensor
    adapter = LoRAAdapter(req.lora_name, req.lora_path, rank, scaling)
    for module, pair in sorted(pairs.items()):
        missing = {"lora_A", "lora_B"} - set(pair)
        if missing:
            raise LoRAAdapterError(f"{where}: {module} has no {' / '.join(sorted(missing))} weight")
        a, b = pair["lora_A"], pair["lora_B"]
        if module not in modules:  # a routed expert's gate / up / down
            _add_expert_pair(adapter, module, a, b, experts, where, dtype)
            continue
        pieces = modules[module]
        n_in = shapes[pieces[0].linear].in_features
        n = sum(shapes[pc.linear].shard_sizes[pc.shard] if pc.rows is None else len(pc.rows) for pc in pieces)
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n, rank):
            raise LoRAAdapterError(
                f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model needs "
                f"lora_A ({rank}, {n_in}) and lora_B ({n}, {rank}) (rank r={rank})")
        a = a.to(dtype).contiguous()
        bt = (b.float() * scaling).t()
        for pc in pieces:  # (the module's A on each of its shards; B's rows where the weight's rows went)
            part = bt if pc.rows is None else bt[:, pc.rows]
            adapter.weights.setdefault(pc.linear, {})[pc.shard] = (a, part.contiguous().to(dtype))
    if not adapter.weights and not adapter.experts:
        raise LoRAAdapterError(f"{where}: no lora_A / lora_B weights in it")
    adapter.has_experts = bool(adapter.experts)
    return adapter


# PEFT's target_parameters on transformers' fused experts: "...layers.{i}.mlp.experts[.base_layer...].lora_A.weight"
# (a second targeted parameter of the same module nests the first one's wrapper under base_layer)
_FUSED_EXPERTS_KEY = re.compile(r"(?P<experts>.*layers\.(?P<layer>\d+)\.mlp\.experts)(?P<nest>(?:\.base_layer)*)"
                                r"\.(?P<kind>lora_A|lora_B)(?:\.[A-Za-z0-9_]+)?\.weight")


def _per_expert_form(tensors: dict[str, torch.Tensor], rank: int, experts: dict[str, ExpertShape],
                     where: str) -> dict[str, torch.Tensor]:
    """The adapter with PEFT's fused-experts pairs (LoraConfig target_parameters "mlp.experts.gate_up_proj" /
    "mlp.experts.down_proj" on transformers 5's 3D expert tensors: gate_up_proj [E, 2I, H], down_proj [E, H, I])
    rewritten in the per-expert form ("mlp.experts.{e}.gate_proj" / "up_proj" / "down_proj"), the rest unchanged.

    PEFT's ParamWrapper holds one pair over all E experts: lora_A [r E, in] (expert e's A: rows e r .. e r + r - 1)
    and lora_B [out, r E] (expert e's B: columns k E + e, k < r), its update W_e + scaling B_e A_e, as for a Linear.
    gate_up's B rows are gate's then up's (transformers chunks the product in two), so gate and up share expert e's A.
    Which parameter a pair adapts is read from its shapes ((in, out): (H, 2I) gate_up, (I, H) down), which holds
    whatever order PEFT nested the wrappers in. Keys of layers without a sparse MoE are left for _module_of to
    refuse."""
    fused: dict[tuple[str, str], dict[str, tuple[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = _FUSED_EXPERTS_KEY.fullmatch(key)
        if m is None or f"layers.{m.group('layer')}.mlp.experts" not in experts:
            out[key] = t
            continue
        fused.setdefault((m.group("experts"), m.group("nest")), {})[m.group("kind")] = (key, t)
    for (prefix, nest), pair in sorted(fused.items()):
        module = prefix + nest
        missing = {"lora_A", "lora_B"} - set(pair)
        if missing:
            raise LoRAAdapterError(f"{where}: {module} (fused experts) has no {' / '.join(sorted(missing))} weight")
        (ka, a), (_, b) = pair["lora_A"], pair["lora_B"]
        shape = experts["layers." + prefix.rpartition("layers.")[2]]
        e_count, h, inter = shape.num_experts, shape.hidden, shape.inter
        forms = {(h, 2 * inter): "gate_up", (inter, h): "down"}
        kind = forms.get((a.shape[-1], b.shape[0])) if a.dim() == 2 and b.dim() == 2 else None
        if kind is None or tuple(a.shape) != (rank * e_count, a.shape[-1]) or b.shape[1] != rank * e_count:
            raise LoRAAdapterError(
                f"{where}: {module} (fused experts) has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this "
                f"model's {e_count} experts need lora_A ({rank * e_count}, {h}) and lora_B ({2 * inter}, "
                f"{rank * e_count}) for gate_up_proj, or lora_A ({rank * e_count}, {inter}) and lora_B ({h}, "
                f"{rank * e_count}) for down_proj (rank r={rank})")
        a3 = a.view(e_count, rank, a.shape[-1])
        b3 = b.view(b.shape[0], rank, e_count)
        parts = ({"gate": slice(0, inter), "up": slice(inter, 2 * inter)} if kind == "gate_up"
                 else {"down": slice(None)})
        for e in range(e_count):
            for proj, rows in parts.items():
                name = f"{prefix}.{e}.{proj}_proj"
                if any(k.startswith(name + ".lora_") for k in tensors):
                    raise LoRAAdapterError(f"{where}: {ka}: expert {e}'s {proj}_proj is adapted twice (the fused "
                                           f"form and {name})")
                if f"{name}.lora_A.weight" in out:
                    raise LoRAAdapterError(f"{where}: {ka} and another fused pair both adapt {proj}_proj")
                out[f"{name}.lora_A.weight"] = a3[e]
                out[f"{name}.lora_B.weight"] = b3[rows, :, e]
    return out


def _add_expert_pair(adapter: LoRAAdapter, module: str, a: torch.Tensor, b: torch.Tensor,
                     experts: dict[str, ExpertShape], where: str, dtype: torch.dtype) -> None:
    """A routed expert's (A, B) into adapter.experts["layers.{i}.mlp.experts"][(e, kind)], checked like a Linear's."""
    layer, _, rest = module.partition(".mlp.")
    m = _EXPERT_MODULE.fullmatch(rest)
    shape = experts[layer + ".mlp.experts"]
    n_in, n_out = ((shape.inter, shape.hidden) if m.group("kind") == "down" else (shape.hidden, shape.inter))
    rank = adapter.rank
    if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
        raise LoRAAdapterError(
            f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this model needs "
            f"lora_A ({rank}, {n_in}) and lora_B ({n_out}, {rank}) (rank r={rank})")
    pair = (a.to(dtype).contiguous(), (b.float() * adapter.scaling).t().contiguous().to(dtype))
    adapter.experts.setdefault(layer + ".mlp.experts", {})[(int(m.group("expert")), m.group("kind"))] = pair


def _check_config(cfg: dict, where: str, max_rank: int) -> tuple[int, float]:
    peft_type = cfg.get("peft_type")
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {peft_type!r}: only LoRA adapters are built")
    for key in ("r", "lora_alpha"):
        if key not in cfg:
            raise LoRAAdapterError(f"{where}: adapter_config.json has no {key!r}")
    rank, alpha = cfg["r"], cfg["lora_alpha"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"{where}: LoRA rank {rank} is greater than --max-lora-rank {max_rank}; raise "
                               "--max-lora-rank")
    refused = {
        "use_dora": "DoRA (use_dora) is not built",
        "modules_to_save": "modules_to_save (fully trained layers, such as an LM head or embedding) is not built",
        "rank_pattern": "per-module ranks (rank_pattern) are not built",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not built",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-layout weights) is not built",
        "lora_bias": "LoRA biases (lora_bias) are not built",
        "layer_replication": "layer_replication is not built",
        "use_qalora": "QALoRA (use_qalora) is not built",
    }
    for key, why in refused.items():
        if cfg.get(key):
            raise LoRAAdapterError(f"{where}: {why}")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"{where}: bias {cfg['bias']!r}: adapters that train biases are not built (bias "
                               "'none' only)")
    targets = cfg.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets if isinstance(targets, list) else []
    for name in names:
        if isinstance(name, str) and name.split(".")[-1] in ("embed_tokens", "lm_head", "wte", "word_embeddings"):
            raise LoRAAdapterError(f"{where}: target_modules names {name!r}: LoRA on the embedding or the LM head is "
                                   f"not built (built: {_BUILT})")
    return rank, float(alpha)


def _read_tensors(path: str, where: str) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(file, device="cpu")
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's problem, said with its cause
            raise LoRAAdapterError(f"{where}: {name} is not readable: {e}") from None
    raise LoRAAdapterError(f"{where}: no {' or '.join(_WEIGHT_FILES)}")


def _module_of(key: str, where: str, hf_config: Any, modules: dict[str, tuple[Piece, ...]],
               experts: dict[str, ExpertShape]) -> tuple[str, str]:
    """(PEFT module inside the decoder stack, "lora_A" | "lora_B") for a PEFT weight name, or LoRAAdapterError naming
    it."""
    if "lora_embedding" in key or re.search(r"(^|\.)(embed_tokens|lm_head)(\.|$)", key):
        raise LoRAAdapterError(f"{where}: {key}: LoRA on the embedding or the LM head (or modules_to_save) is not "
                               f"built (built: {_BUILT})")
    if "lora_magnitude_vector" in key:
        raise LoRAAdapterError(f"{where}: {key}: DoRA is not built")
    m = _KEY.fullmatch(key)
    if m is None:
        what = "a LoRA bias" if re.search(r"lora_B(\.[A-Za-z0-9_]+)?\.bias$", key) else "not a lora_A / lora_B weight"
        raise LoRAAdapterError(f"{where}: {key}: {what}; not built (built: lora_A / lora_B of {_BUILT})")
    module = m.group("module")
    for prefix in ("base_model.model.", "model.", "language_model."):  # (a multimodal Qwen3.5's text model)
        module = module.removeprefix(prefix)
    if getattr(hf_config, "model_type", None) in QWEN4_EXP_ARCHITECTURES:
        for part, what in _QWEN4_EXP_REFUSED:
            if re.search(rf"(^|\.){re.escape(part)}(\.|$)", module):
                raise LoRAAdapterError(f"{where}: {key}: LoRA on Qwen4-Exp's {what} linears ({part}) is not built "
                                       f"(built: {_BUILT})")
    lm = _LAYER_MODULE.fullmatch(module)
    if lm is None:
        raise LoRAAdapterError(f"{where}: {key}: not a projection this version adapts (built: {_BUILT})")
    layer, block, proj = int(lm.group("layer")), lm.group("block"), lm.group("proj")
    num_layers = (getattr(hf_config, "text_config", None) or hf_config).num_hidden_layers
    if layer >= num_layers:
        raise LoRAAdapterError(f"{where}: {key}: layer {layer} is past the model's {num_layers} layers")
    if module in modules:
        return module, m.group("kind")
    sparse = f"layers.{layer}.mlp.experts" in experts
    if block == "mlp" and sparse:
        e = _EXPERT_MODULE.fullmatch(proj)
        if e is not None:
            num = experts[f"layers.{layer}.mlp.experts"].num_experts
            if int(e.group("expert")) >= num:
                raise LoRAAdapterError(f"{where}: {key}: expert {e.group('expert')} is past layer {layer}'s {num} "
                                       "experts")
            return module, m.group("kind")
        if proj.split(".")[0] == "experts":
            raise LoRAAdapterError(f"{where}: {key}: not a routed expert's module (built: mlp.experts.{{e}}.gate_proj "
                                   "/ up_proj / down_proj, and PEFT target_parameters mlp.experts.gate_up_proj / "
                                   "down_proj)")
        if proj in ("gate_proj", "up_proj", "down_proj"):
            raise LoRAAdapterError(f"{where}: {key}: layer {layer}'s MLP is a sparse MoE (no dense {proj}; its "
                                   f"experts take mlp.experts.{{e}}.{proj})")
        if not proj.startswith("shared_expert."):  # (the router, the shared expert's gate)
            role = "the router; " if proj == "gate" else "its output gate; " if proj == "shared_expert_gate" else ""
            raise LoRAAdapterError(f"{where}: {key}: LoRA on the MoE's {proj} is not built ({role}built: {_BUILT})")
        raise LoRAAdapterError(f"{where}: {key}: layer {layer}'s sparse MoE has no {proj} (no shared expert, or "
                               f"not one of its projections; built: {_BUILT})")
    if any(name.startswith(f"layers.{layer}.{block}.") for name in modules):
        raise LoRAAdapterError(f"{where}: {key}: LoRA on {block}.{proj} is not built (built: {_BUILT})")
    kind = "Gated DeltaNet (linear_attn)" if any(name.startswith(f"layers.{layer}.linear_attn.") for name in modules) \
        else "full attention (self_attn)"
    raise LoRAAdapterError(f"{where}: {key}: layer {layer} has no {block} module (it is a {kind} layer)")
