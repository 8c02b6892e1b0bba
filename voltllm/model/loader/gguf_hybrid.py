"""llama.cpp GGUF files of the hybrid Qwen models (Gated DeltaNet + gated attention): architectures `qwen35`
(Qwen3.5), `qwen35moe` (Qwen3.5-MoE) and `qwen3next` (Qwen3-Next), read back as the Hugging Face checkpoint.

What llama.cpp's converter (convert_hf_to_gguf.py: Qwen3NextModel, _LinearAttentionVReorderBase and the Qwen3.5
classes built on it) does to these models, each step undone here so the model gets the HF weights:
- Names: blk.N.attn_qkv / attn_gate / ssm_alpha / ssm_beta / ssm_ba / ssm_conv1d / ssm_a / ssm_dt.bias / ssm_norm /
  ssm_out for the GDN layers, post_attention_norm, ffn_*_shexp and ffn_gate_inp_shexp for the shared expert.
- Every `*norm.weight` but the GDN output norm (`linear_attn.norm`, ssm_norm) is stored as 1 + w: these models scale
  by (1 + w). The subtraction is exact wherever 1 + w lies in [0.5, 2], so the model's (1 + w) is the file's value.
- A_log is stored as ssm_a = -exp(A_log): read back as log(-ssm_a) (float64, then float32: within an ulp, so
  -exp(A_log) is the file's value to rounding). dt_bias is stored as ssm_dt.bias; conv1d [C, 1, K] squeezed to [C, K].
- qwen3next: in_proj_qkvz, grouped per key head ([q_g k_g v_g z_g] for each key head g), split into attn_qkv =
  [q of all heads | k | v] and attn_gate = z; in_proj_ba is stored as it is (ssm_ba). Read back as in_proj_qkvz; kept
  quantized, as in_proj_qkv + in_proj_z instead (the GDN layer loads either into the same rows, and the two tensors
  may be of different quantization kinds).
- qwen35 / qwen35moe with more value heads than key heads: the value heads are reordered from grouped by key head
  (HF: head g * r + j reads key head g) to tiled (file: j * Hk + g) in in_proj_qkv's v rows, in_proj_z, in_proj_a / b,
  A_log, dt_bias, conv1d's v channels and out_proj's input columns. Rows move as whole quantized rows; out_proj's
  columns move as whole blocks where a head is a whole number of blocks (Q8_0 / Q4_0 / Q5_*: 32 inputs), else that
  tensor is dequantized (K-quants: 256-input blocks span two heads of 128).
- Qwen3.5's multi-token-prediction module, when written, follows the decoder as `nextn_predict_layers` extra blocks:
  skipped (MTP speculation reads it from the safetensors checkpoint only: engine/mtp.py).
- Experts are stacked per projection (ffn_{gate,up,down}_exps, or gate and up fused as ffn_gate_up_exps: gguf_loader).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

# GGUF architecture -> (transformers config class, HF architecture)
HYBRID_ARCHS = {"qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
                "qwen35moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
                "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM")}

# GGUF layer tensor (without .weight / .bias) -> HF module, for the hybrids
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",  # [q_h | gate_h] per head, as in HF (not permuted: NEOX-style RoPE)
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# tensors whose HF name is not <module>.<suffix>: (GGUF module, suffix or None) -> HF parameter
SPECIAL_NAMES = {("ssm_a", None): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}


def is_hybrid(arch: str) -> bool:
    return arch in HYBRID_ARCHS


def num_decoder_layers(arch: str, meta: dict) -> int:
    """The decoder's layers: the file's blocks less Qwen3.5's MTP blocks written after them."""
    return int(meta[f"{arch}.block_count"]) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)


def hybrid_config(arch: str, key: Any, meta: dict, fields: dict, common: dict) -> Any:
    """The transformers config of a hybrid GGUF file. key(name[, default]): the `{arch}.name` metadata value;
    common: what every architecture's metadata gives (shapes, norm epsilon, RoPE, vocabulary, special tokens)."""
    import transformers

    cls_name, hf_arch = HYBRID_ARCHS[arch]
    head_dim = common["head_dim"]
    n_layers = num_decoder_layers(arch, meta)
    interval = int(key("full_attention_interval", 4))
    recurrent = fields.get(f"{arch}.attention.recurrent_layers")  # newer llama.cpp: one flag per layer
    if recurrent is not None:
        flags = [bool(v) for v in recurrent.contents()][:n_layers]
        layer_types = ["linear_attention" if r else "full_attention" for r in flags]
    else:  # llama.cpp's rule: layer i is recurrent unless (i + 1) % interval == 0
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    rope = dict(common["rope_parameters"])
    # the rotary width in dimensions (the converter writes head_dim * partial_rotary_factor)
    rope["partial_rotary_factor"] = int(key("rope.dimension_count", head_dim)) / head_dim
    sections = fields.get(f"{arch}.rope.dimension_sections")
    if sections is not None and arch != "qwen3next":  # Qwen3.5's interleaved MRoPE (plain RoPE for text positions)
        rope["mrope_section"] = [int(s) for s in sections.contents() if s]
        rope["mrope_interleaved"] = True
    value_heads = int(key("ssm.time_step_rank"))
    kwargs = dict(common, architectures=[hf_arch], num_hidden_layers=n_layers, layer_types=layer_types,
                  full_attention_interval=interval, rope_parameters=rope,
                  linear_conv_kernel_dim=int(key("ssm.conv_kernel")),
                  linear_key_head_dim=int(key("ssm.state_size")),
                  linear_num_key_heads=int(key("ssm.group_count")),
                  linear_num_value_heads=value_heads,
                  linear_value_head_dim=int(key("ssm.inner_size")) // value_heads)
    if arch in ("qwen35moe", "qwen3next"):
        moe = int(key("expert_feed_forward_length"))
        kwargs.update(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                      moe_intermediate_size=moe,
                      shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)))
        if kwargs.get("intermediate_size") is None:  # an all-expert model may have no dense width in the file
            kwargs["intermediate_size"] = moe
    if arch == "qwen3next":  # every layer sparse (llama.cpp's qwen3next has no dense layers); top-k renormalized
        kwargs.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if kwargs.get("intermediate_size") is None:
        kwargs.pop("intermediate_size")
    return getattr(transformers, cls_name)(**kwargs)


def value_head_order(num_k: int, num_v: int, head_dim: int) -> torch.Tensor:
    """Index into the file's tiled value rows (head j * Hk + g) that gives HF's grouped order (head g * r + j)."""
    r = num_v // num_k
    h = torch.arange(num_v)
    src = (h % r) * num_k + h // r
    return (src[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


class HybridTensors:
    """Turns the (HF-named, still as stored) tensors of one hybrid GGUF file into the HF checkpoint's: `convert`
    per tensor, then `finish`. Tensors are float32 torch tensors or quantized_linear.GGUFBlocks."""

    def __init__(self, arch: str, cfg: Any):
        self.arch = arch
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.nk, self.nv, self.dk, self.dv = nk, nv, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if nv % nk:
            raise ValueError(f"GGUF {arch}: {nv} value heads are not a multiple of {nk} key heads")
        # Qwen3.5's converter tiles the value heads when there are more of them than key heads
        self.tiled = arch != "qwen3next" and nv != nk
        self.pending: dict[str, dict[str, Any]] = {}  # qwen3next: a layer's attn_qkv / attn_gate until both came

    def convert(self, name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        for step in (self._unoffset_norm, self._a_log, self._unsqueeze_conv, self._untile):
            tensor = step(name, tensor)
        if self.arch == "qwen3next" and name.endswith(("in_proj_qkv.weight", "in_proj_z.weight")):
            yield from self._regroup_qkvz(name, tensor)
            return
        yield name, tensor

    def finish(self) -> None:
        if self.pending:
            prefix, parts = next(iter(self.pending.items()))
            raise ValueError(f"GGUF qwen3next: {prefix}: attn_qkv and attn_gate must both be present, got only "
                             f"{sorted(parts)}")

    @staticmethod
    def _unoffset_norm(name: str, tensor: Any) -> Any:
        """Every RMSNorm weight but the GDN output norm is stored as 1 + w."""
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return tensor - 1.0
        return tensor

    @staticmethod
    def _a_log(name: str, tensor: Any) -> Any:
        """ssm_a = -exp(A_log) back to A_log."""
        if not name.endswith("linear_attn.A_log"):
            return tensor
        if not bool((tensor < 0).all()):
            raise ValueError(f"GGUF {name} (ssm_a) must hold -exp(A_log) < 0")
        return torch.log(-tensor.double()).float()

    @staticmethod
    def _unsqueeze_conv(name: str, tensor: Any) -> Any:
        """The squeezed conv kernel [C, K] back to HF's [C, 1, K]."""
        if name.endswith("linear_attn.conv1d.weight"):
            return tensor.reshape(tensor.shape[0], 1, -1)
        return tensor

    def _untile(self, name: str, tensor: Any) -> Any:
        """Put value heads back into HF's grouped order (undo _LinearAttentionVReorderBase)."""
        if not self.tiled:
            return tensor
        kd = self.nk * self.dk
        if name.endswith("linear_attn.in_proj_qkv.weight"):
            order = torch.cat([torch.arange(2 * kd), 2 * kd + value_head_order(self.nk, self.nv, self.dv)])
            return _rows(tensor, order)
        if name.endswith("linear_attn.in_proj_z.weight"):
            return _rows(tensor, value_head_order(self.nk, self.nv, self.dv))
        if name.endswith(("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.A_log",
                          "linear_attn.dt_bias")):
            return _rows(tensor, value_head_order(self.nk, self.nv, 1))
        if name.endswith("linear_attn.conv1d.weight"):
            order = torch.cat([torch.arange(2 * kd), 2 * kd + value_head_order(self.nk, self.nv, self.dv)])
            return tensor.index_select(0, order)
        if name.endswith("linear_attn.out_proj.weight"):
            return _columns(tensor, value_head_order(self.nk, self.nv, self.dv), self.dv)
        return tensor

    def _regroup_qkvz(self, name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """attn_qkv ([q | k | v], all heads each) and attn_gate (z) back into HF's in_proj_qkvz, grouped per key head;
        kept quantized, both as they are (in_proj_qkv / in_proj_z: the GDN layer loads either form)."""
        from voltllm.model.layers.quantized_linear import PackedWeight

        prefix, _, part = name.rpartition(".in_proj_")
        parts = self.pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) < 2:
            return
        del self.pending[prefix]
        qkv, z = parts["qkv.weight"], parts["z.weight"]
        if isinstance(qkv, PackedWeight) or isinstance(z, PackedWeight):
            yield f"{prefix}.in_proj_qkv.weight", qkv
            yield f"{prefix}.in_proj_z.weight", z
            return
        nk, dk, vg = self.nk, self.dk, self.nv // self.nk * self.dv  # vg: a key head's value (and z) rows
        q, k, v = qkv.split([nk * dk, nk * dk, nk * vg])
        grouped = torch.cat([q.reshape(nk, dk, -1), k.reshape(nk, dk, -1), v.reshape(nk, vg, -1),
                             z.reshape(nk, vg, -1)], dim=1)
        yield f"{prefix}.in_proj_qkvz.weight", grouped.reshape(-1, qkv.shape[-1])


def _rows(tensor: Any, order: torch.Tensor) -> Any:
    """Rows (dim 0) `order` of a float tensor or of a weight's raw quantized rows."""
    from voltllm.model.layers.quantized_linear import GGUFBlocks

    if isinstance(tensor, GGUFBlocks):
        return tensor.take_rows(order)
    return tensor.index_select(0, order)


def _columns(tensor: Any, order: torch.Tensor, head_dim: int) -> Any:
    """Input columns `order` (whole heads of `head_dim`) of a float weight, or of raw quantized rows by whole blocks
    where a head is a whole number of blocks (else dequantized: a block would mix two heads)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from voltllm.model.layers.quantized_linear import GGUFBlocks

    if not isinstance(tensor, GGUFBlocks):
        return tensor.index_select(1, order)
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[tensor.type_name]]
    if head_dim % block:
        return tensor.dequantize(torch.float32).index_select(1, order)
    blocks = order.reshape(-1, block)[:, 0] // block  # each output block's source block
    raw = tensor.raw.reshape(tensor.out_features, -1, block_bytes).index_select(1, blocks)
    return GGUFBlocks(tensor.type_name, raw.reshape(tensor.out_features, -1).contiguous(), tensor.out_features,
                      tensor.in_features)


def layer_hf_name(module: str, suffix: Optional[str]) -> Optional[str]:
    """The HF name inside a decoder layer of GGUF layer tensor `module`[.suffix]; None when it has none."""
    special = SPECIAL_NAMES.get((module, suffix))
    if special is not None:
        return special
    if module in LAYER_NAMES and suffix is not None:
        return f"{LAYER_NAMES[module]}.{suffix}"
    return None
