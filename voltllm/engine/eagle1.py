"""EAGLE-1 speculation, configuration time: read an EAGLE-1 head's checkpoint and check it against the target.

An EAGLE-1 head (the EAGLE authors' first heads, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B or yuhuili/EAGLE-Qwen2-7B-
Instruct, and HASS heads; vLLM's EagleLlamaForCausalLM under method "eagle") is one or a few decoder layers of the
target's family beside it. For a position i whose next token x_{i+1} is known:

  x   = fc([embed(x_{i+1}) | f_i])    f_i: the target's last hidden state at i, after its final norm (what its LM head
                                      reads); a HASS head (add_para_norm) RMS-norms each side first
  y_i = the head's layers over x, causal, RoPE at i, over their own paged KV cache; the first layer has no input
        norm (the EAGLE code leaves it out), so x enters its attention as it is and is its residual
  logits = the target's LM head (y_i) x logit_scale   (no final norm: the head regresses the target's features)

and y_i stands in for f_{i+1} beside the drafted token at position i + 1 when drafts chain, as MTP chains its layer
(worker/mtp_runner.py, whose runner drafts for it). The embedding and LM head are the target's (an embedding the
checkpoint carries is a copy of it and is not read, as vLLM does).

Config: a Llama or Qwen2 config (architectures EagleLlamaForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM or
EagleQwen2ForCausalLM; model_type llama / qwen2: the layers' kind, Qwen2's with q / k / v biases) of the target's
width and vocabulary. Weights: fc.weight [hidden, 2 x hidden] (and fc.bias, which the EAGLE code's fc has), layers.*
(layer 0 without input_layernorm), embedding_layernorm / hidden_states_layernorm for HASS. A checkpoint with a
hidden_norm (an EAGLE-3 head) is pointed at method eagle3. The speculators format's EAGLE-1 heads
(speculators_model_type "eagle": fusion_fc, transformer.*; engine/speculators.py) are the same head under other names.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from voltllm.engine.speculative import SpeculativeConfig, SpeculativeConfigError, check_width_and_vocab

logger = logging.getLogger("voltllm")

ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLM", "EagleQwen2ForCausalLM", "Qwen2ForCausalLM")
LAYER_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class Eagle1Params:
    """What the drafter needs of a head beyond its layers' shapes."""
    num_layers: int
    fc_bias: bool  # fc.bias in the checkpoint
    para_norm: bool  # HASS: both fc inputs RMS-normed (add_para_norm)
    logit_scale: float = 1.0


def _err(msg: str) -> SpeculativeConfigError:
    return SpeculativeConfigError(f"--speculative-config: EAGLE-1 head: {msg}")


def eagle1_params(draft_cfg: Any, target_cfg: Any, names: set[str]) -> Eagle1Params:
    """The head's parameters, checked against the target and the checkpoint's tensor names (SpeculativeConfigError,
    one line)."""
    archs = list(getattr(draft_cfg, "architectures", None) or [])
    if any("Eagle3" in a for a in archs):
        raise _err(f"architectures {archs} is an EAGLE-3 head: use method \"eagle3\"")
    if not any(a in ARCHITECTURES for a in archs):
        raise _err(f"architectures {archs} is not an EAGLE-1 head (expected one of {', '.join(ARCHITECTURES)})")
    kind = getattr(draft_cfg, "model_type", None)
    if kind not in LAYER_TYPES:
        raise _err(f"model_type {kind!r}: heads of {' / '.join(LAYER_TYPES)} layers are built")
    check_width_and_vocab(draft_cfg, target_cfg, _err)
    n = getattr(draft_cfg, "num_hidden_layers", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise _err(f"num_hidden_layers {n!r} must be a positive integer")
    stripped = {k.removeprefix("model.") for k in names}
    if any(k.startswith("midlayer.") or k.endswith(".hidden_norm.weight") for k in stripped) or "d2t" in stripped:
        raise _err("the checkpoint has an EAGLE-3 head's tensors (midlayer / hidden_norm / d2t): use method "
                   "\"eagle3\"")
    if "fc.weight" not in stripped:
        raise _err("the checkpoint has no fc.weight: not an EAGLE head")
    deeper = sorted({int(k.split(".")[1]) for k in stripped if k.startswith("layers.") and k.split(".")[1].isdigit()
                     and int(k.split(".")[1]) >= n})
    if deeper:
        raise _err(f"the checkpoint has layers.{deeper[0]}.* past its num_hidden_layers ({n}): a whole model, not a "
                   "head?")
    para = bool(getattr(draft_cfg, "add_para_norm", False))
    if para and not {"embedding_layernorm.weight", "hidden_states_layernorm.weight"} <= stripped:
        raise _err("add_para_norm is set but the checkpoint has no embedding_layernorm / hidden_states_layernorm")
    scale = getattr(draft_cfg, "logit_scale", None)
    return Eagle1Params(n, "fc.bias" in stripped, para, float(scale or 1.0))


def head_tensor_names(path: str) -> set[str]:
    """A head checkpoint's tensor names in the EAGLE repo's terms (a speculators-format one's renamed)."""
    from voltllm.engine.eagle3 import checkpoint_tensor_names
    from voltllm.engine.speculators import eagle1_name

    return {eagle1_name(n) for n in checkpoint_tensor_names(path)}


def resolve_eagle1(spec: SpeculativeConfig, target_hf_config: Any, download_dir: Optional[str] = None,
                   token: Any = None) -> SpeculativeConfig:
    """spec with the head's local path and HF config, after the checks of eagle1_params."""
    from voltllm.engine import speculators
    from voltllm.engine.eagle3 import resolve_head
    from voltllm.model.loader import ModelLoadError, load_hf_config

    try:
        source = resolve_head(spec.model, spec.revision, download_dir, token)
        if source.kind == "gguf":
            raise ValueError("a GGUF file is not an EAGLE checkpoint (config.json + weights)")
        speculators_cfg = speculators.read_config(source.path)
        if speculators_cfg is None:
            hf_config = load_hf_config(source, trust_remote_code=False)  # a Llama / Qwen2 config
        names = head_tensor_names(source.path)
    except (ModelLoadError, OSError, ValueError) as e:
        raise _err(f"cannot load {spec.model!r}: {e}") from None
    if speculators_cfg is not None:  # the same head in the speculators format (engine/speculators.py)
        if (problem := speculators.eagle1_problem(speculators_cfg)) is not None:
            raise _err(f"{spec.model} is {speculators.article(problem)}")
        hf_config = speculators.eagle1_draft_config(speculators_cfg)
    params = eagle1_params(hf_config, target_hf_config, names)
    logger.info("EAGLE-1 head %s: %d %s layer(s)%s%s", source.path, params.num_layers, hf_config.model_type,
                ", fc bias" if params.fc_bias else "", ", HASS norms" if params.para_norm else "")
    return spec.with_draft(source.path, hf_config)
