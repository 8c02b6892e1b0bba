"""Tiny random EAGLE-3 heads in the public checkpoint format (config.json + model.safetensors, the EAGLE repo /
SpecForge names), made at test time, and a float64 reference of the head's math fed by transformers' hidden states
of the target (written from the architecture, independent of voltllm's layers).

The head (vLLM's Eagle3LlamaForCausalLM): for position i with next token x_{i+1},
  g_i = fc(concat of hidden_states[j][i] for the head's target layers j, ascending)
  a   = attention(q / k / v of [rms(embed(x_{i+1}), input_layernorm) | rms(g_i, hidden_norm)]), causal, RoPE at i
  r   = a + g_i (or + rms(g_i, hidden_norm) with norm_before_residual);  y_i = r + mlp(rms(r, post_attention_layernorm))
  logits over the draft vocabulary = rms(y_i, norm) @ lm_head^T, at target ids draft_id + d2t[draft_id], -inf elsewhere
and y_i is the hidden input of the chained row at position i + 1 (with the drafted token).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.nn.functional as F

from mtp_models import ChainedDraftReference
from ref_math import rms as _rms
from ref_math import rope as _rope

HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, 96
THETA = 10000.0


def make_eagle3(path: str, hidden: int, vocab: int, draft_vocab: Optional[int] = None,
                layer_ids: Optional[list[int]] = None, ids_in_eagle_config: bool = True, layout: str = "midlayer",
                own_embedding: bool = False, own_lm_head: bool = True, seed: int = 0, std: float = 0.15,
                zero_lm_head: bool = False, drop: tuple = (), **overrides) -> str:
    """Save a head under path. draft_vocab: a smaller draft vocabulary (with d2t / t2d tensors; None: the target's).
    layer_ids None: vLLM's default choice. layout: "midlayer" (EAGLE repo / SpecForge) or "layers.0". drop: tensor
    names left out."""
    draft_vocab = draft_vocab or vocab
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": THETA,
           "max_position_embeddings": 1024, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
           "target_hidden_size": hidden, "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu"}
    if layer_ids is not None:
        if ids_in_eagle_config:
            cfg["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layer_ids}
        else:
            cfg["eagle_aux_hidden_state_layer_ids"] = layer_ids
    cfg.update(overrides)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * std

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    p = "midlayer." if layout == "midlayer" else "layers.0."
    w = {"fc.weight": rnd(hidden, 3 * hidden), "norm.weight": norm(hidden),
         p + "input_layernorm.weight": norm(hidden), p + "hidden_norm.weight": norm(hidden),
         p + "post_attention_layernorm.weight": norm(hidden),
         p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, 2 * hidden),
         p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * hidden),
         p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * hidden),
         p + "self_attn.o_proj.weight": rnd(hidden, HEADS * HEAD_DIM),
         p + "mlp.gate_proj.weight": rnd(INTER, hidden), p + "mlp.up_proj.weight": rnd(INTER, hidden),
         p + "mlp.down_proj.weight": rnd(hidden, INTER)}
    if own_lm_head:
        w["lm_head.weight"] = torch.zeros(draft_vocab, hidden) if zero_lm_head else rnd(draft_vocab, hidden)
    if own_embedding:
        w["embed_tokens.weight"] = rnd(vocab, hidden)
    if draft_vocab != vocab:  # a random subset of the target's ids, ascending (as SpecForge's frequency cut keeps them)
        kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        w["d2t"] = kept - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        w["t2d"] = t2d
    for name in drop:
        w.pop(name)
    return save_head(path, w, cfg)


def save_head(path: str, weights: dict, cfg: dict) -> str:
    """A head's tensors (model.safetensors) and config.json under path."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


class Eagle3Reference(ChainedDraftReference):
    """The head in float64: transformers' target for the hidden states (and the embedding / LM head the head lacks);
    the rest here. layer_ids / use_d2t: what the reference assumes (tests mutate them to show the check's teeth)."""

    def __init__(self, target_path: str, head_path: str, layer_ids: list[int], use_d2t: bool = True):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float64,
                                                        attn_implementation="eager").eval()
        raw = load_file(os.path.join(head_path, "model.safetensors"))
        self.w = {k.replace("midlayer.", "").replace("layers.0.", ""): v.double() if v.is_floating_point() else v
                  for k, v in raw.items()}
        with open(os.path.join(head_path, "config.json")) as f:
            self.cfg = json.load(f)
        self.layer_ids = sorted(layer_ids)
        self.vocab = self.hf.config.vocab_size
        n = self.cfg.get("draft_vocab_size") or self.vocab
        self.target_ids = (torch.arange(n) + self.w["d2t"]) if use_d2t and "d2t" in self.w else torch.arange(n)

    @torch.no_grad()
    def target_hidden(self, ids: list[int]) -> torch.Tensor:
        """g_i for every position of ids [len, hidden]."""
        hs = self.hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        return torch.cat([hs[j][0] for j in self.layer_ids], -1) @ self.w["fc.weight"].T

    def _embed(self, ids: list[int]) -> torch.Tensor:
        table = self.w.get("embed_tokens.weight")
        return table[torch.tensor(ids)] if table is not None else self.hf.model.embed_tokens(torch.tensor(ids))

    @torch.no_grad()
    def outputs(self, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """y_i for rows at positions 0..len-1 (causal): row i fed next_ids[i] and hidden[i]."""
        w, t = self.w, len(next_ids)
        e = _rms(self._embed(next_ids), w["input_layernorm.weight"])
        g = _rms(hidden, w["hidden_norm.weight"])
        residual = g if self.cfg.get("norm_before_residual") else hidden
        x = torch.cat([e, g], -1)
        q = (x @ w["self_attn.q_proj.weight"].T).view(t, HEADS, HEAD_DIM)
        k = (x @ w["self_attn.k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
        v = (x @ w["self_attn.v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
        pos = torch.arange(t)
        q, k = _rope(q, pos), _rope(k, pos)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5
        att = att + torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
        a = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(t, HEADS * HEAD_DIM)
        r = a @ w["self_attn.o_proj.weight"].T + residual
        m = _rms(r, w["post_attention_layernorm.weight"])
        gated = F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)
        return r + gated @ w["mlp.down_proj.weight"].T

    @torch.no_grad()
    def logits(self, y: torch.Tensor) -> torch.Tensor:
        x = _rms(y, self.w["norm.weight"])
        head = self.w.get("lm_head.weight")
        small = x @ head.T if head is not None else self.hf.lm_head(x)
        full = torch.full((self.vocab,), float("-inf"), dtype=torch.float64)
        full[self.target_ids] = small
        return full



def patch_eagle3(monkeypatch, table: dict, vocab: int) -> None:
    """The head's proposal runs as usual, then its drafts (MTPRunner._drafts [drafts, requests], read by the step's
    input ids and the verification) are replaced by the oracle's (tests/spec_oracle.py)."""
    from spec_oracle import patch_device_proposals
    from voltllm.worker.eagle3_runner import Eagle3Runner

    patch_device_proposals(monkeypatch, Eagle3Runner, table, vocab)


def to_speculators(head: str, path: str, verifier: str, target: Optional[str] = None, speculative_tokens: int = 3,
                   drop_keys: tuple = (), tensors: Optional[dict] = None, **overrides) -> str:
    """The head at `head` (make_eagle3's layout) saved under path in the speculators format (RedHatAI/*.eagle3): the
    same weights under layers.0.*, with the target's embedding copied in when `target` is given (as the speculators
    converter saves the verifier's); a config with the decoder layer's Llama config nested in transformer_layer_config,
    the EAGLE-3 fields at the top (norm_before_residual written explicitly) and a speculators_config naming
    `verifier`. drop_keys: top-level config keys left out; tensors: extra tensors; overrides: top-level keys."""
    from safetensors.torch import load_file

    with open(os.path.join(head, "config.json")) as f:
        src = json.load(f)
    w = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(os.path.join(head, "model.safetensors")).items()}
    if target is not None and "embed_tokens.weight" not in w:
        w["embed_tokens.weight"] = load_file(os.path.join(target, "model.safetensors"))["model.embed_tokens.weight"]
    w.update(tensors or {})
    layer_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "attention_bias",
                  "hidden_act")
    layer = {"model_type": "llama", "mlp_bias": False, "tie_word_embeddings": False,
             **{k: src[k] for k in layer_keys if k in src}}
    ids = src.get("eagle_aux_hidden_state_layer_ids") or (src.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
           "transformer_layer_config": layer, "draft_vocab_size": src["draft_vocab_size"],
           "norm_before_residual": bool(src.get("norm_before_residual", False)),
           "target_hidden_size": src.get("target_hidden_size"), "eagle_aux_hidden_state_layer_ids": ids,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens":
                                                        speculative_tokens, "verifier_accept_k": 1,
                                                        "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    cfg.update(overrides)
    for k in drop_keys:
        cfg.pop(k)
    return save_head(path, w, cfg)
