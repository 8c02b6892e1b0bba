"""Tiny random DFlash drafters in the public checkpoint format (config.json + model.safetensors), made at test time,
and a plain-PyTorch reference of the drafter's math (written from the format's description, independent of
voltllm's layers)."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.nn.functional as F

from ref_math import rms as _rms
from ref_math import rope as _rope

LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 2, 4, 2, 16, 96
THETA = 10000.0


# a DFlash2 drafter's additions (dflash_config keys): two-tap convolutions over groups of 8 channels, a selector
# of rank 6 over each row's 4 best tokens
V2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 4}


def make_dflash(path: str, hidden: int, vocab: int, target_layers: int, layer_ids: Optional[list[int]],
                block_size: int = 4, mask_token_id: Optional[int] = 3, seed: int = 0, std: float = 0.15,
                new_style: bool = True, v2: Optional[dict] = None, codebook_std: float = 1.0, **overrides) -> str:
    """Save a drafter reading the target's layers `layer_ids` under path. new_style: block_size inside
    dflash_config (newer checkpoints), else at the top level (older ones). v2: a DFlash2 drafter with these
    dflash_config keys (V2's form; its convolutions' and selector's tensors are saved too; codebook_std: the
    codebooks' scale, which sets how often the selector's path leaves the argmax)."""
    dflash = {"target_layer_ids": layer_ids} if layer_ids is not None else {}
    if mask_token_id is not None:
        dflash["mask_token_id"] = mask_token_id
    if v2 is not None:
        dflash.update(v2)
    cfg = {"architectures": ["DFlash2DraftModel" if v2 is not None else "DFlashDraftModel"], "model_type": "qwen3",
           "hidden_size": hidden,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": THETA,
           "max_position_embeddings": 1024, "vocab_size": vocab, "num_target_layers": target_layers,
           "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "dflash_config": dflash}
    if new_style:
        dflash["block_size"] = block_size
    else:
        cfg["block_size"] = block_size
    cfg.update(overrides)
    n_read = len(layer_ids) if layer_ids is not None else LAYERS
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * std

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    w = {"fc.weight": rnd(hidden, n_read * hidden), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
                  p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, hidden),
                  p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, hidden),
                  p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, hidden),
                  p + "self_attn.o_proj.weight": rnd(hidden, HEADS * HEAD_DIM),
                  p + "self_attn.q_norm.weight": norm(HEAD_DIM), p + "self_attn.k_norm.weight": norm(HEAD_DIM),
                  p + "mlp.gate_proj.weight": rnd(INTER, hidden), p + "mlp.up_proj.weight": rnd(INTER, hidden),
                  p + "mlp.down_proj.weight": rnd(hidden, INTER)})
        if v2 is not None:
            gs = v2["conv_group_size"]  # (a bad size, for the refusal tests: any tensors will do)
            taps, groups = v2["conv_kernel_size"], hidden // gs if gs and hidden % gs == 0 else 1
            for conv in ("attention_conv", "mlp_conv"):  # (tap 0 near the identity, as a trained one starts)
                base = rnd(2, taps, hidden)
                base[:, 0] += 1.0
                w.update({p + conv + ".base_kernel": base,
                          p + conv + ".kernel_projection.weight": rnd(2 * taps * groups, hidden)})
    if v2 is not None:  # (the codebooks are bare tensors, no ".weight", as the public checkpoints have them)
        rank = v2["selector_rank"] or 1
        w.update({"candidate_selector.predecessor_codebook": torch.randn(vocab, rank, generator=gen) * codebook_std,
                  "candidate_selector.successor_codebook": torch.randn(vocab, rank, generator=gen) * codebook_std,
                  "candidate_selector.hidden_projection.weight": rnd(rank, hidden)})
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def load_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(os.path.join(path, "model.safetensors")).items()}


def _causal_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """DFlash2's convolution of the block's rows x [L, H]: out[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o]
    (zero before row 0); dynamic [L, taps, groups], base [taps, H]."""
    length, hidden = x.shape
    taps, groups = dynamic.shape[1], dynamic.shape[2]
    out = torch.zeros_like(x)
    for o in range(taps):
        for t in range(o, length):
            per_channel = base[o] + dynamic[t, o].repeat_interleave(hidden // groups)
            out[t] += per_channel * x[t - o]
    return out


def _convolutions(w: dict, prefix: str, x: torch.Tensor):
    """(the convolved sublayer input, a function convolving the sublayer's output), or (x, identity) for a DFlash
    layer."""
    if prefix + "base_kernel" not in w:
        return x, lambda y: y
    base = w[prefix + "base_kernel"]
    taps = base.shape[1]
    dyn = (x @ w[prefix + "kernel_projection.weight"].T).view(x.shape[0], 2, taps, -1)
    return _causal_conv(x, dyn[:, 0], base[0]), lambda y: _causal_conv(y, dyn[:, 1], base[1])


def layer_windows(path: str) -> list[int]:
    """Each drafter layer's sliding window from its config.json, as transformers reads it (0: full attention; none
    while use_sliding_window is off)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = cfg.get("layer_types") or ["full_attention"] * LAYERS
    return [window if window and t == "sliding_attention" else 0 for t in types]


def reference_block(w: dict, features: torch.Tensor, block_ids: list[int], embed: torch.Tensor,
                    lm_head: torch.Tensor, windows: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's final hidden states and logits for the block's rows 1.. (its drafts), in float64: the context
    is the target features [C, n * hidden] of positions 0..C-1, the block the ids at positions C..C+len-1; every
    block row attends to the whole context and the whole block (no mask), but in a layer with a sliding window W
    (windows[i] > 0) the row at position p only to positions from p - W + 1 on. A DFlash2 drafter's (its checkpoint
    has the convolutions' tensors) convolves each sublayer's normed input and its output along the block."""
    c = features.shape[0]
    ctx = _rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = embed.double()[torch.tensor(block_ids)]
    nb = h.shape[0]
    pos_q = torch.arange(c, c + nb)
    pos_k = torch.arange(c + nb)
    for i in range(LAYERS):
        p = f"layers.{i}."
        x, attn_conv = _convolutions(w, p + "attention_conv.", _rms(h, w[p + "input_layernorm.weight"]))
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(nb, HEADS, HEAD_DIM), w[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, x])
        k = _rms((both @ w[p + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM),
                 w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)
        q, k = _rope(q, pos_q), _rope(k, pos_k)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5
        if windows and windows[i]:
            att = att.masked_fill(pos_k[None, None, :] <= pos_q[None, :, None] - windows[i], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(nb, HEADS * HEAD_DIM)
        h = h + attn_conv(out @ w[p + "self_attn.o_proj.weight"].T)
        x, mlp_conv = _convolutions(w, p + "mlp_conv.", _rms(h, w[p + "post_attention_layernorm.weight"]))
        h = h + mlp_conv((F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T))
                         @ w[p + "mlp.down_proj.weight"].T)
    final = _rms(h, w["norm.weight"])[1:]
    return final, final @ lm_head.double().T


def reference_selection(w: dict, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, top_k: int) -> list[int]:
    """DFlash2's candidate selector over one block's draft rows, in float64: from the known token, each position
    takes, among its row's top_k tokens, the b with the largest logit(b) + <P[a] * (W h), S[b]> (a: the token taken
    before it)."""
    pred, path = anchor, []
    proj = hidden @ w["candidate_selector.hidden_projection.weight"].T
    for row in range(logits.shape[0]):
        cands = logits[row].topk(top_k).indices.tolist()
        scores = [logits[row, b] + (w["candidate_selector.predecessor_codebook"][pred] * proj[row]
                                    * w["candidate_selector.successor_codebook"][b]).sum() for b in cands]
        pred = cands[max(range(top_k), key=lambda i: scores[i])]
        path.append(pred)
    return path


def record_block_logits(dr) -> list:
    """Spy on a DFlashRunner: per proposal, each drafting request's (token ids, start, drafts) and whether it is
    greedy, the drafter's logits of the proposal ([drafts x requests, vocab], draft-major; float64, on the host)
    and its drafts ([drafts, requests])."""
    records: list = []
    orig_logits, orig_propose = dr.drafter.compute_logits, dr.propose

    def logits_spy(h):
        out = orig_logits(h)
        records[-1]["logits"] = out.detach().double().cpu()
        return out

    def propose_spy(sched):
        rows = [(list(s.request.all_token_ids), s.start, len(s.spec_tokens)) for s in sched.scheduled
                if s.spec_tokens]
        records.append({"rows": rows, "greedy": [s.request.sampling_params.greedy for s in sched.scheduled
                                                 if s.spec_tokens]})
        orig_propose(sched)
        if dr._drafts is not None:
            records[-1]["drafts"] = dr._drafts.cpu()

    dr.drafter.compute_logits, dr.propose = logits_spy, propose_spy
    return records


_TARGETS: dict = {}


def _float64_target(path: str):
    """transformers' model of the target in float64, loaded once per path (a tiny MoE takes seconds to load)."""
    if path not in _TARGETS:
        from transformers import AutoModelForCausalLM

        # (eager experts: transformers' grouped-GEMM MoE path takes no float64)
        _TARGETS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                              experts_implementation="eager").eval()
    return _TARGETS[path]


def check_block_logits(records: list, target_path: str, drafter_path: str, layer_ids: list[int],
                       mask_token_id: int = 3, tol: float = 1e-4) -> int:
    """Every recorded proposal's logits against reference_block's logits fed by transformers' float64 hidden states
    of the target over each request's tokens before its block (hidden_states[i + 1] for layer i); returns how many
    requests' blocks were checked. The target is causal, so one forward over the longest token list a request had
    gives the hidden states of every shorter prefix of it."""
    checked = 0
    for rec, i, (_, start, k), ref_hidden, ref in _reference_blocks(records, target_path, drafter_path, layer_ids,
                                                                    mask_token_id):
        n = len(rec["rows"])
        got = rec["logits"][[j * n + i for j in range(k)]]
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < tol, f"request {i}, start {start}: relative error {err:.2e}"
        checked += 1
    return checked


def check_block_drafts(records: list, target_path: str, drafter_path: str, layer_ids: list[int], top_k: int,
                       mask_token_id: int = 3) -> tuple[int, int]:
    """Every recorded greedy proposal's drafts against reference_selection over the reference's hidden states and
    logits (a DFlash2 drafter); returns (drafts checked, drafts where the path is not the row's argmax)."""
    w = load_weights(drafter_path)
    checked = off_argmax = 0
    for rec, i, (ids, _, k), ref_hidden, ref in _reference_blocks(records, target_path, drafter_path, layer_ids,
                                                                  mask_token_id):
        path = reference_selection(w, ref_hidden, ref, ids[rec["rows"][i][1]], top_k)
        assert rec["drafts"][:k, i].tolist() == path, f"request {i}: drafts {rec['drafts'][:k, i].tolist()} vs {path}"
        checked += k
        off_argmax += sum(int(a != b) for a, b in zip(path, ref.argmax(-1).tolist()))
    return checked, off_argmax


def _reference_blocks(records: list, target_path: str, drafter_path: str, layer_ids: list[int], mask_token_id: int):
    """(record, request index, its (ids, start, k), reference hidden states, reference logits) of every recorded
    request's block (check_block_logits)."""
    ref_model = _float64_target(target_path)
    w = load_weights(drafter_path)
    windows = layer_windows(drafter_path)
    embed = ref_model.get_input_embeddings().weight.detach()
    head = ref_model.get_output_embeddings().weight.detach()
    longest = sorted({tuple(ids) for rec in records for ids, _, _ in rec["rows"]}, key=len, reverse=True)
    features: dict = {}

    def feats(ids: list[int], start: int) -> torch.Tensor:
        full = next(f for f in longest if f[:start] == tuple(ids[:start]))
        if full not in features:
            with torch.no_grad():
                hs = ref_model(torch.tensor([full]), output_hidden_states=True).hidden_states
            features[full] = torch.cat([hs[layer + 1][0] for layer in layer_ids], dim=-1)
        return features[full][:start]

    for rec in records:
        if not rec["rows"]:
            continue
        n, kmax = len(rec["rows"]), max(k for _, _, k in rec["rows"])
        assert rec["logits"].shape[0] == n * kmax
        for i, (ids, start, k) in enumerate(rec["rows"]):
            ref_hidden, ref = reference_block(w, feats(ids, start), [ids[start]] + [mask_token_id] * k, embed, head,
                                              windows)
            yield rec, i, (ids, start, k), ref_hidden, ref


def zero_lm_head(path: str) -> None:
    """Set the checkpoint's LM head to zeros (every logit 0: greedy picks id 0, sampling is uniform), so a drafter
    using that head always agrees with the target."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    w["lm_head.weight"] = torch.zeros_like(w["lm_head.weight"])
    save_file(w, file, metadata={"format": "pt"})
