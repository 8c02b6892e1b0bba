"""Tiny random EAGLE-1 heads in the EAGLE repo's checkpoint layout (config.json + model.safetensors), made at test
time, and a float64 reference of the head's math fed by transformers' last hidden states of the target (written from
the architecture, independent of voltllm's layers).

The head (the EAGLE authors' cnets.py; vLLM's EagleLlamaForCausalLM): for position i with next token x_{i+1},
  r = fc([embed(x_{i+1}) | f_i]) (+ fc.bias)      f_i: the target's last hidden state (after its final norm);
                                                 a HASS head RMS-norms both sides first (add_para_norm)
  per layer l: a = attention(q / k / v of (r if l == 0 else rms(r, input_layernorm))), causal, RoPE at i;
               r = r + a;  r = r + mlp(rms(r, post_attention_layernorm))
  y_i = r;  logits = target lm_head(y_i) x logit_scale
and y_i is the hidden input of the chained row at position i + 1 (with the drafted token).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from eagle3_models import save_head
from mtp_models import ChainedDraftReference
from ref_math import rms as _rms
from ref_math import rope as _rope

HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, 96
THETA = 10000.0


def make_eagle1(path: str, hidden: int, vocab: int, kind: str = "llama", layers: int = 1, fc_bias: bool = True,
                para_norm: bool = False, own_embedding: bool = True, seed: int = 0, std: float = 0.15,
                drop: tuple = (), **overrides) -> str:
    """Save a head under path: `layers` decoder layers of `kind` (llama / qwen2: q / k / v biases), layer 0 without
    input_layernorm as the EAGLE repo saves it. drop: tensor names left out."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]
    cfg = {"architectures": [arch], "model_type": kind, "hidden_size": hidden, "intermediate_size": INTER,
           "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": THETA, "max_position_embeddings": 1024,
           "vocab_size": vocab, "tie_word_embeddings": False, "hidden_act": "silu"}
    if kind == "llama":
        cfg["attention_bias"] = False
    if para_norm:
        cfg["add_para_norm"] = True
    cfg.update(overrides)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * std

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    w = {"fc.weight": rnd(hidden, 2 * hidden)}
    if fc_bias:
        w["fc.bias"] = rnd(hidden)
    if para_norm:
        w.update({"embedding_layernorm.weight": norm(hidden), "hidden_states_layernorm.weight": norm(hidden)})
    if own_embedding:  # (a copy of the target's in real heads; not read)
        w["embed_tokens.weight"] = rnd(vocab, hidden)
    for i in range(layers):
        p = f"layers.{i}."
        w.update({p + "post_attention_layernorm.weight": norm(hidden),
                  p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, hidden),
                  p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, hidden),
                  p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, hidden),
                  p + "self_attn.o_proj.weight": rnd(hidden, HEADS * HEAD_DIM),
                  p + "mlp.gate_proj.weight": rnd(INTER, hidden), p + "mlp.up_proj.weight": rnd(INTER, hidden),
                  p + "mlp.down_proj.weight": rnd(hidden, INTER)})
        if i:
            w[p + "input_layernorm.weight"] = norm(hidden)
        if kind == "qwen2":
            w.update({p + "self_attn.q_proj.bias": rnd(HEADS * HEAD_DIM), p + "self_attn.k_proj.bias":
                      rnd(KV_HEADS * HEAD_DIM), p + "self_attn.v_proj.bias": rnd(KV_HEADS * HEAD_DIM)})
    for name in drop:
        w.pop(name)
    return save_head(path, w, cfg)


class Eagle1Reference(ChainedDraftReference):
    """The head in float64: transformers' target for the last hidden states, the embedding and the LM head; the rest
    here. read_last False: the reference reads the state entering the target's last layer instead (a mutation the
    tests use to show the check's teeth)."""

    def __init__(self, target_path: str, head_path: str, read_last: bool = True):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float64,
                                                        attn_implementation="eager").eval()
        self.w = {k: v.double() for k, v in load_file(os.path.join(head_path, "model.safetensors")).items()}
        with open(os.path.join(head_path, "config.json")) as f:
            self.cfg = json.load(f)
        self.read_last = read_last

    @torch.no_grad()
    def target_hidden(self, ids: list[int]) -> torch.Tensor:
        """f_i for every position of ids [len, hidden]."""
        out = self.hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        return out.last_hidden_state[0] if self.read_last else out.hidden_states[-2][0]

    @torch.no_grad()
    def outputs(self, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """y_i for rows at positions 0..len-1 (causal): row i fed next_ids[i] and hidden[i]."""
        w, t = self.w, len(next_ids)
        e = self.hf.model.embed_tokens(torch.tensor(next_ids))
        if self.cfg.get("add_para_norm"):
            e, hidden = _rms(e, w["embedding_layernorm.weight"]), _rms(hidden, w["hidden_states_layernorm.weight"])
        r = torch.cat([e, hidden], -1) @ w["fc.weight"].T + w.get("fc.bias", 0.0)
        pos = torch.arange(t)
        causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
        for layer in range(self.cfg["num_hidden_layers"]):
            p = f"layers.{layer}."
            x = r if layer == 0 else _rms(r, w[p + "input_layernorm.weight"])

            def proj(name, heads):
                return (x @ w[p + f"self_attn.{name}.weight"].T + w.get(p + f"self_attn.{name}.bias", 0.0)).view(
                    t, heads, HEAD_DIM)

            q, k, v = proj("q_proj", HEADS), proj("k_proj", KV_HEADS), proj("v_proj", KV_HEADS)
            q, k = _rope(q, pos), _rope(k, pos)
            k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
            v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
            att = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5 + causal
            a = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(t, HEADS * HEAD_DIM)
            r = r + a @ w[p + "self_attn.o_proj.weight"].T
            m = _rms(r, w[p + "post_attention_layernorm.weight"])
            r = r + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
        return r

    @torch.no_grad()
    def logits(self, y: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(y) * float(self.cfg.get("logit_scale", 1.0))



def patch_eagle1(monkeypatch, table: dict, vocab: int) -> None:
    """The head's proposal runs as usual, then its drafts are replaced by the oracle's (tests/spec_oracle.py)."""
    from spec_oracle import patch_device_proposals
    from voltllm.worker.eagle1_runner import Eagle1Runner

    patch_device_proposals(monkeypatch, Eagle1Runner, table, vocab)


def eagle1_to_speculators(head: str, path: str, verifier: str, speculative_tokens: int = 3, **overrides) -> str:
    """The head at `head` (make_eagle1's layout, one llama layer) saved under path in the speculators format
    (speculators_model_type "eagle", the `speculators` library's EagleSpeculator): fc as fusion_fc (fusion_bias when
    it has a bias), layers.0.* as transformer.*, the layer's Llama config nested in transformer_layer_config and a
    speculators_config naming `verifier`. overrides: top-level config keys."""
    from safetensors.torch import load_file

    with open(os.path.join(head, "config.json")) as f:
        src = json.load(f)
    assert src["num_hidden_layers"] == 1 and src["model_type"] == "llama"
    renames = (("fc.", "fusion_fc."), ("layers.0.", "transformer."))
    w = {}
    for k, v in load_file(os.path.join(head, "model.safetensors")).items():
        if k.startswith("embed_tokens."):  # (the verifier's: the speculators head takes it from the verifier)
            continue
        for old, new in renames:
            if k.startswith(old):
                k = new + k[len(old):]
        w[k] = v
    layer_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "attention_bias",
                  "hidden_act")
    cfg = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
           "speculators_version": "0.1.0", "transformer_layer_architecture": "LlamaDecoderLayer",
           "transformer_layer_config": {"model_type": "llama", **{k: src[k] for k in layer_keys if k in src}},
           "layernorms": False, "fusion_bias": "fusion_fc.bias" in w,
           "speculators_config": {"algorithm": "eagle", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": speculative_tokens}],
                                  "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    cfg.update(overrides)
    return save_head(path, w, cfg)
