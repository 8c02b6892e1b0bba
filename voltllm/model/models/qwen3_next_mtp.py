"""The multi-token-prediction (MTP) module of Qwen3-Next / Qwen3.5 / Qwen3.5-MoE checkpoints (`mtp.*` weights).

For a position i whose next token x_{i+1} is known, with h_i the target's last hidden state there (the output of
its final norm, what its LM head reads):

  e = pre_fc_norm_embedding(embed(x_{i+1}));  g = pre_fc_norm_hidden(h_i)
  u = fc([e | g])                           (concatenation order: embedding first)
  u = decoder layer (full gated attention + the target's kind of MLP) at rotary position i, its own paged KV
  out_i = norm(u)                          -> the target's LM head gives the guess for x_{i+2}

Every norm is the zero-centred RMSNorm (x / rms * (1 + w)). The embedding and LM head are the target's (not
copied). Under tensor parallelism the module is split as a target layer is (its attention heads, MLP rows or experts;
fc and the norms whole on every rank) and every rank runs it, with the target's vocabulary-parallel embedding and LM
head; under pipeline parallelism it runs whole on rank 0 with rank 0's whole copies of those
(model/layers/full_vocab.py). For more than one draft
the module chains itself: out_i stands in for h_{i+1} beside the draft for x_{i+2} at position i + 1
(worker/mtp_runner.py). Weight names: mtp.fc.weight, mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight,
mtp.norm.weight, mtp.layers.0.<the names of a target decoder layer>.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from voltllm.model.forward_context import ForwardContext
from voltllm.model.layers.linear import Linear
from voltllm.model.layers.norm import RMSNorm
from voltllm.model.models.qwen3_next import (HybridDecoderLayer, Qwen3NextForCausalLM, layer_expected_keys,
                                             load_layer_weight)

# where the MTP weights sit in a checkpoint (text-only and multimodal layouts)
MTP_PREFIXES = ("mtp.", "model.mtp.")


def mtp_layer_count(cfg: Any) -> Optional[int]:
    """The config's MTP layer count (Qwen3.5: mtp_num_hidden_layers, Qwen3-Next: num_nextn_predict_layers), None
    when it names none."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        v = getattr(cfg, key, None)
        if v is not None:
            return int(v)
    return None


def mtp_name(name: str) -> Optional[str]:
    """A checkpoint tensor's name inside the MTP module ("fc.weight", "layers.0...."), None if not an MTP one."""
    for p in MTP_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return None


class HybridMTP(nn.Module):
    """The MTP module beside its target (a Qwen3NextForCausalLM): its own fc, norms and decoder layer; the target's
    embedding, rotary table and LM head."""

    def __init__(self, target: Qwen3NextForCausalLM, dtype: torch.dtype, vocab: Optional[Any] = None, tp=None):
        """vocab: rank 0's whole copies of the target's embedding and LM head when it runs the module alone beside a
        split target (model/layers/full_vocab.py; the target's own are collectives), else None (the target's). tp: the
        tensor-parallel group the module is split over like the target's layers (every rank runs it), or None."""
        super().__init__()
        cfg = target.config
        h = cfg.hidden_size
        self.config, self.dtype = cfg, dtype
        self.fc = Linear(2 * h, h, dtype=dtype)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, offset=1.0)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, offset=1.0)
        # one full-attention layer (KV index 0 of the MTP's own caches) with the MLP a target layer 0 would have
        norm_topk = True if target.variant == "qwen3_5_moe" else bool(getattr(cfg, "norm_topk_prob", True))
        self.layers = nn.ModuleList([HybridDecoderLayer(cfg, 0, "full_attention", 0, target._is_moe(cfg, 0), "split",
                                                        norm_topk, dtype, target.rotary, tp=tp)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, offset=1.0)
        self._target = [target]  # (a list: not a submodule, its weights are not this module's)
        self._vocab = [vocab if vocab is not None else target]  # what embeds the tokens and gives the logits

    @property
    def target(self) -> Qwen3NextForCausalLM:
        return self._target[0]

    @property
    def num_attention_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        a = self.layers[0].self_attn
        return a.num_kv_heads, a.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """out for each row: input_ids = the next tokens x_{i+1}, hidden = the target's h_i (or the module's own out
        of the position before, when chaining), positions = i. hidden None (memory profiling): zeros."""
        e = self.pre_fc_norm_embedding(self._vocab[0].embed_tokens(input_ids))
        if hidden is None:
            hidden = torch.zeros_like(e)
        g = self.pre_fc_norm_hidden(hidden.to(e.dtype))
        x = self.fc(torch.cat([e, g], dim=-1))
        x, residual = self.layers[0](positions, x, None, ctx, None)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self._vocab[0].compute_logits(out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(name, tensor) pairs of the MTP module (names without the mtp. prefix)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "fc.weight":
                self.fc.load_weight(tensor)
                loaded.add("fc#0")
            elif name.startswith("layers."):
                idx, rest = name[len("layers."):].split(".", 1)
                if int(idx) >= len(self.layers):
                    raise ValueError(f"mtp.{name}: only {len(self.layers)} MTP layer(s) are built")
                loaded.update(load_layer_weight(self.layers[int(idx)], f"layers.{idx}.", rest, tensor, params))
            else:
                Qwen3NextForCausalLM._copy_param(params, name, tensor)
                loaded.add(name)
        want = {"fc#0", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"}
        want |= layer_expected_keys(self.layers[0], "layers.0.")
        missing = sorted(want - loaded)
        if missing:
            raise ValueError(f"the checkpoint's MTP weights are incomplete: no mtp.{missing[0]} (and "
                             f"{len(missing) - 1} more)")
