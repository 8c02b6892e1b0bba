"""An EAGLE-1 head (its format and checks: voltllm/engine/eagle1.py): fc over [token embedding | the target's last
hidden state], then one or a few decoder layers of the target's family (the first without its input norm) over their
own paged KV cache.

forward(ids, positions, ctx, hidden) gives the last layer's output (no final norm): what the next chained draft reads
as its hidden input, and what `compute_logits` hands to the target's LM head. The embedding and LM head are the
target's. Under tensor parallelism the layers are split over the ranks as a target's are (`tp`: every rank runs them
with the target's vocabulary-parallel tables; fc and the norms whole on each rank), or under -pp the head runs whole on
rank 0 with rank 0's whole copies of the target's tables (model/layers/full_vocab.py).
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch
from torch import nn

from voltllm.engine.eagle1 import Eagle1Params
from voltllm.model.forward_context import ForwardContext
from voltllm.model.layers.linear import Linear
from voltllm.model.layers.norm import RMSNorm
from voltllm.model.layers.rotary import RotaryEmbedding
from voltllm.model.models.llama import DecoderLayer, residual_stream


class Eagle1Drafter(nn.Module):
    def __init__(self, cfg: Any, params: Eagle1Params, target: nn.Module, dtype: torch.dtype, max_positions: int,
                 vocab: Optional[Any] = None, tp=None):
        """vocab: rank 0's whole copies of the target's embedding and LM head when the head runs whole beside a split
        target, else None (the target's). tp: the group its layers are split over (every rank runs them), or None."""
        super().__init__()
        cfg = copy.deepcopy(cfg)
        cfg.num_experts = 0  # (dense layers whatever the config says)
        self.config, self.params, self.dtype = cfg, params, dtype
        h = cfg.hidden_size
        head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
        self.rotary = RotaryEmbedding(cfg, head_dim, max(max_positions, 1))
        self.fc = Linear(2 * h, h, bias=params.fc_bias, dtype=dtype)
        self.tp = tp
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, self.rotary, tp=tp) for i in range(params.num_layers))
        self.layers[0].input_layernorm = None  # (the EAGLE code's first layer has none)
        if params.para_norm:
            self.embedding_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_states_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self._vocab = [vocab if vocab is not None else target]  # (a list: the target's weights are not the head's)

    @property
    def num_attention_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        a = self.layers[0].self_attn
        return a.num_kv_heads, a.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's last-layer output: input_ids = the next tokens x_{i+1}, hidden = the target's last hidden
        state at i (or the head's own output at i - 1 when chaining), positions = i. hidden None (memory
        profiling): zeros."""
        e = self._vocab[0].embed_tokens(input_ids)
        hidden = torch.zeros_like(e) if hidden is None else hidden.to(e.dtype)
        if self.params.para_norm:
            e, hidden = self.embedding_layernorm(e), self.hidden_states_layernorm(hidden)
        x = self.fc(torch.cat([e, hidden], dim=-1))
        residual = residual_stream(x)  # (fp32 for fp16; x itself otherwise: attention reads x before the add)
        for i, layer in enumerate(self.layers):
            if i:
                x, residual = layer.input_layernorm(x, residual)
            x = layer.self_attn(positions, x, ctx)
            x, residual = layer.post_attention_layernorm(x, residual)
            x = layer.mlp(x)
        return (x + residual).to(self.dtype)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        logits = self._vocab[0].compute_logits(out)
        return logits * self.params.logit_scale if self.params.logit_scale != 1.0 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's (name, tensor) pairs: fc, layers.*, HASS's norms (an embedding or LM head it carries is
        the target's and is not read, nor a first-layer input norm the EAGLE code does not apply)."""
        from voltllm.engine.speculators import TRAINING_ONLY_TENSORS, eagle1_name
        from voltllm.model.models.head_weights import check_complete, expected_head_keys, load_head_tensor

        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = eagle1_name(name.removeprefix("model."))  # (the speculators format's names too)
            if (name.startswith(("embed_tokens.", "lm_head.", "layers.0.input_layernorm.")) or "rotary_emb" in name
                    or name in TRAINING_ONLY_TENSORS):
                continue
            loaded.add(load_head_tensor(self, params, name, tensor, "EAGLE-1 head"))
        check_complete(loaded, expected_head_keys(self, (n for n in params if "norm" in n)), "EAGLE-1 head")
