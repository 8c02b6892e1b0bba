"""Llama-family decoder (llama, qwen2 with QKV bias, qwen3 with QK-norm, qwen3_moe: qwen3 with sparse MoE MLPs)
over the paged KV cache.

Qwen3-VL checkpoints (qwen3_vl / qwen3_vl_moe) run as their text model, a qwen3 / qwen3_moe, and Qwen2-VL /
Qwen2.5-VL ones (qwen2_vl / qwen2_5_vl) as a qwen2: `model.language_model.*` weights (or, as the released Qwen2-VL /
Qwen2.5-VL checkpoints name them, `model.*`) are used, `model.visual.*` / `visual.*` skipped (the vision tower,
multimodal/vision_tower.py, reads those). A step with image tokens (worker/image_step.py) swaps the tower's rows in for
their embeddings and, for Qwen3-VL, adds its deepstack rows to their hidden states after the first decoder layers (one
level per layer), as transformers' Qwen3VLTextModel does.

Tensor parallelism (`tp`, a voltllm.distributed.group.TPGroup): every rank builds the layers at its shard's shapes
and `load_weights` slices the checkpoint's tensors (voltllm.distributed.sharding): qkv and gate_up by output rows
(heads / intermediate), o_proj and down_proj by input columns, each followed by an all-reduce; qwen3_moe's sparse
layers by every expert's intermediate rows (layers/moe.py); the embedding and LM head by vocabulary rows, the logits
gathered on every rank.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from voltllm.attention.kv_spec import kv_scale_target, load_checkpoint_kv_scale
from voltllm.distributed.sharding import HeadShard, intermediate_split, take_cols, take_rows, vocab_rows
from voltllm.model.forward_context import ForwardContext
from voltllm.model.layer_placement import build_layer
from voltllm.model.layers.linear import (Linear, LinearMethod, gated_mlp, linear, linear_add_, norm_linear,
                                         one_row_gated)
from voltllm.model.layers.moe import SparseMoE
from voltllm.model.layers.norm import RMSNorm
from voltllm.model.layers.paged_attention import PagedAttention
from voltllm.model.layers.rotary import RotaryEmbedding
from voltllm.model.layers.vocab_parallel import VocabParallelEmbedding
from voltllm.model.models.aux_hidden import AuxHiddenCapture
from voltllm.model.sliding_window import layer_window
from voltllm.model.norm_fold import NormFoldStep


# (qwen3_vl_text / qwen3_vl_moe_text: Qwen3-VL's text models, a qwen3 / qwen3_moe)
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text")
# qwen2's QKV bias (o_proj has none); qwen2_vl_text / qwen2_5_vl_text: Qwen2-VL's and Qwen2.5-VL's text models, a qwen2
QKV_BIAS_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
_VISUAL_PREFIXES = ("model.visual.", "visual.")


def text_config(cfg: Any) -> Any:
    """The language model's config: a multimodal checkpoint's text_config, else the config itself."""
    return getattr(cfg, "text_config", None) or cfg


class Attention(PagedAttention):
    def __init__(self, cfg: Any, kv_index: int, dtype: torch.dtype, rotary: RotaryEmbedding,
                 linear_method: Optional[LinearMethod] = None, tp=None, sliding_window: int = 0):
        num_heads = cfg.num_attention_heads
        super().__init__(kv_index, getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads, rotary,
                         sliding_window)
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        # this rank's heads (all of them without TP); num_heads / num_kv_heads are the local counts
        self.heads = HeadShard.of(num_heads, num_kv_heads, tp.rank, tp.size) if tp else HeadShard.of(
            num_heads, num_kv_heads, 0, 1)
        self.tp = tp
        self.num_heads = self.heads.num_heads
        self.num_kv_heads = self.heads.num_kv_heads
        bias = cfg.model_type in QKV_BIAS_TYPES or bool(getattr(cfg, "attention_bias", False))
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q, kv, kv], bias=bias, dtype=dtype, method=linear_method)
        o_bias = cfg.model_type not in QKV_BIAS_TYPES and bool(getattr(cfg, "attention_bias", False))
        self.o_proj = Linear(q, cfg.hidden_size, bias=o_bias, dtype=dtype, method=linear_method)
        self.qk_norm = cfg.model_type in QK_NORM_TYPES
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        out = self.o_proj(self.attend(positions, self.qkv_proj(x), ctx))
        return out if self.tp is None else self.tp.all_reduce_(out)  # sum of the ranks' heads' contributions

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The qkv projection's output [T, q + 2 kv] -> attention output [T, Hq * D] (before o_proj)."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return self.rope_and_attend(positions, q, k, v, ctx, *norms).reshape(t, self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, linear_method: Optional[LinearMethod] = None,
                 tp=None):
        super().__init__()
        self.tp = tp
        inter = inter if tp is None else intermediate_split(inter, tp)[1]  # this rank's share
        self.gate_up_proj = Linear(hidden, [inter, inter], dtype=dtype, method=linear_method)
        self.down_proj = Linear(inter, hidden, dtype=dtype, method=linear_method)
        self.gate_up_proj.silu_mul_output = True  # they run through gated_mlp
        self.down_proj.silu_mul_input = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = gated_mlp(self.gate_up_proj, self.down_proj, x)
        return out if self.tp is None else self.tp.all_reduce_(out)


def residual_stream(x: torch.Tensor) -> torch.Tensor:
    """The residual stream starts as the embeddings; fp16 models keep it in fp32, since sums over many
    layers overflow fp16 (65504). The fused add+RMSNorm adds in fp32 and writes its output in x's dtype."""
    return x.float() if x.dtype == torch.float16 else x



def layer_tp_part(attn: "Attention", intermediate: int, tp, module_name: str, kind: str, shard: int,
                  tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a decoder layer's checkpoint projection (qkv / o by `attn`'s heads, gate_up / down by the
    intermediate rows); a row-parallel projection's bias is added by rank 0 only (the all-reduce sums)."""
    leaf = module_name.rpartition(".")[2]
    if leaf in ("qkv_proj", "o_proj"):
        d, h = attn.head_dim, attn.heads
        if leaf == "qkv_proj":
            start, n = (h.q_start, h.num_heads) if shard == 0 else (h.kv_start, h.num_kv_heads)
            return take_rows(tensor, start * d, n * d)
        start, n = h.q_start * d, h.num_heads * d
    elif leaf in ("gate_up_proj", "down_proj"):
        start, n = intermediate_split(intermediate, tp)
        if leaf == "gate_up_proj":
            return take_rows(tensor, start, n)
    else:
        raise ValueError(f"{module_name}: no tensor-parallel split is defined for it")
    if kind == "bias":
        return tensor if tp.rank == 0 else torch.zeros_like(tensor)
    return take_cols(tensor, start, n, module_name)

class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, idx: int, dtype: torch.dtype, rotary: RotaryEmbedding,
                 linear_method: Optional[LinearMethod] = None, tp=None, kv_index: Optional[int] = None):
        """idx: the layer's index in the model; kv_index: its KV cache's among this rank's (a pipeline stage's
        layers start at 0; None: idx)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, idx if kv_index is None else kv_index, dtype, rotary, linear_method, tp,
                                   layer_window(cfg, idx))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if is_moe_layer(cfg, idx):  # qwen3_moe: routed experts without a shared one (kept quantized with the rest)
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                 0, bool(getattr(cfg, "norm_topk_prob", True)), dtype,
                                 quantized_experts=linear_method is not None, tp=tp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, linear_method, tp)

    def projections(self) -> tuple[Linear, ...]:
        """The layer's attention and dense-MLP projections (a sparse MoE's experts are not Linears)."""
        attn = (self.self_attn.qkv_proj, self.self_attn.o_proj)
        return attn if isinstance(self.mlp, SparseMoE) else attn + (self.mlp.gate_up_proj, self.mlp.down_proj)

    def forward(self, positions, x, residual, ctx, fused: bool = False):
        """(mlp output, residual); with `fused` (see LlamaForCausalLM.fused_decode) the norms and residual adds
        run inside the GEMMs and the result is (None, residual): the residual already holds the MLP output."""
        if isinstance(fused, NormFoldStep):
            return self._forward_norm_folded(positions, x, residual, ctx, fused)
        if fused:
            return self._forward_fused(positions, x, residual, ctx)
        if residual is None:
            residual = residual_stream(x)
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_fused(self, positions, x, residual, ctx):
        # four kernels for the projections, norms and adds (seven unfused): RMSNorm in the qkv / gate_up GEMVs'
        # prologue, the residual add in the o / down GEMVs' epilogue (in place: each program owns its features)
        if residual is None:  # first layer: x is the embeddings (a fresh tensor, so it may become the residual)
            residual = residual_stream(x)
        attn, mlp = self.self_attn, self.mlp
        out = attn.attend(positions, norm_linear(attn.qkv_proj, residual, self.input_layernorm), ctx)
        linear_add_(attn.o_proj, out, residual)
        gated = one_row_gated(mlp.gate_up_proj, residual)
        gate_up = norm_linear(mlp.gate_up_proj, residual, self.post_attention_layernorm, gated=gated)
        linear_add_(mlp.down_proj, gate_up, residual, silu_mul=not gated)
        return None, residual

    def _forward_norm_folded(self, positions, x, residual, ctx, step: "NormFoldStep"):
        """A decode batch with the norms inside the decode-batch GEMMs (model/norm_fold.py): x is the residual
        scaled and rounded to the model's dtype (the embeddings at the first layer); returns (the new residual so
        rounded, the fp32 residual). Four launches for the projections, norms and adds (six unfused)."""
        if residual is None:
            residual = residual_stream(x)
            x = step.first_input(residual, x.dtype)
        return step.layer(self, x, residual, lambda qkv: self.self_attn.attend(positions, qkv, ctx)), residual


# The fused one-row decode trades launches for L2 traffic: every GEMV program re-reads the fp32 residual and the
# norm weight (4x the bytes of the fp16 input it read before). Measured on the H200 (benchmarks/README.md,
# session 5): SmolLM2-135M shape (weights <= 3.5 MB, latency-bound) 1,542 -> 1,670 tok/s; qwen3-8b shape
# (32-200 MB, bandwidth-bound) 203.4 -> 192.6 tok/s. So only models whose projections are all small use it.
FUSED_DECODE_MAX_WEIGHT_BYTES = 16 << 20

def is_moe_layer(cfg: Any, idx: int) -> bool:
    """Whether decoder layer idx has a sparse MoE MLP (qwen3_moe: every decoder_sparse_step-th layer that is not in
    mlp_only_layers); False for dense configs."""
    if int(getattr(cfg, "num_experts", 0) or 0) <= 0:
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return idx not in (getattr(cfg, "mlp_only_layers", None) or []) and (idx + 1) % step == 0


# HF name fragment -> (our module attribute, shard index)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def stacked_target(name: str) -> tuple[str, int]:
    """A checkpoint weight's name in our stacked projections, and its shard there (q / k / v -> qkv_proj 0 / 1 / 2,
    gate / up -> gate_up_proj 0 / 1); other names unchanged, shard 0."""
    for frag, (ours, idx) in _STACKED.items():
        if f".{frag}." in name:
            return name.replace(frag, ours), idx
    return name, 0


class LlamaForCausalLM(AuxHiddenCapture, nn.Module):
    supports_prompt_graphs = True  # every layer's host-dependent work is its attention call (worker.prompt_graphs)
    decoder_layer_cls = DecoderLayer  # (a DFlash2 drafter's layers add convolutions: models/dflash2_layers.py)

    def __init__(self, cfg: Any, dtype: torch.dtype, max_positions: int,
                 linear_method: Optional[LinearMethod] = None, tp=None, headless: bool = False, classifier=None,
                 pp=None):
        """linear_method: how the projections (and an untied LM head) hold their weights; None: dense. tp: this
        rank's tensor-parallel group (None: the whole model on one device). headless: no LM head and no logits (a
        pooling model: its checkpoint's lm_head, if any, is skipped; embedding checkpoints often have none).
        classifier: a headless model's classification head (voltllm.pooling.classifier.ClassifierConfig): its float32
        weight `score_weight` [num_labels, hidden] is the checkpoint's score.weight or built from LM-head rows.
        pp: this rank's pipeline stage (voltllm.distributed.pipeline): `layers` holds its decoder layers alone
        (local indices); the embeddings, final norm and LM head live on rank 0."""
        super().__init__()
        top, cfg = cfg, text_config(cfg)
        self.config = cfg
        self.headless = headless
        self.dtype = dtype
        self.tp = tp
        self.pp = pp
        self.vocab_size = cfg.vocab_size
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max(max_positions, 1))
        from voltllm.model.layers.quantized_linear import QuantizedLinearMethod, QuantEmbedding

        if pp is not None and not pp.first:  # a later pipeline stage starts from the previous one's output
            self.embed_tokens = None
        elif isinstance(linear_method, QuantizedLinearMethod):  # (under TP: this rank's vocabulary rows, see its doc)
            self.embed_tokens = QuantEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, linear_method, tp)
        elif tp is not None:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        first, end = (0, cfg.num_hidden_layers) if pp is None else (pp.start, pp.end)
        self.layers = nn.ModuleList(build_layer(self.decoder_layer_cls, cfg, i, dtype, rotary, linear_method, tp,
                                                i - first)
                                    for i in range(first, end))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # (a multimodal checkpoint's own flag decides, as in transformers: Qwen3-VL-MoE's text config says True for all)
        self.tie = bool(getattr(top, "tie_word_embeddings", False))
        head_rows = cfg.vocab_size if tp is None else vocab_rows(cfg.vocab_size, tp.size)
        self.lm_head = None if self.tie or headless or self.embed_tokens is None else Linear(
            cfg.hidden_size, head_rows, dtype=dtype, method=linear_method)
        self.rotary = rotary
        self.classifier = classifier
        if classifier is not None:  # (a buffer: it moves with the model; the pooler reads it, pooling/pooler.py)
            self.register_buffer("score_weight", torch.zeros(classifier.num_labels, cfg.hidden_size,
                                                             dtype=torch.float32), persistent=False)
        self.has_moe = any(isinstance(layer.mlp, SparseMoE) for layer in self.layers)
        # prompt-step CUDA graphs are only validated for dense MLPs (decode graphs cover MoE layers, as in the
        # hybrid MoE models), and not with all-reduces or hand-overs inside their pieces (TP / PP: not run on a
        # multi-GPU machine yet)
        self.supports_prompt_graphs = not self.has_moe and tp is None and pp is None

    # -- what the runner needs to size and lay out the KV cache ---------------------------------
    @property
    def num_attention_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        a = self.layers[0].self_attn
        return a.num_kv_heads, a.head_dim

    def fused_decode(self, input_ids: torch.Tensor) -> bool:
        """One-token CUDA step with every projection on the skinny Triton GEMM (start-up tuning chose it) and
        no projection weight over FUSED_DECODE_MAX_WEIGHT_BYTES: the decoder layers then fold their RMSNorms and
        residual adds into the GEMMs."""
        # (not under TP: its GEMVs add the o / down products into the residual before any all-reduce could sum them)
        # (not with LoRA: the fused GEMVs leave out the adapters' terms)
        # (not under PP: its output is all in the residual stream, which the hand-over does not expect)
        return input_ids.is_cuda and input_ids.numel() == 1 and not self.has_moe and self.tp is None and \
            self.pp is None and all(
            p.skinny and p.lora is None and p.weight.numel() * p.weight.element_size() <= FUSED_DECODE_MAX_WEIGHT_BYTES
            for layer in self.layers for p in layer.projections())

    # the decode-batch row counts that run the norm-folded layers (model/norm_fold.py, chosen at start-up)
    norm_fold = None

    def norm_fold_step(self, input_ids: torch.Tensor) -> Optional[NormFoldStep]:
        """A CUDA decode batch at a row count the start-up timing chose the norm-folded layers for."""
        plan = self.norm_fold
        if plan is None or not input_ids.is_cuda or input_ids.dim() != 1 or self.aux_hidden is not None:
            return None
        return plan.step(input_ids.numel())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        residual = None
        images = ctx.extra.get("image_embeds")
        fused = self.fused_decode(input_ids) or (images is None and self.norm_fold_step(input_ids)) or False
        first = fused.embed_first(self.embed_tokens, input_ids) if isinstance(fused, NormFoldStep) else None
        if self.embed_tokens is None:  # a later pipeline stage
            x, residual = self.pp.receive(input_ids, self.config.hidden_size, self.dtype, self.aux_hidden)
        elif first is not None:  # a folded decode batch: its first input and residual stream in one launch
            x, residual = first
        else:
            x = self.embed_tokens(input_ids)
        deepstack = None
        if images is not None:  # the vision tower's rows in place of the image placeholders' (worker/image_step.py)
            x.index_copy_(0, images[0], images[1].to(x.dtype))
            deepstack = ctx.extra.get("image_deepstack")  # Qwen3-VL: one set of rows per level, the same tokens
        aux = self.aux_hidden is not None  # a DFlash drafter's or EAGLE-3 head's target features (AuxHiddenCapture)
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, ctx, fused)
            if deepstack is not None and i < len(deepstack):
                # layer i's output is x + residual (the add waits for the next norm; fused: all in residual), so
                # adding level i to the residual adds it to the output, where transformers adds it
                residual.index_add_(0, images[0], deepstack[i].to(residual.dtype))
            if aux:
                self.keep_layer_output(i, x, residual)
        if self.pp is not None:  # on to the next stage; rank 0 gets the last stage's output back
            x, residual = self.pp.pass_on(x, residual, self.aux_hidden)  # (with a drafter's aux rows)
        if fused:
            from voltllm.kernels.fused import rms_norm

            n = self.norm
            x = rms_norm(residual, n.weight, n.eps, n.offset, out=torch.empty_like(residual, dtype=self.dtype))
        else:
            x, _ = self.norm(x, residual)
        if aux:
            self.keep_final_output(x)
        return x

    # the LM head's Triton GEMM choices, set by voltllm.worker.skinny_tuning: a skinny-GEMM config for one row,
    # {rows: decode-batch config} for decode batches
    logits_skinny = None
    logits_batch: Optional[dict] = None
    # {rows: decode-batch config} where the start-up timing found the LM head with the argmax in its epilogue faster
    # than the head then the argmax kernel (greedy_tokens)
    logits_argmax: Optional[dict] = None

    @property
    def logits_weight(self) -> Optional[torch.Tensor]:
        """The dense LM-head weight (None when the head is quantized, or there is none: headless, or a later pipeline
        stage)."""
        if self.headless or self.embed_tokens is None:
            return None
        return self.embed_tokens.weight if self.tie else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: a greedy batch takes their argmax as they are; the sampler widens them to
        fp32 where it computes on them (an fp32 copy of 64 x 152K logits costs ~15 us per decode step)."""
        if self.headless:
            raise RuntimeError("this model was built without its LM head (a pooling model): it computes no logits")
        if self.logits_weight is None:  # a quantized head (its own, or the embeddings' planes)
            logits = self.embed_tokens.logits(hidden) if self.tie else self.lm_head(hidden)
        else:
            logits = linear(hidden, self.logits_weight, skinny=self.logits_skinny, batch=self.logits_batch)
        if self.tp is None:
            return logits
        # every rank's vocabulary rows side by side (every rank calls this: the gather is a collective)
        logits = self.tp.all_gather_last(logits)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size].contiguous()

    def greedy_tokens(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """compute_logits(hidden).argmax(-1) (int64) without the logits, where the start-up timing chose the LM head
        with the argmax in its epilogue for this row count (kernels/batch_gemm.py, argmax_out); else None."""
        config = (self.logits_argmax or {}).get(hidden.shape[0]) if hidden.dim() == 2 else None
        w = self.logits_weight
        if config is None or w is None or self.tp is not None or not hidden.is_cuda:
            return None
        from voltllm.kernels.batch_gemm import batch_gemm

        return batch_gemm(hidden, w, config=config,
                          argmax_out=torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device))

    def _loads_head(self, name: str) -> bool:
        """Whether this checkpoint weight is (or holds the rows of) the classifier's head: score.weight, else the LM
        head's (the embedding's, tied) rows of classifier_from_token."""
        if self.classifier.from_token_ids is None:
            return name == "score.weight"
        return name == ("embed_tokens.weight" if self.tie else "lm_head.weight")

    def _moe_of(self, name: str) -> Optional[tuple["DecoderLayer", str]]:
        """(layer, name inside its MLP) for a weight of a sparse MoE layer's MLP, else None."""
        if not self.has_moe or not name.startswith("layers.") or ".mlp." not in name:
            return None
        idx, _, rest = name[len("layers."):].partition(".")
        layer = self.layers[int(idx)]
        return (layer, rest[len("mlp."):]) if isinstance(layer.mlp, SparseMoE) and rest.startswith("mlp.") else None

    def tp_part(self, module_name: str, kind: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint projection (the whole tensor without TP). Biases follow their rows; a
        row-parallel projection's bias is added once, by rank 0 (the others keep zeros, the all-reduce sums). LoRA
        cuts its adapters with it too (lora/sharding.py: B's rows of qkv / gate_up, A's columns of o / down)."""
        tp = self.tp
        if tp is None:
            return tensor
        leaf = module_name.rpartition(".")[2]
        if ".shared_expert." in module_name:  # (a sparse MoE's shared expert: the layer's own cut)
            return self._moe_of(module_name)[0].mlp.shared_tp_part(leaf, tensor, module_name)
        if leaf == "lm_head":
            rows = vocab_rows(self.vocab_size, tp.size)
            return take_rows(tensor, tp.rank * rows, rows)
        return layer_tp_part(self.layers[0].self_attn, self.config.intermediate_size, tp, module_name, kind, shard,
                             tensor)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        head_loaded = False
        for name, tensor in weights:
            if "rotary_emb" in name or name.startswith(_VISUAL_PREFIXES):
                continue
            if name.startswith(("model.language_model.", "language_model.")):  # a multimodal checkpoint's text model
                name = name.partition("language_model.")[2]
            else:
                name = name.removeprefix("model.")
            if self.pp is not None:  # this stage's layers (local indices); the ends of the model on rank 0 alone
                if name.startswith("layers.") and int(name.split(".")[1]) >= self.config.num_hidden_layers:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                name = self.pp.local(name)
                if name is None or (self.embed_tokens is None and name.startswith(("embed_tokens.", "lm_head."))):
                    continue
            if self.classifier is not None and self._loads_head(name):
                head = (tensor.to(torch.float32) if self.classifier.from_token_ids is None
                        else self.classifier.head_from_vocab(tensor))
                if head.shape != self.score_weight.shape:
                    raise ValueError(f"{name}: shape {tuple(head.shape)}, expected {tuple(self.score_weight.shape)} "
                                     "(num_labels x hidden_size)")
                self.score_weight.copy_(head)
                head_loaded = True
                if name != "embed_tokens.weight":
                    continue
            if name.startswith("lm_head.") and (self.tie or self.headless):
                continue
            if (kv_scale := kv_scale_target(name)) is not None:  # fp8 KV cache scales
                for buf in kv_scale[1]:
                    load_checkpoint_kv_scale(self.get_submodule(kv_scale[0]), buf, tensor, name)
                continue
            if (moe := self._moe_of(name)) is not None:  # routed experts and the router
                layer, rest = moe
                loaded.update(layer.mlp.load_hf_weight(rest, tensor, name[:len(name) - len(rest)]))
                continue
            target, shard = stacked_target(name)
            module_name, _, kind = target.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, VocabParallelEmbedding):
                module.load(tensor)
            elif isinstance(module, Linear):
                tensor = self.tp_part(module_name, kind, shard, tensor)
                (module.load_weight if kind == "weight" else module.load_bias)(tensor, shard)
            elif hasattr(module, "table"):  # a GGUF embedding kept quantized (quantized_linear.QuantEmbedding)
                module.load(tensor)
            elif target in params:
                if params[target].shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(params[target].shape)}")
                params[target].data.copy_(tensor)
            else:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            loaded.add(f"{target}#{shard}")
        in_moe = {id(m) for layer in self.layers if isinstance(layer.mlp, SparseMoE) for m in layer.mlp.modules()}
        expected = {f"{n}.weight#{i}" for n, m in self.named_modules() if isinstance(m, Linear) and id(m) not in in_moe
                    for i in range(len(m.shard_sizes))}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoE):
                expected |= layer.mlp.expected_weight_keys(f"layers.{i}.mlp.")
        if hasattr(self.embed_tokens, "table"):
            expected.add("embed_tokens.weight#0")
        missing = sorted(e for e in expected if e not in loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights, e.g. {missing[:3]}")
        if self.classifier is not None and not head_loaded:
            raise ValueError("the checkpoint has no classification head (score.weight): a causal LM becomes a "
                             "classifier from its LM-head rows with --hf-overrides classifier_from_token and method "
                             "(or is_original_qwen3_reranker for Qwen3-Reranker)" if self.classifier.from_token_ids is
                             None else "the checkpoint has no LM head to build the classifier from")
