"""Hybrid Qwen decoders: Qwen3-Next (qwen3_next, + MoE), Qwen3.5 (qwen3_5 / qwen3_5_text) and Qwen3.5-MoE
(qwen3_5_moe / qwen3_5_moe_text). One structure:

  layer i: x += mixer(norm(x)); x += mlp(norm(x))       norms are zero-centred RMSNorm: x/rms * (1 + w)
  mixer  = GatedDeltaNet (layer_types[i] == "linear_attention", state in a StateCache slot)
         | gated attention ("full_attention", paged KV): q_proj gives [q | gate] per head, QK-norm (1 + w),
           partial RoPE on the first rotary_dim channels, out = o_proj(attn * sigmoid(gate))
  mlp    = SparseMoE (qwen3_5_moe: every layer; qwen3_next: unless in mlp_only_layers or off the
           decoder_sparse_step) | dense SwiGLU (qwen3_5)

Differences between the variants are only in the checkpoint (GDN projection layout, see layers/gdn.py)
and which MLP a layer has. A multimodal checkpoint (model_type qwen3_5 / qwen3_5_moe with a text_config)
runs as its text model: `model.language_model.*` weights are used, `model.visual.*` and `mtp.*` skipped (the MTP
module, qwen3_next_mtp.py, reads those for MTP speculation).

Quantized checkpoints kept quantized (a QuantizedLinearMethod as `linear_method`): the attention, GDN, dense-MLP,
shared-expert and untied LM-head projections hold planes, the routed experts quant_moe.QuantExperts (docs/hybrid.md).

Tensor parallelism (`tp`, a voltllm.distributed.group.TPGroup; voltllm.distributed.support says what runs): every
rank builds its shard's shapes and the loaders slice the checkpoint's tensors: gated attention by heads (q_proj's
[q | gate] rows per head kept together) and MLP as the llama family, each GDN layer by key / value heads (gdn.py),
sparse MoE layers by every expert's intermediate rows (moe.py), the embedding and LM head by vocabulary rows; the
mixer's o_proj / out_proj partial products are summed in HybridDecoderLayer, the MLP's in llama.MLP / SparseMoE.
Each rank's StateCache holds its own heads (state_spec is local).

DFlash speculation reads the residual stream after chosen layers (`set_aux_hidden`, models/aux_hidden.py, shared with
the llama family).

Runner contract: ctx.extra["state_cache"] and ctx.extra["state_slots"] (see voltllm/model/state_cache.py);
`state_spec` gives the per-slot shapes to build the StateCache, `num_attention_layers` and
`kv_heads_and_dim` the paged KV cache (attention layers only).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from voltllm.attention.kv_spec import kv_scale_target, load_checkpoint_kv_scale
from voltllm.distributed.sharding import HeadShard, intermediate_split, take_cols, take_rows, vocab_rows
from voltllm.model.forward_context import ForwardContext
from voltllm.model.models.aux_hidden import AuxHiddenCapture
from voltllm.model.layer_placement import build_layer
from voltllm.model.models.llama import MLP, is_moe_layer, residual_stream
from voltllm.model.layers.gdn import GatedDeltaNet, HybridBatch
from voltllm.model.layers.linear import Linear, LinearMethod, linear
from voltllm.model.layers.moe import SparseMoE
from voltllm.model.layers.norm import RMSNorm
from voltllm.model.layers.paged_attention import PagedAttention
from voltllm.model.layers.quantized_linear import PackedWeight, dense_tensor
from voltllm.model.layers.rotary import RotaryEmbedding, rope_parameters
from voltllm.model.layers.vocab_parallel import VocabParallelEmbedding

_SKIP_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")


def text_config(cfg: Any) -> Any:
    return getattr(cfg, "text_config", None) or cfg


def hybrid_variant(cfg: Any) -> str:
    """qwen3_next, qwen3_5_moe or qwen3_5 for a (text) config."""
    mt = getattr(text_config(cfg), "model_type", "") or ""
    return "qwen3_next" if mt.startswith("qwen3_next") else "qwen3_5_moe" if mt.startswith("qwen3_5_moe") else "qwen3_5"


def hybrid_layer_types(cfg: Any) -> list[str]:
    """Each decoder layer's mixer: "full_attention" or "linear_attention" (Gated DeltaNet)."""
    cfg = text_config(cfg)
    return list(getattr(cfg, "layer_types", None) or [
        "full_attention" if (i + 1) % getattr(cfg, "full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(cfg.num_hidden_layers)])


def hybrid_is_moe_layer(cfg: Any, i: int) -> bool:
    """Whether decoder layer i's MLP is a sparse MoE (qwen3_5_moe: all; qwen3_next: as qwen3_moe; qwen3_5: none)."""
    variant = hybrid_variant(cfg)
    return variant == "qwen3_5_moe" or variant == "qwen3_next" and is_moe_layer(text_config(cfg), i)


def _rotary_dim(cfg: Any, head_dim: int) -> int:
    factor = rope_parameters(cfg).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return int(head_dim * (factor or 1.0))


class GatedAttention(PagedAttention):
    # the output gate x * sigmoid(gate) as one Triton launch (fused.sigmoid_gate_mul): None = on CUDA tensors;
    # True / False force it (the CPU interpreter tests)
    triton_gate: Optional[bool] = None

    def __init__(self, cfg: Any, kv_index: int, dtype: torch.dtype, rotary: RotaryEmbedding,
                 linear_method: Optional[LinearMethod] = None, tp=None):
        num_heads = cfg.num_attention_heads
        super().__init__(kv_index, getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads, rotary)
        # this rank's heads (all of them without TP), as the llama family's attention; num_heads / num_kv_heads are
        # the local counts. The caller sums o_proj's partial products over the ranks (HybridDecoderLayer).
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.heads = HeadShard.of(num_heads, cfg.num_key_value_heads, rank, size)
        self.num_heads = self.heads.num_heads
        self.num_kv_heads = self.heads.num_kv_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        qg, kv = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [qg, kv, kv], bias=bias, dtype=dtype, method=linear_method)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias, dtype=dtype,
                             method=linear_method)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=1.0)

    def local_qkv_rows(self, tensor: Any, shard: int) -> Any:
        """This rank's heads' rows of qkv_proj shard `shard` (0: q_proj, [q_h | gate_h] per head, 2 D rows; 1 k,
        2 v) given the whole projection's rows (the checkpoint's, or a LoRA B's)."""
        d, h = self.head_dim, self.heads
        return (take_rows(tensor, h.q_start * 2 * d, h.num_heads * 2 * d) if shard == 0 else
                take_rows(tensor, h.kv_start * d, h.num_kv_heads * d))

    def local_o_cols(self, tensor: Any, name: str) -> Any:
        """This rank's heads' input columns of o_proj (row-parallel) given the whole projection's."""
        d, h = self.head_dim, self.heads
        return take_cols(tensor, h.q_start * d, h.num_heads * d, name)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # QK-norm with RoPE (and the K/V store): one launch on CUDA (fused.qk_norm_rope_inplace), as for qwen3
        out = self.rope_and_attend(positions, q.contiguous(), k, v, ctx, self.q_norm, self.k_norm)
        out = out.reshape(t, self.num_heads, self.head_dim)
        if out.is_cuda if self.triton_gate is None else self.triton_gate:  # one launch instead of two
            from voltllm.kernels import fused

            out = fused.sigmoid_gate_mul(out, gate, out=out)
        else:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, idx: int, kind: str, mixer_index: int, moe: bool, gdn_layout: str,
                 norm_topk: bool, dtype: torch.dtype, rotary: RotaryEmbedding,
                 linear_method: Optional[LinearMethod] = None, tp=None):
        super().__init__()
        self.kind = kind
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, mixer_index, dtype, gdn_layout, linear_method, tp)
        elif kind == "full_attention":
            self.self_attn = GatedAttention(cfg, mixer_index, dtype, rotary, linear_method, tp)
        else:
            raise ValueError(f"layer {idx}: unknown layer type {kind!r}")
        if moe:  # kept quantized: the routed experts as quant_moe.QuantExperts, the shared expert's Linears as planes
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
                                 norm_topk, dtype, quantized_experts=linear_method is not None,
                                 linear_method=linear_method, tp=tp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, linear_method, tp)

    def forward(self, positions, x, residual, ctx: ForwardContext, batch: HybridBatch | None):
        if residual is None:
            residual = residual_stream(x)
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.kind == "linear_attention":
            x = self.linear_attn(x, batch)
        else:
            x = self.self_attn(positions, x, ctx)
        if self.tp is not None:  # the ranks' heads' out_proj / o_proj partial products
            x = self.tp.all_reduce_(x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


_ATTN_STACKED = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_MLP_STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}


def layer_expected_keys(layer: HybridDecoderLayer, p: str) -> set[str]:
    """The loaded-weight keys (load_layer_weight's) a decoder layer named `p` ("layers.3.") must get."""
    keys = {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    if layer.kind == "linear_attention":
        keys |= layer.linear_attn.expected_weight_keys(p + "linear_attn.")
    else:
        keys |= {p + f"self_attn.qkv_proj#{s}" for s in range(3)}
        keys |= {p + "self_attn.o_proj#0", p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    if isinstance(layer.mlp, SparseMoE):
        keys |= layer.mlp.expected_weight_keys(p + "mlp.")
    else:
        keys |= {p + "mlp.gate_up_proj#0", p + "mlp.gate_up_proj#1", p + "mlp.down_proj#0"}
    return keys


def load_layer_weight(layer: HybridDecoderLayer, p: str, rest: str, tensor: torch.Tensor, params: dict) -> list[str]:
    """Load checkpoint tensor `rest` (its name inside the layer) into decoder layer `p` ("layers.3."); `params`: the
    model's named parameters (names starting with p). Returns the keys loaded (layer_expected_keys' names)."""
    name = p + rest
    if rest.startswith("linear_attn."):
        if layer.kind != "linear_attention":
            raise ValueError(f"{name}: the layer is {layer.kind}, not linear attention")
        return list(layer.linear_attn.load_hf_weight(rest[len("linear_attn."):], tensor, p + "linear_attn."))
    if rest.startswith("self_attn."):
        if layer.kind != "full_attention":
            raise ValueError(f"{name}: the layer is {layer.kind}, not full attention")
        if (kv_scale := kv_scale_target(name)) is not None:  # fp8 KV cache scales
            for buf in kv_scale[1]:
                load_checkpoint_kv_scale(layer.self_attn, buf, tensor, name)
            return []
        sub, _, kind = rest[len("self_attn."):].rpartition(".")
        attn = layer.self_attn
        if sub in _ATTN_STACKED:
            shard = _ATTN_STACKED[sub]
            if layer.tp is not None:  # this rank's heads' rows: q_proj holds [q_h | gate_h] per head (2 D rows)
                tensor = attn.local_qkv_rows(tensor, shard)
            (attn.qkv_proj.load_weight if kind == "weight" else attn.qkv_proj.load_bias)(tensor, shard)
            return [p + f"self_attn.qkv_proj#{shard}"]
        if sub == "o_proj":
            if layer.tp is not None:  # row-parallel: this rank's heads' input columns; the bias added by rank 0 only
                tensor = (attn.local_o_cols(tensor, name) if kind == "weight" else
                          tensor if layer.tp.rank == 0 else torch.zeros_like(tensor))
            (attn.o_proj.load_weight if kind == "weight" else attn.o_proj.load_bias)(tensor)
            return [p + "self_attn.o_proj#0"]
    elif rest.startswith("mlp."):
        sub = rest[len("mlp."):]
        if isinstance(layer.mlp, SparseMoE):
            return list(layer.mlp.load_hf_weight(sub, tensor, p + "mlp."))
        target = _MLP_STACKED.get(sub.removesuffix(".weight"))
        if target is None:
            raise ValueError(f"unexpected weight {name!r} for a dense MLP layer")
        if layer.tp is not None:  # gate / up by intermediate rows, down by its input columns (as the llama family)
            shape = (tensor.out_features, tensor.in_features) if isinstance(tensor, PackedWeight) else tensor.shape
            start, n = intermediate_split(shape[1] if target[0] == "down_proj" else shape[0], layer.tp)
            tensor = take_cols(tensor, start, n, name) if target[0] == "down_proj" else take_rows(tensor, start, n)
        getattr(layer.mlp, target[0]).load_weight(tensor, target[1])
        return [p + f"mlp.{target[0]}#{target[1]}"]
    Qwen3NextForCausalLM._copy_param(params, name, tensor)
    return [name]


class Qwen3NextForCausalLM(AuxHiddenCapture, nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int,
                 linear_method: Optional[LinearMethod] = None, tp=None, pp=None):
        """linear_method: how the projections (attention, GDN, dense MLPs, shared experts, an untied LM head) hold
        their weights, and with a quantized one the routed experts stay quantized too; None: dense. tp: this rank's
        tensor-parallel group (None: the whole model on one device; dense qwen3_5 only, see the module docstring).
        pp: this rank's pipeline stage (voltllm.distributed.pipeline): `layers` holds its decoder layers alone (local
        indices, and local KV cache / recurrent state indices); the embeddings, final norm and LM head are rank 0's."""
        super().__init__()
        cfg = text_config(config)
        self.config = cfg
        self.dtype = dtype
        self.tp = tp
        self.pp = pp
        self.vocab_size = cfg.vocab_size
        self.variant = hybrid_variant(cfg)
        gdn_layout = "qkvz" if self.variant == "qwen3_next" else "split"
        layer_types = hybrid_layer_types(cfg)
        self.layer_types = layer_types
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max(max_positions, 1), _rotary_dim(cfg, head_dim))
        norm_topk = True if self.variant == "qwen3_5_moe" else bool(getattr(cfg, "norm_topk_prob", True))
        layers, n_attn, n_gdn = [], 0, 0
        for i, kind in enumerate(layer_types):
            if pp is not None and not pp.owns(i):
                continue
            if kind == "linear_attention":
                mixer_index, n_gdn = n_gdn, n_gdn + 1
            else:
                mixer_index, n_attn = n_attn, n_attn + 1
            layers.append(build_layer(HybridDecoderLayer, cfg, i, kind, mixer_index, self._is_moe(cfg, i), gdn_layout,
                                      norm_topk, dtype, rotary, linear_method, tp))
        self.layers = nn.ModuleList(layers)
        self._num_attn, self._num_gdn = n_attn, n_gdn
        if pp is not None and not pp.first:  # a later pipeline stage starts from the previous one's output
            self.embed_tokens = None
        else:
            self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if tp is None else
                                 VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.tie = bool(getattr(config, "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False))
        head_rows = cfg.vocab_size if tp is None else vocab_rows(cfg.vocab_size, tp.size)
        self.lm_head = None if self.tie or self.embed_tokens is None else Linear(
            cfg.hidden_size, head_rows, dtype=dtype, method=linear_method)
        self.rotary = rotary

    def _is_moe(self, cfg: Any, i: int) -> bool:
        return hybrid_is_moe_layer(cfg, i)

    # -- what the runner needs to size and lay out the caches -----------------------------------
    @property
    def num_attention_layers(self) -> int:
        return self._num_attn

    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        a = next(layer.self_attn for layer in self.layers if layer.kind == "full_attention")
        return a.num_kv_heads, a.head_dim

    @property
    def is_hybrid(self) -> bool:
        return True

    @property
    def state_spec(self) -> dict:
        """Per-slot state of every GDN layer: StateCache.for_model(model, num_slots, device) uses it."""
        g = next(layer.linear_attn for layer in self.layers if layer.kind == "linear_attention")
        return {"num_layers": self._num_gdn, "conv_shape": g.conv_state_shape, "conv_dtype": self.dtype,
                "ssm_shape": g.ssm_state_shape, "ssm_dtype": torch.float32}

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        batch = HybridBatch.from_context(ctx, self.state_spec) if self._num_gdn else None
        residual = None
        if self.embed_tokens is None:  # a later pipeline stage
            x, residual = self.pp.receive(input_ids, self.config.hidden_size, self.dtype, self.aux_hidden)
        else:
            x = self.embed_tokens(input_ids)
        images = ctx.extra.get("image_embeds")
        if images is not None:  # the vision tower's rows in place of the image placeholders' (worker/image_step.py)
            x.index_copy_(0, images[0], images[1].to(x.dtype))
        aux = self.aux_hidden is not None  # a DFlash drafter's or EAGLE-3 head's target features (AuxHiddenCapture)
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, ctx, batch)
            if aux:
                self.keep_layer_output(i, x, residual)
        if self.pp is not None:  # on to the next stage; rank 0 gets the last stage's output back
            x, residual = self.pp.pass_on(x, residual, self.aux_hidden)  # (with a drafter's aux rows)
        x, _ = self.norm(x, residual)
        if aux:
            self.keep_final_output(x)
        return x

    # the LM head's Triton GEMM choices (as LlamaForCausalLM's), set by voltllm.worker.skinny_tuning
    logits_skinny = None
    logits_batch: Optional[dict] = None

    @property
    def logits_weight(self) -> Optional[torch.Tensor]:
        """The dense LM-head weight (None when the head is quantized)."""
        if self.tie:
            return None if self.embed_tokens is None else self.embed_tokens.weight
        return self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.logits_weight
        if w is None:  # a head held by a quantized LinearMethod
            logits = self.lm_head(hidden)
        else:  # the model's dtype, as LlamaForCausalLM.compute_logits
            logits = linear(hidden, w, skinny=self.logits_skinny, batch=self.logits_batch)
        if self.tp is None:
            return logits
        # every rank's vocabulary rows side by side (every rank calls this: the gather is a collective)
        logits = self.tp.all_gather_last(logits)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size].contiguous()

    # -- weights ---------------------------------------------------------------------------------
    def _expected_keys(self) -> set[str]:
        keys = {"embed_tokens.weight", "norm.weight"} | (set() if self.tie else {"lm_head#0"})
        if self.embed_tokens is None:  # a later pipeline stage: its layers and the (unused) final norm
            keys = {"norm.weight"}
        for i, layer in enumerate(self.layers):
            keys |= layer_expected_keys(layer, f"layers.{i}.")
        return keys

    def tp_part(self, module_name: str, kind: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a projection's whole weight (the checkpoint loader's cuts: gated attention by heads,
        Gated DeltaNet by key / value heads, dense MLPs by intermediate rows). LoRA cuts its adapters with it
        (lora/sharding.py: B's rows of the column-parallel shards, A's columns of o_proj / out_proj / down_proj)."""
        if self.tp is None:
            return tensor
        parts = module_name.split(".")
        if "layers" not in parts or kind != "weight":
            raise ValueError(f"{module_name} ({kind}): no tensor-parallel split is defined for it")
        layer = self.layers[int(parts[parts.index("layers") + 1])]
        leaf = parts[-1]
        if "shared_expert" in parts and isinstance(layer.mlp, SparseMoE):  # (the layer's own cut)
            return layer.mlp.shared_tp_part(leaf, tensor, module_name)
        if leaf == "qkv_proj":
            return layer.self_attn.local_qkv_rows(tensor, shard)
        if leaf == "o_proj":
            return layer.self_attn.local_o_cols(tensor, module_name)
        if leaf == "in_proj":
            return layer.linear_attn.local_in_rows(tensor, shard)
        if leaf == "out_proj":
            return layer.linear_attn.local_out_cols(tensor, module_name)
        if leaf in ("gate_up_proj", "down_proj") and not isinstance(layer.mlp, SparseMoE):
            start, n = intermediate_split(self.config.intermediate_size, self.tp)
            return take_rows(tensor, start, n) if leaf == "gate_up_proj" else take_cols(tensor, start, n, module_name)
        raise ValueError(f"{module_name}: no tensor-parallel split is defined for it")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        lm_head_seen = False
        for name, tensor in weights:
            if name.startswith(_SKIP_PREFIXES) or "rotary_emb" in name:
                continue
            if name.startswith("model.language_model."):
                name = name[len("model.language_model."):]
            elif name.startswith("language_model."):
                name = name[len("language_model."):]
            else:
                name = name.removeprefix("model.")
            if self.pp is not None:  # this stage's layers (local indices); the ends of the model on rank 0 alone
                if name.startswith("layers.") and int(name.split(".")[1]) >= len(self.layer_types):
                    raise ValueError(f"unexpected weight {name!r}: the config has {len(self.layer_types)} layers")
                name = self.pp.local(name)
                if name is None or (self.embed_tokens is None and name.startswith(("embed_tokens.", "lm_head."))):
                    continue
            if name == "lm_head.weight":
                lm_head_seen = True
                if not self.tie:
                    if self.tp is not None:  # this rank's vocabulary rows
                        rows = vocab_rows(self.vocab_size, self.tp.size)
                        tensor = take_rows(tensor, self.tp.rank * rows, rows)
                    self.lm_head.load_weight(tensor)
                    loaded.add("lm_head#0")
                continue
            if name == "embed_tokens.weight" and isinstance(self.embed_tokens, VocabParallelEmbedding):
                self.embed_tokens.load(dense_tensor(tensor))  # (held dense, as without TP)
                loaded.add(name)
                continue
            if not name.startswith("layers."):
                self._copy_param(params, name, tensor)
                loaded.add(name)
                continue
            idx_str, rest = name[len("layers."):].split(".", 1)
            i = int(idx_str)
            if i >= len(self.layers):
                raise ValueError(f"unexpected weight {name!r}: the config has {len(self.layers)} layers")
            loaded.update(load_layer_weight(self.layers[i], f"layers.{i}.", rest, tensor, params))
        if not self.tie and self.lm_head is not None and "lm_head#0" not in loaded and not lm_head_seen:
            # checkpoint without lm_head: the embedding is tied even if the config does not say so
            self.lm_head.load_weight(self.embed_tokens.weight.data)
            loaded.add("lm_head#0")
        missing = sorted(self._expected_keys() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights, e.g. {missing[:3]}")

    @staticmethod
    def _copy_param(params: dict, name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        tensor = dense_tensor(tensor)  # (a parameter is always dense)
        if params[name].shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """qwen3_5 / qwen3_5_text: dense MLP, split GDN projections (same structure, see module docstring)."""


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """qwen3_5_moe / qwen3_5_moe_text: MoE in every layer with normalized top-k."""
