"""EAGLE-3 speculation, configuration time: read an EAGLE-3 head's checkpoint and check it against the target.

An EAGLE-3 head (SpecForge, the EAGLE authors' repo, AngelSlim; vLLM's Eagle3LlamaForCausalLM) is one Llama decoder
layer beside the target. For a position i whose next token x_{i+1} is known:

  g_i = fc([a_i | b_i | c_i])      the target's residual stream entering three of its layers, side by side
  y_i = layer(input_layernorm(embed(x_{i+1})) | hidden_norm(g_i)), residual g_i (or hidden_norm(g_i) with
        norm_before_residual), at rotary position i, over its own paged KV cache; its qkv projection reads 2 x hidden
  logits = lm_head(norm(y_i)) over the draft vocabulary, placed at target ids draft_id + d2t[draft_id]

and y_i (before the final norm) stands in for g_{i+1} beside the drafted token at position i + 1 when drafts chain.

Config (a Llama config): architectures LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM (LlamaForCausalLM is renamed
so by vLLM under method eagle3), `draft_vocab_size` (absent: the vocabulary), `target_hidden_size`, the layers read
(`eagle_aux_hidden_state_layer_ids` at the top level or in `eagle_config`, else vLLM's default (2, L // 2, L - 3) of
an L-layer target), `eagle_config.use_aux_hidden_state`, `norm_before_residual`. Layer id j means the residual stream
entering target layer j (Hugging Face's hidden_states[j], the output of layer j - 1); they are concatenated in
ascending layer order, as vLLM's target forward collects them. Weights: fc, midlayer.* (or layers.0.*) with
hidden_norm, norm, lm_head (absent: the target's, for a full-vocabulary head), d2t (int offsets, needed when the draft
vocabulary is smaller; t2d is not read), embed_tokens (absent: the target's embedding).

The speculators format (RedHatAI/*-speculator.eagle3: a `speculators_config`, the layer's config nested in
`transformer_layer_config`) holds the same head under the layers.0.* names; engine/speculators.py reads its config
into these terms.
"""
from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from voltllm.engine.speculative import SpeculativeConfig, SpeculativeConfigError

logger = logging.getLogger("voltllm")

# the architectures vLLM's method eagle3 runs as its Llama EAGLE-3 head (LlamaForCausalLM gets the Eagle3 prefix)
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
# where a checkpoint keeps its decoder layer (the EAGLE repo / SpecForge: midlayer; others: layers.0)
LAYER_PREFIXES = ("midlayer.", "layers.0.")


@dataclass(frozen=True)
class Eagle3Params:
    """What the runner needs of a head beyond its decoder layer's shapes."""
    layer_ids: tuple[int, ...]  # the target layers whose input residual stream is read (vLLM's numbering), ascending
    draft_vocab_size: int
    own_embedding: bool  # embed_tokens in the checkpoint (else the target's)
    own_lm_head: bool  # lm_head in the checkpoint (else the target's)
    has_d2t: bool
    norm_before_residual: bool = False
    logit_scale: float = 1.0

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target's decoder layers whose outputs are those streams (AuxHiddenCapture's numbering)."""
        return tuple(j - 1 for j in self.layer_ids)


def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default choice of an EAGLE-3 head's target layers: low, middle and high."""
    n = num_target_layers
    return (2, n // 2, n - 3)


def _err(msg: str) -> SpeculativeConfigError:
    return SpeculativeConfigError(f"--speculative-config: EAGLE-3 head: {msg}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def layer_name(name: str) -> Optional[str]:
    """A checkpoint tensor's name inside the head's decoder layer ("self_attn.q_proj.weight"), else None."""
    name = name.removeprefix("model.")
    for p in LAYER_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return None


def checkpoint_tensor_names(path: str) -> set[str]:
    """The tensor names of a checkpoint directory (safetensors headers, or a legacy pytorch_model*.bin); a file
    that cannot be read is a ValueError naming it."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    names: set[str] = set()
    if files:
        from safetensors import SafetensorError, safe_open

        for f in files:
            try:
                with safe_open(f, framework="pt", device="cpu") as st:
                    names.update(st.keys())
            except SafetensorError as e:
                raise ValueError(f"{f} is not a readable safetensors file ({e})") from None
        return names
    for f in sorted(glob.glob(os.path.join(path, "pytorch_model*.bin"))):
        names.update(_bin_tensors(f).keys())
    return names


def _bin_tensors(f: str) -> dict:
    """A pytorch_model*.bin's name -> tensor table, read with weights_only (mapped when it is a zip-format file; an
    older pickle-only file is read whole, as the weight loader reads it)."""
    import zipfile

    import torch

    try:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(f))
    except Exception as e:  # (a damaged or foreign file fails in many ways: UnpicklingError, RuntimeError, KeyError..)
        lines = str(e).strip().splitlines() or [""]
        detail = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0]).strip()  # (torch's useful line)
        reason = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
        raise ValueError(f"{f} is not a checkpoint torch.load can read with weights_only (a file of tensors "
                         f"written by torch.save): {reason}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(f"{f} does not hold a table of named tensors (a state dict)")
    return state


def head_layer_ids(draft_cfg: Any, target_cfg: Any) -> tuple[int, ...]:
    """The target layers a head reads (vLLM's numbering: the stream entering each), ascending, from its config alone
    (SpeculativeConfigError, one line); the later pipeline stages ask too, to keep their share of those streams."""
    target_text = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    eagle_cfg = getattr(draft_cfg, "eagle_config", None) or {}
    if not isinstance(eagle_cfg, dict):
        eagle_cfg = {}
    n_target = int(target_text.num_hidden_layers)
    ids = (getattr(draft_cfg, "eagle_aux_hidden_state_layer_ids", None)
           or eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or default_layer_ids(n_target))
    if (not isinstance(ids, (list, tuple)) or not all(_int(i) and 1 <= i < n_target for i in ids)
            or len(set(ids)) != len(ids)):
        raise _err(f"target layers {list(ids) if isinstance(ids, (list, tuple)) else ids!r} must be distinct layer "
                   f"ids 1..{n_target - 1} of the target (the stream entering each; 0, the embedding, is not read)"
                   + (" - vLLM's default (2, L // 2, L - 3) needs a target of 7 layers or more; name them in "
                      "eagle_aux_hidden_state_layer_ids" if n_target < 7 else ""))
    return tuple(sorted(ids))


def eagle3_params(draft_cfg: Any, target_cfg: Any, names: set[str]) -> Eagle3Params:
    """The head's parameters, checked against the target and the checkpoint's tensor names (SpeculativeConfigError,
    one line)."""
    archs = list(getattr(draft_cfg, "architectures", None) or [])
    if any(a.startswith("Eagle") and not a.startswith("Eagle3") for a in archs):
        raise _err(f"architectures {archs} is an EAGLE-1 head: use method \"eagle\"")
    if not any(a in ARCHITECTURES for a in archs):
        raise _err(f"architectures {archs} is not an EAGLE-3 Llama head (expected one of {', '.join(ARCHITECTURES)})")
    target_text = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    t_hidden = int(target_text.hidden_size)
    hidden = int(draft_cfg.hidden_size)
    if hidden != t_hidden:
        raise _err(f"hidden size {hidden} differs from the target's {t_hidden} (its embedding and the target's "
                   "hidden states share one width here)")
    th = getattr(draft_cfg, "target_hidden_size", None)
    if th is not None and int(th) != t_hidden:
        raise _err(f"made for a target of hidden size {th}, this target's is {t_hidden}")
    t_vocab = int(target_text.vocab_size)
    vocab = int(getattr(draft_cfg, "vocab_size", t_vocab) or t_vocab)
    if vocab != t_vocab:
        raise _err(f"vocabulary of {vocab} ids differs from the target's {t_vocab}")
    draft_vocab = getattr(draft_cfg, "draft_vocab_size", None) or vocab
    if not _int(draft_vocab) or not 1 <= draft_vocab <= vocab:
        raise _err(f"draft_vocab_size {draft_vocab!r} must be in 1..{vocab}")
    n = getattr(draft_cfg, "num_hidden_layers", 1)
    if n != 1:
        raise _err(f"num_hidden_layers {n}: only one-layer heads are built")
    eagle_cfg = getattr(draft_cfg, "eagle_config", None) or {}
    if not isinstance(eagle_cfg, dict):
        eagle_cfg = {}
    if eagle_cfg.get("use_aux_hidden_state", True) is False:
        raise _err("eagle_config.use_aux_hidden_state is false (a head fed the target's last hidden state only) is "
                   "not built")
    if getattr(draft_cfg, "parallel_drafting", False):
        raise _err("parallel drafting heads (mask_hidden) are not built")
    layer_names = {layer_name(k) for k in names} - {None}
    stripped = {k.removeprefix("model.") for k in names}
    if "fc.weight" not in stripped or "hidden_norm.weight" not in layer_names:
        raise _err("the checkpoint has no fc.weight or no midlayer.hidden_norm.weight: not an EAGLE-3 head" + (
            " (an EAGLE-1 head's layout: use method \"eagle\")" if "fc.weight" in stripped else ""))
    ids = head_layer_ids(draft_cfg, target_text)
    has_d2t = "d2t" in stripped
    if draft_vocab != vocab and not has_d2t:
        raise _err(f"its draft vocabulary ({draft_vocab} ids) is smaller than the target's ({vocab}) but the "
                   "checkpoint has no d2t tensor mapping draft ids to target ids")
    own_head = "lm_head.weight" in stripped
    if not own_head and draft_vocab != vocab:
        raise _err("the checkpoint has no lm_head.weight and its draft vocabulary is not the target's (the target's "
                   "head cannot stand in)")
    scale = getattr(draft_cfg, "logit_scale", None)
    return Eagle3Params(ids, int(draft_vocab), "embed_tokens.weight" in stripped, own_head, has_d2t,
                        bool(getattr(draft_cfg, "norm_before_residual", False)), float(scale or 1.0))


def _has(path: str, pattern: str) -> bool:
    return bool(glob.glob(os.path.join(path, pattern)))


def resolve_head(model: str, revision: Optional[str], download_dir: Optional[str], token: Any) -> Any:
    """The head's ModelSource: a local path as --model resolves one, or a Hub repo fetched with its safetensors
    weights, else its pytorch_model*.bin (the EAGLE authors' heads are published so; a .bin is read with torch.load's
    weights_only)."""
    from voltllm.model.loader import ModelLoadError, ModelSource, hub, resolve_model

    if not hub.looks_like_repo_id(model):
        return resolve_model(model, revision, download_dir, token, False)
    path = hub.fetch_repo(model, revision, download_dir, token, patterns=["*.json", "*.safetensors"])
    bins = ["*.json", "pytorch_model*.bin"]
    if not _has(path, "*.safetensors"):
        path = hub.fetch_repo(model, revision, download_dir, token, patterns=bins)
        if not _has(path, "pytorch_model*.bin"):  # a cached snapshot without them: fetch them
            path = hub.fetch_repo(model, revision, download_dir, token, patterns=bins, offline_first=False)
    if not os.path.isfile(os.path.join(path, "config.json")) or not (
            _has(path, "*.safetensors") or _has(path, "pytorch_model*.bin")):
        raise ModelLoadError(f"Hugging Face repo {model} has no config.json with safetensors or pytorch_model.bin "
                             "weights")
    return ModelSource(path=path, kind="hf")


def resolve_eagle3(spec: SpeculativeConfig, target_hf_config: Any, download_dir: Optional[str] = None,
                   token: Any = None) -> SpeculativeConfig:
    """spec with the head's local path and HF config, after the checks of eagle3_params."""
    from voltllm.engine import speculators
    from voltllm.model.loader import ModelLoadError, load_hf_config

    try:
        source = resolve_head(spec.model, spec.revision, download_dir, token)
        if source.kind == "gguf":
            raise ValueError("a GGUF file is not an EAGLE-3 checkpoint (config.json + weights)")
        speculators_cfg = speculators.read_config(source.path)
        if speculators_cfg is None:
            hf_config = load_hf_config(source, trust_remote_code=False)  # a Llama config with EAGLE keys
        names = checkpoint_tensor_names(source.path)
    except (ModelLoadError, OSError, ValueError) as e:
        raise _err(f"cannot load {spec.model!r}: {e}") from None
    if speculators_cfg is not None:  # the same head in the speculators format (engine/speculators.py)
        if (problem := speculators.eagle3_problem(speculators_cfg)) is not None:
            raise _err(problem)
        try:
            hf_config = speculators.draft_config(speculators_cfg)
        except SpeculativeConfigError as e:
            raise _err(str(e)) from None
    params = eagle3_params(hf_config, target_hf_config, names)
    logger.info("EAGLE-3 head %s: target layers %s, draft vocabulary %d%s", source.path, list(params.layer_ids),
                params.draft_vocab_size, "" if params.own_embedding else ", the target's embedding")
    return spec.with_draft(source.path, hf_config)
