"""EAGLE-3 heads in the speculators format (the `speculators` library's checkpoints, e.g. RedHatAI/*-speculator.eagle3),
read as vLLM reads them and mapped onto the head of engine/eagle3.py.

A checkpoint is in this format when its config.json has a `speculators_config` (vLLM's test). That config has no
model_type of its own:

  speculators_model_type   "eagle3" (built); "eagle" (EAGLE-1 / HASS), "peagle" (parallel drafting) and the rest are
                           refused by name
  transformer_layer_config the decoder layer's Llama config (hidden_size, heads, head_dim, intermediate_size, rope,
                           rms_norm_eps, vocab_size = the target's vocabulary, num_hidden_layers); a qwen3 layer (with
                           QK-norm) is refused: the head's layer is built as a Llama layer only
  draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids (vLLM's numbering, as the other layouts)
  norm_before_residual     absent: true (vLLM's default for this format; the other layouts default to false)
  norm_before_fc, fc_norm, norm_output   later opt-in norms: refused when on (not built)
  speculators_config       proposal_methods[i].speculative_tokens (the default num_speculative_tokens: the entry
                           named by default_proposal_method, else the first) and verifier.name_or_path (the target)

Weights: fc, layers.0.* (with hidden_norm), norm, lm_head, embed_tokens (the verifier's, saved with the head), d2t
(offsets) and t2d: the names the other layouts use (model/models/eagle3.py reads them); verifier_norm /
verifier_lm_head (the training targets, which current versions do not save) are skipped.

As vLLM does: `--speculative-config '{"model": HEAD}'` without a method detects the format, and `--model HEAD` serves
the verifier the config names with the head attached (speculative_config_for_model).
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from voltllm.engine.speculative import SpeculativeConfigError

# tensors a speculators checkpoint may hold that are not part of the head (the verifier's norm / LM head, the
# targets of its training)
TRAINING_ONLY_TENSORS = ("verifier_norm.weight", "verifier_lm_head.weight")

_REFUSED_TYPES = {
    "eagle": "an EAGLE-1 / HASS head (speculators_model_type \"eagle\"): only EAGLE-3 heads are built",
    "peagle": "a parallel-drafting EAGLE head (speculators_model_type \"peagle\", P-EAGLE): parallel drafting is "
              "not built",
}
# later opt-in norms of the format, each refused when on
_UNBUILT_NORMS = {
    "norm_before_fc": "an RMSNorm over the fused target states before fc",
    "fc_norm": "an RMSNorm per target layer's state before fc",
    "norm_output": "the head's normed output fed back to chained drafts",
}


def read_config(path: str) -> Optional[dict]:
    """A checkpoint directory's config.json when it is in the speculators format, else None (also when there is no
    readable config.json: the regular loader says what is wrong with it)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and cfg.get("speculators_config") is not None else None


def probe(model: Optional[str], revision: Optional[str], download_dir: Optional[str], token: Any,
          trust_remote_code: bool = False) -> Optional[dict]:
    """The speculators config of a --model / "model" value, else None: also when it cannot be read, as vLLM's probe
    (the regular path then reports it). A Hub repo id is fetched as resolve_model fetches a model (the same files:
    a snapshot holding fewer would be taken from the cache later as if complete)."""
    from voltllm.model.loader import ModelLoadError, hub

    if not model or hub.gguf_quant_ref(model) is not None:
        return None
    if hub.looks_like_repo_id(model):
        try:
            return read_config(hub.fetch_repo(model, revision, download_dir, token, trust_remote_code))
        except ModelLoadError:
            return None
    path = os.path.expanduser(model)
    return read_config(path) if os.path.isdir(path) else None


def eagle3_problem(cfg: dict) -> Optional[str]:
    """Why a speculators config is not an EAGLE-3 head built here (one line), else None."""
    kind = cfg.get("speculators_model_type")
    if kind != "eagle3":
        return _REFUSED_TYPES.get(kind, f"speculators_model_type {kind!r} is not read (only \"eagle3\" heads are "
                                        "built)")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return "the speculators config has no transformer_layer_config object (the head's decoder layer)"
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        return (f"transformer_layer_config model_type {model_type!r}: the head's decoder layer is built as a Llama "
                "layer only (no QK-norm)")
    for key, what in _UNBUILT_NORMS.items():
        if cfg.get(key):
            return f"{key} ({what}) is not built"
    return None


def draft_config(cfg: dict) -> Any:
    """The head's HF config in the other layouts' terms (engine/eagle3.py): the layer's Llama config plus the
    EAGLE-3 fields, as vLLM's speculators config adapter builds it. cfg: an eagle3 config eagle3_problem passed."""
    from transformers import LlamaConfig

    layer = {k: v for k, v in cfg["transformer_layer_config"].items() if k not in ("model_type", "architectures")}
    try:
        hf = LlamaConfig(**layer)
    except (TypeError, ValueError) as e:
        raise SpeculativeConfigError(f"its transformer_layer_config is not a Llama config transformers reads: "
                                     f"{e}") from None
    hf.architectures = ["Eagle3LlamaForCausalLM"]
    hf.draft_vocab_size = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        hf.target_hidden_size = cfg["target_hidden_size"]
    hf.norm_before_residual = bool(cfg.get("norm_before_residual", True))
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        hf.eagle_aux_hidden_state_layer_ids = cfg["eagle_aux_hidden_state_layer_ids"]
    return hf


def proposal_tokens(cfg: dict) -> int:
    """The drafts per step the head was made for (a SpeculativeConfigError when the config does not say)."""
    spec = cfg.get("speculators_config")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    if not isinstance(methods, list) or not methods or not all(isinstance(m, dict) for m in methods):
        raise SpeculativeConfigError("its speculators_config has no proposal_methods: give num_speculative_tokens")
    chosen = next((m for m in methods if m.get("proposal_type") == spec.get("default_proposal_method")), methods[0])
    k = chosen.get("speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool):
        raise SpeculativeConfigError(f"its proposal method {chosen.get('proposal_type')!r} has no integer "
                                     "speculative_tokens: give num_speculative_tokens")
    return k


def verifier(cfg: dict) -> str:
    """The target model the head was made for (speculators_config.verifier.name_or_path)."""
    spec = cfg.get("speculators_config")
    ver = spec.get("verifier") if isinstance(spec, dict) else None
    name = ver.get("name_or_path") if isinstance(ver, dict) else None
    if not isinstance(name, str) or not name:
        raise SpeculativeConfigError("its speculators_config names no verifier (verifier.name_or_path)")
    return name


def detect(spec: dict, download_dir: Optional[str], token: Any, trust_remote_code: bool = False) -> dict:
    """--speculative-config with a speculators head as "model": method eagle3 when no method is given (vLLM's
    detection), and num_speculative_tokens from the head's config when not given. Other configs: unchanged."""
    method = spec.get("method")
    if not isinstance(spec.get("model"), str) or not (
            method in (None, "") or method == "eagle3" and spec.get("num_speculative_tokens") is None):
        return spec  # (method eagle3 with its drafts given: resolve_eagle3 reads either layout)
    cfg = probe(spec["model"], spec.get("revision"), download_dir, token, trust_remote_code)  # (a draft model's
    # fetch: resolve_draft's files)
    if cfg is None:
        return spec
    problem = eagle3_problem(cfg)
    if problem is not None:
        raise SpeculativeConfigError(f"--speculative-config: {spec['model']} is {_article(problem)}")
    spec = {**spec, "method": "eagle3"}
    if spec.get("num_speculative_tokens") is None:
        try:
            spec["num_speculative_tokens"] = proposal_tokens(cfg)
        except SpeculativeConfigError as e:
            raise SpeculativeConfigError(f"--speculative-config: speculators head {spec['model']}: {e}") from None
    return spec


def speculative_config_for_model(cfg: dict, head: str, revision: Optional[str], user: Optional[dict]) -> dict:
    """--speculative-config for `--model HEAD` (a speculators checkpoint): method eagle3, the head's drafts per
    step, then the user's keys over them; "method" and "model" stay the head's (as vLLM locks them)."""
    problem = eagle3_problem(cfg)
    if problem is not None:
        raise SpeculativeConfigError(f"--model {head} is {_article(problem)}")
    spec: dict = {"method": "eagle3"}
    if not (user and user.get("num_speculative_tokens") is not None):
        try:
            spec["num_speculative_tokens"] = proposal_tokens(cfg)
        except SpeculativeConfigError as e:
            raise SpeculativeConfigError(f"--model {head} (a speculators head): {e} in --speculative-config") from None
    if revision is not None:
        spec["revision"] = revision  # (--revision names the head's; the verifier is read at its default)
    spec.update(user or {})
    spec.update(method="eagle3", model=head)
    return spec


def _article(problem: str) -> str:
    """A problem line after "X is ...": the refusals of a head kind read as such, the rest as a speculators head's."""
    return problem if problem.startswith(("an ", "a ")) else f"a speculators head: {problem}"
