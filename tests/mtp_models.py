"""MTP test helpers: random mtp.* weights added to a saved tiny hybrid checkpoint (the real names), and an independent
float64 reference of the MTP math fed by transformers' hidden states of the target.

The structure (vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py): for position i, with x_{i+1} the next token and h_i the
target's last hidden state (after its final norm):
  out_i = norm(layer(fc([pre_fc_norm_embedding(embed(x_{i+1})) | pre_fc_norm_hidden(h_i)]), position i))
with zero-centred RMSNorms (1 + w), one full-attention decoder layer of the target's kind, and the target's LM head
on out_i for x_{i+2}. Chained drafts feed out_i as the hidden state of position i + 1.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch


def _first_attention_layer(cfg: dict) -> int:
    types = cfg.get("layer_types") or []
    if types:
        return types.index("full_attention")
    return cfg.get("full_attention_interval", 4) - 1


def add_mtp_weights(path: str, seed: int = 5, std: float = 0.08, zero_lm_head: bool = False,
                    prefix: str = "model.") -> dict:
    """Add mtp.fc / mtp.pre_fc_norm_* / mtp.norm and mtp.layers.0.* (the names and shapes of the target's first
    full-attention layer, its MLP or MoE included) to the checkpoint under path; returns the added tensors.
    zero_lm_head: the target's LM head set to zeros (every argmax is token 0: target and MTP always agree).
    prefix: where the text model's layers are (a VL checkpoint's: "model.language_model.")."""
    from safetensors.torch import load_file, save_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    assert len(files) == 1, "tiny checkpoints are one file"
    sd = load_file(files[0])
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    src = f"{prefix}layers.{_first_attention_layer(cfg)}."
    gen = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    added = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=gen) * std}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        added[f"mtp.{n}.weight"] = torch.randn(h, generator=gen) * 0.2
    for name, t in sd.items():
        if name.startswith(src):
            scale = 0.2 if "norm" in name else std
            added["mtp.layers.0." + name[len(src):]] = torch.randn(t.shape, generator=gen) * scale
    sd.update({k: v.to(next(iter(sd.values())).dtype) for k, v in added.items()})
    if zero_lm_head:
        sd["lm_head.weight"] = torch.zeros_like(sd["lm_head.weight"])
    save_file(sd, files[0], metadata={"format": "pt"})
    return added


def _fused_experts(sd: dict) -> dict:
    """Per-expert checkpoint tensors (mlp.experts.<e>.{gate,up,down}_proj.weight) as transformers' fused expert
    parameters (mlp.experts.gate_up_proj [E, 2I, H]: gate rows first; mlp.experts.down_proj [E, H, I])."""
    ids = sorted({int(k.split(".")[2]) for k in sd if k.startswith("mlp.experts.") and k.split(".")[2].isdigit()})
    if not ids:
        return sd
    out = {k: v for k, v in sd.items() if not (k.startswith("mlp.experts.") and k.split(".")[2].isdigit())}
    w = lambda e, n: sd[f"mlp.experts.{e}.{n}_proj.weight"]  # noqa: E731
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w(e, "gate"), w(e, "up")]) for e in ids])
    out["mlp.experts.down_proj"] = torch.stack([w(e, "down") for e in ids])
    return out


class ChainedDraftReference:
    """draft_logits of a drafter chained as MTP chains its layer (MTP, EAGLE-1 / EAGLE-3 heads), in float64: a
    subclass gives target_hidden(ids) (what the drafter reads of the target at each position, [len, hidden]),
    outputs(next_ids, hidden) (its outputs for rows at positions 0..len-1) and logits(out)."""

    def draft_logits(self, full: list[int], start: int, drafts: list[int]) -> list[torch.Tensor]:
        """The logits of drafts 1..len(drafts)+1 for a request whose known tokens are full[:start + 1] (its next
        input full[start] at position start): the first from out_{start-1} on the true tokens, each next one from a
        chained row (draft j, the previous row's out) at the position after."""
        # the target is causal: a prefix's hidden states are the first rows of the whole sequence's (float64: equal
        # to ~1e-15), so one target forward per request serves all of its proposals
        key = tuple(full)
        cache = self.__dict__.setdefault("_hidden", {})
        if key not in cache:
            cache[key] = self.target_hidden(list(full))
        h = cache[key][:start]
        ids, hid = list(full[1:start + 1]), list(h)
        out = self.outputs(ids, torch.stack(hid))[-1]
        result = [self.logits(out)]
        for d in drafts:
            ids.append(d)
            hid.append(out)
            out = self.outputs(ids, torch.stack(hid))[-1]
            result.append(self.logits(out))
        return result


class MTPReference(ChainedDraftReference):
    """The MTP module in float64: transformers' target for the hidden states, embedding, rotary table and LM head;
    a fresh transformers decoder layer of the target's full-attention kind holding mtp.layers.0; the rest here."""

    def __init__(self, path: str, mtp: dict):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                                        experts_implementation="eager").eval()
        cfg = self.hf.config
        self.eps = cfg.rms_norm_eps
        li = _first_attention_layer(cfg.to_dict())
        self.layer = type(self.hf.model.layers[li])(cfg, li).double().eval()
        prefix = "mtp.layers.0."
        self.layer.load_state_dict(_fused_experts({k[len(prefix):]: v.double() for k, v in mtp.items()
                                                   if k.startswith(prefix)}), strict=True)
        self.w = {k: v.double() for k, v in mtp.items() if not k.startswith(prefix)}
        self._hidden: dict[tuple[int, ...], torch.Tensor] = {}

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + w)

    @torch.no_grad()
    def target_hidden(self, ids: list[int]) -> torch.Tensor:
        """h_i for every position of ids (the output of the target's final norm) [len, hidden]."""
        return self.hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def outputs(self, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """out_i for rows at positions 0..len-1 (causal): row i fed next_ids[i] and hidden[i]."""
        t = len(next_ids)
        e = self._rms(self.hf.model.embed_tokens(torch.tensor(next_ids)), self.w["mtp.pre_fc_norm_embedding.weight"])
        g = self._rms(hidden, self.w["mtp.pre_fc_norm_hidden.weight"])
        u = (torch.cat([e, g], dim=-1) @ self.w["mtp.fc.weight"].T)[None]
        pos = torch.arange(t)[None]
        # Qwen3.5's rotary table takes mRoPE ids (3, batch, T), as its model's forward passes them (transformers 5.17
        # refuses 2-D ids there; 5.24 takes both); Qwen3-Next's takes (batch, T)
        rope_pos = pos[None].expand(3, 1, t) if "qwen3_5" in self.hf.config.model_type else pos
        cos_sin = self.hf.model.rotary_emb(u, rope_pos)
        mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        y = self.layer(u, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return self._rms(y[0], self.w["mtp.norm.weight"])

    @torch.no_grad()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(out)



def record_draft_logits(monkeypatch: Any) -> list:
    """Every proposal's draft logits, per drafting request: (prompt, start, [logits of pass j])."""
    from voltllm.worker.mtp_runner import MTPRunner

    seen: list = []
    orig_propose, orig_logits = MTPRunner.propose, MTPRunner._logits

    def propose(self, sched):
        self._rec = [(tuple(s.request.prompt_token_ids), s.start, [], len(s.spec_tokens)) for s in sched.scheduled
                     if s.spec_tokens]
        seen.extend(self._rec)
        return orig_propose(self, sched)

    def logits(self, out):
        lg = orig_logits(self, out)
        for i, (_, _, got, k) in enumerate(self._rec):
            if len(got) < k:  # (past its own drafts a request's row is padding)
                got.append(lg[i].double().cpu().clone())
        return lg

    monkeypatch.setattr(MTPRunner, "propose", propose)
    monkeypatch.setattr(MTPRunner, "_logits", logits)
    return seen


def record_drafts_given(monkeypatch: Any) -> list:
    """Per drafting request of every proposal, in record_draft_logits' order (patch after it), the drafts it got."""
    from voltllm.worker.mtp_runner import MTPRunner

    given: list = []
    inner = MTPRunner.propose

    def propose(self, sched):
        out = inner(self, sched)
        rows = [s for s in sched.scheduled if s.spec_tokens]
        if rows:
            d = self._drafts.cpu()
            given.extend(d[:len(s.spec_tokens), i].tolist() for i, s in enumerate(rows))
        return out

    monkeypatch.setattr(MTPRunner, "propose", propose)
    return given


def record_drafts(monkeypatch: Any) -> tuple[list, dict]:
    """Every proposal's drafts [K, drafting requests] (on the host), and how many chained passes and passes over
    the step took the graph form."""
    from voltllm.worker.mtp_runner import MTPRunner

    drafts: list = []
    counts = {"chained": 0, "step": 0}
    orig_propose, orig_pass, orig_step = MTPRunner.propose, MTPRunner._graph_pass, MTPRunner._step_graph_for

    def propose(self, sched):
        orig_propose(self, sched)
        if self._drafts is not None:
            drafts.append(self._drafts.cpu().tolist())

    def graph_pass(self, *a):
        counts["chained"] += 1
        return orig_pass(self, *a)

    def step_graph_for(self, n):
        g = orig_step(self, n)
        counts["step"] += g is not None
        return g

    monkeypatch.setattr(MTPRunner, "propose", propose)
    monkeypatch.setattr(MTPRunner, "_graph_pass", graph_pass)
    monkeypatch.setattr(MTPRunner, "_step_graph_for", step_graph_for)
    return drafts, counts


def check_against_reference(ref: MTPReference, seen: list, fulls: dict, k: int, atol: float = 2e-4,
                            drawn: list | None = None) -> int:
    """Each recorded proposal's logits against the reference (drafts: the recorded argmaxes, or with `drawn` the
    drafts each request was given, record_drafts_given's); returns how many."""
    checked = 0
    for i, (prompt, start, logits, _) in enumerate(seen):
        full = fulls[prompt]
        drafts = [int(lg.argmax()) for lg in logits[:-1]] if drawn is None else drawn[i][:len(logits) - 1]
        want = ref.draft_logits(full, start, drafts)
        assert len(logits) <= k
        for j, (got, exp) in enumerate(zip(logits, want)):
            assert torch.allclose(got, exp, atol=atol, rtol=atol / 2), (prompt, start, j, (got - exp).abs().max())
            checked += 1
    return checked


def make_mtp_target(tmp_path_factory: Any, kind: str, model: dict | None = None, **kw: Any) -> tuple[str, dict] | None:
    """A tiny hybrid `kind` (config overrides `model`) with MTP weights: (path, the added tensors), None if
    transformers lacks the kind."""
    from tiny_models import make_tiny_hybrid

    path = make_tiny_hybrid(str(tmp_path_factory.mktemp(f"mtp-{kind}")), kind, seed=0, gen_seed=1, **(model or {}))
    if path is None:
        return None
    return path, add_mtp_weights(path, **kw)
