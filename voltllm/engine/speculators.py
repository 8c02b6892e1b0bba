"""EAGLE-3 and EAGLE-1 heads in the speculators format (the `speculators` library's checkpoints, e.g.
RedHatAI/*-speculator.eagle3), read as vLLM reads them and mapped onto the heads of engine/eagle3.py and
engine/eagle1.py (an EAGLE-1 / HASS head, speculators_model_type "eagle": eagle1_problem, eagle1_name).

A checkpoint is in this format when its config.json has a `speculators_config` (vLLM's test). That config has no
model_type of its own:

  speculators_model_type   "eagle3" and "eagle" (EAGLE-1 / HASS) built; "peagle" (parallel drafting) and the rest
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


# speculators_model_type -> the --speculative-config method that drafts with such a head
METHODS = {"eagle3": "eagle3", "eagle": "eagle"}


def head_method(cfg: dict) -> Optional[str]:
    """The method of a speculators head (METHODS), None for a kind not built."""
    return METHODS.get(cfg.get("speculators_model_type"))


def head_problem(cfg: dict) -> Optional[str]:
    """Why a speculators config is not a head built here (one line), else None."""
    return eagle1_problem(cfg) if head_method(cfg) == "eagle" else eagle3_problem(cfg)


def _layer_problem(cfg: dict) -> Optional[str]:
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return "the speculators config has no transformer_layer_config object (the head's decoder layer)"
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        return (f"transformer_layer_config model_type {model_type!r}: the head's decoder layer is built as a Llama "
                "layer only (no QK-norm)")
    return None


def eagle3_problem(cfg: dict) -> Optional[str]:
    """Why a speculators config is not an EAGLE-3 head built here (one line), else None."""
    kind = cfg.get("speculators_model_type")
    if kind == "eagle":
        return "an EAGLE-1 / HASS head (speculators_model_type \"eagle\"): use method \"eagle\""
    if kind != "eagle3":
        return _REFUSED_TYPES.get(kind, f"speculators_model_type {kind!r} is not read (\"eagle3\" and \"eagle\" "
                                        "heads are built)")
    if (problem := _layer_problem(cfg)) is not None:
        return problem
    for key, what in _UNBUILT_NORMS.items():
        if cfg.get(key):
            return f"{key} ({what}) is not built"
    return None


def eagle1_problem(cfg: dict) -> Optional[str]:
    """Why a speculators config is not an EAGLE-1 / HASS head built here (one line), else None. The format's head:
    `fusion_fc` over [embedding | the verifier's hidden state] (its bias when `fusion_bias`), one Llama decoder layer
    `transformer.*` without its input norm, the verifier's LM head; `layernorms` (an embedding norm, the layer's
    input norm and a norm before the LM head) is refused."""
    kind = cfg.get("speculators_model_type")
    if kind == "eagle3":
        return "an EAGLE-3 head (speculators_model_type \"eagle3\"): use method \"eagle3\""
    if kind != "eagle":
        return _REFUSED_TYPES.get(kind, f"speculators_model_type {kind!r} is not an EAGLE-1 head")
    arch = cfg.get("transformer_layer_architecture", "LlamaDecoderLayer")
    if arch != "LlamaDecoderLayer":
        return f"transformer_layer_architecture {arch!r}: the head's layer is built as a LlamaDecoderLayer only"
    if (problem := _layer_problem(cfg)) is not None:
        return problem
    if cfg.get("layernorms"):
        return ("layernorms (its variant's embedding, layer-input and pre-LM-head norms) is not built: heads without "
                "them are read")
    return None


# an EAGLE-1 head's tensor names in the speculators format -> the EAGLE repo's (model/models/eagle1.py reads these)
_EAGLE1_RENAMES = (("fusion_fc.", "fc."), ("transformer.", "layers.0."))


def eagle1_name(name: str) -> str:
    """A tensor name of either EAGLE-1 layout in the EAGLE repo's terms (the speculators format's fusion_fc /
    transformer are fc / layers.0)."""
    for old, new in _EAGLE1_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def eagle1_draft_config(cfg: dict) -> Any:
    """An EAGLE-1 speculators head's HF config in the EAGLE repo's terms (engine/eagle1.py): its layer's Llama config,
    one layer. cfg: a config eagle1_problem passed."""
    hf = _layer_config(cfg)
    hf.architectures = ["EagleLlamaForCausalLM"]
    hf.num_hidden_layers = 1
    return hf


def _layer_config(cfg: dict) -> Any:
    """The head's decoder layer as a transformers LlamaConfig (transformer_layer_config)."""
    from transformers import LlamaConfig

    layer = {k: v for k, v in cfg["transformer_layer_config"].items() if k not in ("model_type", "architectures")}
    try:
        return LlamaConfig(**layer)
    except (TypeError, ValueError) as e:
        raise SpeculativeConfigError(f"its transformer_layer_config is not a Llama config transformers reads: "
                                     f"{e}") from None


def draft_config(cfg: dict) -> Any:
    """The head's HF config in the other layouts' terms (engine/eagle3.py): the layer's Llama config plus the
    EAGLE-3 fields, as vLLM's speculators config adapter builds it. cfg: an eagle3 config eagle3_problem passed."""
    hf = _layer_config(cfg)
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
            method in (None, "") or method in METHODS.values() and spec.get("num_speculative_tokens") is None):
        return spec  # (method eagle3 / eagle with its drafts given: their resolve reads either layout)
    cfg = probe(spec["model"], spec.get("revision"), download_dir, token, trust_remote_code)  # (a draft model's
    # fetch: resolve_draft's files)
    if cfg is None:
        return spec
    found = head_method(cfg)
    if method and found and method != found:
        return spec  # (the method's resolve names the right one)
    problem = head_problem(cfg)
    if problem is not None:
        raise SpeculativeConfigError(f"--speculative-config: {spec['model']} is {article(problem)}")
    spec = {**spec, "method": found}
    if spec.get("num_speculative_tokens") is None:
        try:
            spec["num_speculative_tokens"] = proposal_tokens(cfg)
        except SpeculativeConfigError as e:
            raise SpeculativeConfigError(f"--speculative-config: speculators head {spec['model']}: {e}") from None
    return spec


def speculative_config_for_model(cfg: dict, head: str, revision: Optional[str], user: Optional[dict]) -> dict:
    """--speculative-config for `--model HEAD` (a speculators checkpoint): its method (eagle3, eagle), the head's
    drafts per step, then the user's keys over them; "method" and "model" stay the head's (as vLLM locks them)."""
    problem = head_problem(cfg)
    if problem is not None:
        raise SpeculativeConfigError(f"--model {head} is {article(problem)}")
    method = head_method(cfg)
    spec: dict = {"method": method}
    if not (user and user.get("num_speculative_tokens") is not None):
        try:
            spec["num_speculative_tokens"] = proposal_tokens(cfg)
        except SpeculativeConfigError as e:
            raise SpeculativeConfigError(f"--model {head} (a speculators head): {e} in --speculative-config") from None
    if revision is not None:
        spec["revision"] = revision  # (--revision names the head's; the verifier is read at its default)
    spec.update(user or {})
    spec.update(method=method, model=head)
    return spec


def article(problem: str) -> str:
    """A problem line after "X is ...": the refusals of a head kind read as such, the rest as a speculators head's."""
    return problem if problem.startswith(("an ", "a ")) else f"a speculators head: {problem}"
