"""The DFlash drafter's layers over the paged KV cache (its configuration: voltllm/engine/dflash.py).

Its decoder layers are Qwen3 layers (QK-norm), so the block's forward is LlamaForCausalLM's: the block's rows run as
decode rows of their request that all see the whole block (each row's context ends after the block's last
position, and every row's K / V is stored before attention reads), which is the drafter's non-causal block
attention over context + block, on the same paged attention kernels as any decode step. What differs:
- the block's input embeddings are the target's (`embed_tokens` is the target's module, scaled if the checkpoint
  says so), its logits the target's LM head's (`compute_logits` takes the target). Under tensor parallelism the
  drafter's layers are split over the ranks as a Qwen3 target's are (`tp`: every rank runs the block with the target's
  vocabulary-parallel tables; worker/dflash_runner.py), or under -pp it runs whole on rank 0 with rank 0's whole
  copies of both tables (model/layers/full_vocab.py);
- its context: the K / V at a position the target has computed come from the target's hidden states there,
  `hidden_norm(fc(concat of the chosen layers' outputs))`, through each layer's k / v projections (+ k_norm,
  RoPE) without running the layers (`context_kv`). All layers' k / v weights are stacked once at load, so the
  context of a step is one GEMM for every layer.
A DFlash2 drafter's layers add convolutions along the block and it picks its greedy drafts with its candidate selector
(`select`; models/dflash2_layers.py); its context is DFlash's.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import torch
from torch import nn

from voltllm.engine.dflash import DFlashParams
from voltllm.model.layers.norm import RMSNorm
from voltllm.model.models.llama import LlamaForCausalLM


class _ScaledEmbedding(nn.Module):
    """The target's embedding times a constant (a checkpoint's input_embedding_scale)."""

    def __init__(self, embed: nn.Module, scale: float):
        super().__init__()
        self.embed, self.scale = embed, scale

    @property
    def weight(self) -> torch.Tensor:  # (what GEMM tuning reads as a tied head's weight)
        return self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) * self.scale


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: Any, params: DFlashParams, target: nn.Module, dtype: torch.dtype, max_positions: int,
                 vocab: Optional[Any] = None, tp=None):
        """vocab: rank 0's whole copies of the target's embedding and LM head when the drafter runs whole beside a
        split target (model/layers/full_vocab.py; the target's own are collectives), else None (the target's). tp: the
        group the drafter's layers are split over (every rank runs it; each holds its heads' context K / V), or
        None."""
        super().__init__()
        self.params = params
        body_cfg = copy.deepcopy(cfg)
        # Qwen3 layers whatever the config names; no embedding or LM head of its own (a 1-id table stands in until
        # the target's embedding replaces it, and a tied head allocates nothing)
        body_cfg.model_type, body_cfg.vocab_size, body_cfg.tie_word_embeddings = "qwen3", 1, True
        v2 = params.v2
        self.selector = None
        if v2 is None:
            self.body = LlamaForCausalLM(body_cfg, dtype, max_positions, tp=tp)
        else:
            from voltllm.model.models.dflash2_layers import CandidateSelector, DFlash2Body

            body_cfg.conv_kernel_size, body_cfg.conv_group_size = v2.conv_kernel_size, v2.conv_group_size
            self.body = DFlash2Body(body_cfg, dtype, max_positions, tp=tp)
            self.selector = CandidateSelector(cfg.hidden_size, int(cfg.vocab_size), v2.selector_rank,
                                              v2.selector_top_k, dtype)
        for layer in self.body.layers:  # a block row sees past its own position: a sliding window follows it
            layer.self_attn.window_by_position = True
        self._target = [target]  # (not a submodule: the target's weights are not the drafter's)
        self._vocab = [vocab]
        hidden = cfg.hidden_size
        self.fc = nn.Linear(len(params.target_layer_ids) * hidden, hidden, bias=False, dtype=dtype)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        attn = self.body.layers[0].self_attn
        self.kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.ctx_weight: Optional[torch.Tensor] = None  # [layers * 2 * kv, hidden]: every layer's k then v rows
        self.ctx_bias: Optional[torch.Tensor] = None
        self.k_norms: Optional[torch.Tensor] = None  # [layers, head_dim] fp32

    @property
    def layers(self) -> nn.ModuleList:
        return self.body.layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's tensors (layers.*, norm, fc, hidden_norm; DFlash2's convolutions and candidate_selector.*;
        an embedding or LM head it may carry is the target's and is skipped), then the stacked context
        projections."""
        own = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm.weight}
        if self.selector is not None:  # (the codebooks are bare tensors in the checkpoint: no ".weight")
            own.update({f"candidate_selector.{n}": p for n, p in self.selector.named_parameters()})
            own.update({n: p for n, p in self.body.named_parameters() if "_conv." in n})
        seen: set[str] = set()

        def body_weights():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.endswith("_codebook.weight"):  # (a codebook saved as an embedding's weight)
                    name = name.removesuffix(".weight")
                if name in own:
                    if own[name].shape != tensor.shape:
                        raise ValueError(f"DFlash drafter weight {name}: shape {tuple(tensor.shape)}, expected "
                                         f"{tuple(own[name].shape)}" + (
                                             f" ({len(self.params.target_layer_ids)} target layers x hidden size)"
                                             if name == "fc.weight" else ""))
                    own[name].data.copy_(tensor)
                    seen.add(name)
                elif not name.startswith(("embed_tokens.", "lm_head.")):
                    yield name, tensor

        self.body.load_weights(body_weights())
        if seen != set(own):
            raise ValueError(f"DFlash drafter checkpoint is missing {sorted(set(own) - seen)}")
        self.finish_loading()

    def finish_loading(self) -> None:
        """Once the weights are in place: the target's embedding in, every layer's k / v projection rows and k_norm
        weights stacked."""
        from voltllm.model.layers.full_vocab import embedding_module

        vocab, scale = self._vocab[0], self.params.input_embedding_scale
        embed = self._target[0].embed_tokens if vocab is None else embedding_module(vocab)
        self.body.embed_tokens = embed if scale == 1.0 else _ScaledEmbedding(embed, scale)
        rows, biases, norms = [], [], []
        for layer in self.layers:
            a = layer.self_attn
            q, kv = a.qkv_proj.shard_sizes[0], a.qkv_proj.shard_sizes[1]
            rows.append(a.qkv_proj.weight[q:q + 2 * kv])
            if a.qkv_proj.bias is not None:
                biases.append(a.qkv_proj.bias[q:q + 2 * kv])
            norms.append(a.k_norm.weight.float())
        self.ctx_weight = torch.cat(rows).contiguous()
        self.ctx_bias = torch.cat(biases).contiguous() if biases else None
        self.k_norms = torch.stack(norms)

    # -- the two computations ----------------------------------------------------------------------
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context K / V of every layer for tokens whose target features (the chosen layers' outputs side by side,
        [T, layers_read * hidden]) are given: ([T, layers, kv_heads, head_dim] rotated K, same-shaped V)."""
        ctx = self.hidden_norm(self.fc(features))
        kv = nn.functional.linear(ctx, self.ctx_weight, self.ctx_bias)
        t, n = kv.shape[0], len(self.layers)
        kv = kv.view(t, n, 2, self.kv_heads, self.head_dim)
        k, v = kv[:, :, 0], kv[:, :, 1]
        kf = k.float()
        eps = self.layers[0].self_attn.k_norm.eps
        k = (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + eps) * self.k_norms[None, :, None, :]).to(v.dtype)
        k = k.reshape(t, n * self.kv_heads, self.head_dim)
        # RoPE is the same for every layer's heads: rotate them all at once (q: a throwaway one-head copy)
        _, k = self.body.rotary(positions, k[:, :1].clone(), k)
        return k.view(t, n, self.kv_heads, self.head_dim), v

    def block_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The block rows' final hidden states (rows laid out as described above; ctx: the drafter's caches)."""
        return self.body(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (self._vocab[0] or self._target[0]).compute_logits(hidden)
        p = self.params
        if p.output_multiplier != 1.0:
            logits = logits * p.output_multiplier
        if p.final_logit_softcapping:
            logits = torch.tanh(logits / p.final_logit_softcapping) * p.final_logit_softcapping
        return logits

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Deterministic drafts [kmax, n] from the draft rows' final hidden states and logits (draft-major): the
        candidate selector's path (DFlash2), else each row's argmax."""
        if self.selector is None:
            return logits.argmax(dim=-1).view(-1, anchors.shape[0])
        return self.selector.select(hidden, logits, anchors)
