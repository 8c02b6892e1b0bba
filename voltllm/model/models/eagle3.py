"""An EAGLE-3 head (its format and checks: voltllm/engine/eagle3.py): one Llama decoder layer whose qkv projection
reads the normed token embedding and the normed fused target hidden state side by side, over its own paged KV cache.

forward(ids, positions, ctx, hidden) gives the layer's output *before* the final norm (vLLM's "prenorm" hidden
state): what the next chained draft reads as its hidden input, and what `compute_logits` norms and projects. `fc`
(the three target layers' streams -> one hidden vector) runs outside forward (`fuse`), so the forward, and the CUDA
graphs of it, read a hidden-size input whether it is the target's fused state or the head's own previous output.
The embedding and LM head are the checkpoint's when it has them, else the target's. Under tensor parallelism the layer
is split over the ranks as a target layer is (`tp`: every rank runs it with the target's vocabulary-parallel tables;
fc, the norms and an own embedding or LM head whole on each rank), or under -pp it runs whole on rank 0 with rank 0's
whole copies of the target's tables (model/layers/full_vocab.py).
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch
from torch import nn

from voltllm.engine.eagle3 import Eagle3Params, layer_name
from voltllm.engine.speculators import TRAINING_ONLY_TENSORS
from voltllm.model.forward_context import ForwardContext
from voltllm.model.layers.linear import Linear
from voltllm.model.layers.norm import RMSNorm
from voltllm.model.layers.rotary import RotaryEmbedding
from voltllm.model.models.llama import MLP, Attention


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, rotary: RotaryEmbedding, tp=None):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0, dtype, rotary, tp=tp)
        a = self.self_attn  # its qkv reads [embedding | hidden]: 2 x hidden wide (this rank's heads' rows)
        a.qkv_proj = Linear(2 * h, a.qkv_proj.shard_sizes, bias=a.qkv_proj.bias is not None, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size, dtype, tp=tp)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Any, params: Eagle3Params, target: nn.Module, dtype: torch.dtype, max_positions: int,
                 vocab: Optional[Any] = None, tp=None):
        """vocab: rank 0's whole copies of the target's embedding and LM head when the head runs whole beside a split
        target, else None (the target's). tp: the group its layer is split over (every rank runs it), or None."""
        super().__init__()
        cfg = copy.deepcopy(cfg)
        cfg.model_type = "llama"  # (a Llama layer whatever the config names: no QK-norm, as vLLM builds it)
        self.config, self.params, self.dtype = cfg, params, dtype
        h = cfg.hidden_size
        head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
        self.rotary = RotaryEmbedding(cfg, head_dim, max(max_positions, 1))
        self.fc = Linear(len(params.layer_ids) * h, h, dtype=dtype)
        self.tp = tp
        self.layers = nn.ModuleList([Eagle3Layer(cfg, dtype, self.rotary, tp)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.vocab_size = int(getattr(target.config, "vocab_size", None) or cfg.vocab_size)
        self._vocab = [vocab if vocab is not None else target]  # (a list: the target's weights are not the head's)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h, dtype=dtype) if params.own_embedding else None
        self.lm_head = Linear(h, params.draft_vocab_size, dtype=dtype) if params.own_lm_head else None
        # each draft id's target id (arange + d2t), None: the same ids
        self.register_buffer("target_ids", torch.arange(params.draft_vocab_size) if params.has_d2t else None,
                             persistent=False)

    @property
    def num_attention_layers(self) -> int:
        return 1

    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        a = self.layers[0].self_attn
        return a.num_kv_heads, a.head_dim

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's layers' streams side by side [T, 3 x hidden] -> the head's hidden input [T, hidden]."""
        return self.fc(features)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's output before the final norm: input_ids = the next tokens x_{i+1}, hidden = the fused target
        state at i (or the head's own output at i - 1 when chaining), positions = i. hidden None (memory
        profiling): zeros."""
        embed = self.embed_tokens(input_ids) if self.embed_tokens is not None else self._vocab[0].embed_tokens(
            input_ids)
        layer = self.layers[0]
        if hidden is None:
            hidden = torch.zeros_like(embed)
        hidden = hidden.to(embed.dtype)
        g = layer.hidden_norm(hidden)
        base = g if self.params.norm_before_residual else hidden
        # the residual stream in fp32 for fp16 (as the target's), and a fresh tensor: the fused norm adds in place
        residual = base.float() if base.dtype == torch.float16 else base.clone()
        x = layer.self_attn(positions, torch.cat([layer.input_layernorm(embed), g], dim=-1), ctx)
        x, residual = layer.post_attention_layernorm(x, residual)
        return (layer.mlp(x) + residual).to(self.dtype)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary of outputs `out`: the draft vocabulary's at their target ids, -inf
        elsewhere (a smaller draft vocabulary proposes only its own tokens)."""
        x = self.norm(out)
        logits = self.lm_head(x) if self.lm_head is not None else self._vocab[0].compute_logits(x)
        if self.params.logit_scale != 1.0:
            logits = logits * self.params.logit_scale
        if self.target_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.target_ids, logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's (name, tensor) pairs: fc, midlayer.* / layers.0.*, norm, lm_head, embed_tokens, d2t (t2d
        and a speculators checkpoint's verifier_norm / verifier_lm_head are not read)."""
        from voltllm.model.models.head_weights import check_complete, expected_head_keys, load_head_tensor

        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "t2d" or "rotary_emb" in name or name in TRAINING_ONLY_TENSORS:
                continue
            if name == "d2t":
                self._load_d2t(tensor)
                loaded.add("d2t")
                continue
            inner = layer_name(name)
            if inner is not None:
                name = "layers.0." + inner
            loaded.add(load_head_tensor(self, params, name, tensor, "EAGLE-3 head"))
        want = expected_head_keys(self, (n for n in params if "norm" in n or n == "embed_tokens.weight"))
        check_complete(loaded | ({"d2t"} if self.target_ids is None else set()), want | {"d2t"}, "EAGLE-3 head")

    def _load_d2t(self, d2t: torch.Tensor) -> None:
        """d2t: per draft id, the offset of its target id."""
        if self.target_ids is None:
            return
        n = self.params.draft_vocab_size
        if tuple(d2t.shape) != (n,) or d2t.is_floating_point():
            raise ValueError(f"EAGLE-3 head d2t: shape {tuple(d2t.shape)} {d2t.dtype}, expected ({n},) integers")
        ids = torch.arange(n) + d2t.to(torch.long).cpu()
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size or ids.unique().numel() != n:
            raise ValueError(f"EAGLE-3 head d2t maps draft ids outside the target's {self.vocab_size} ids, or two to "
                             "one")
        self.target_ids.copy_(ids.to(self.target_ids.device))
