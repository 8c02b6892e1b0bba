"""DFlash speculation, configuration time: read a DFlash drafter's checkpoint config and check it against the target.

A DFlash drafter (z-lab, "Block Diffusion for Flash Speculative Decoding") is a few Qwen3-style decoder layers that
draft a whole block in one forward: the block is the last known token followed by mask tokens, its rows attend to
each other without a causal mask and to a context made of the target's hidden states. Those come from the outputs
of the target's decoder layers `target_layer_ids`, concatenated per token, projected by `fc` and normed by
`hidden_norm`; every drafter layer makes its context K / V from that one projected vector with its own k / v
projections. The drafter has no embedding and no LM head of its own: it uses the target's.

Its config.json is a Qwen3 config (model_type "qwen3", architectures ["DFlashDraftModel"]) with `dflash_config`
{"mask_token_id", "target_layer_ids", and in newer checkpoints "block_size"}; older ones keep `block_size` at the
top level, and one without target_layer_ids spreads its layers over the target's (`default_target_layer_ids`).

DFlash2 (architectures ["DFlash2DraftModel"]) is the same drafter with two additions, each with its own keys in
`dflash_config` (or at the top level): a grouped dynamic causal convolution over the block's rows before and after
every attention and MLP sublayer (`conv_kernel_size` taps, one dynamic weight per `conv_group_size` channels), and a
candidate selector that walks the block's positions choosing among each row's `selector_top_k` best tokens with a
bigram score of rank `selector_rank` (model/models/dflash2_layers.py).

Sliding-window drafter layers (Qwen3.6's drafters: `layer_types` of "sliding_attention" and "full_attention" with a
`sliding_window`), as the z-lab reference runs them: a block row at position p sees the context from p - window + 1
on and the whole block; the window is the config's as transformers reads it (none while `use_sliding_window` is off,
as in the reference, where such layers then attend to the whole context).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from voltllm.engine.speculative import SpeculativeConfig, SpeculativeConfigError, check_width_and_vocab
from voltllm.model.sliding_window import layer_window, model_window

logger = logging.getLogger("voltllm")

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_V2 = "DFlash2DraftModel"


@dataclass(frozen=True)
class DFlash2Params:
    """A DFlash2 drafter's additions: its convolutions' taps and channel groups, its selector's rank and width."""
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


@dataclass(frozen=True)
class DFlashParams:
    """What the runner needs of a drafter beyond its decoder layers' shapes."""
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    # optional scalars of newer checkpoints (1.0 / None: absent): the block's input embeddings and its logits
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    v2: Optional[DFlash2Params] = None  # a DFlash2 drafter's (None: DFlash)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layers a drafter without `target_layer_ids` reads (the public code's default): one per drafter layer,
    evenly spread from layer 1 to layer num_target_layers - 3; the middle one for a one-layer drafter."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _value(cfg: Any, name: str) -> Any:
    """A DFlash key: in `dflash_config` first, then at the top level (older checkpoints)."""
    sub = getattr(cfg, "dflash_config", None) or {}
    return sub[name] if name in sub else getattr(cfg, name, None)


def _err(msg: str) -> SpeculativeConfigError:
    return SpeculativeConfigError(f"--speculative-config: DFlash drafter: {msg}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def dflash_params(draft_cfg: Any, target_cfg: Any, k: int) -> DFlashParams:
    """The drafter's DFlash parameters, checked against the target and K (SpeculativeConfigError, one line)."""
    archs = list(getattr(draft_cfg, "architectures", None) or [])
    if ARCHITECTURE not in archs and ARCHITECTURE_V2 not in archs:
        raise _err(f"architectures {archs} is neither [{ARCHITECTURE!r}] nor [{ARCHITECTURE_V2!r}]")
    target_text = check_width_and_vocab(draft_cfg, target_cfg, _err)
    hidden, t_vocab = int(draft_cfg.hidden_size), int(target_text.vocab_size)
    n_target = int(target_text.num_hidden_layers)
    trained_on = getattr(draft_cfg, "num_target_layers", None)
    if trained_on is not None and int(trained_on) != n_target:
        raise _err(f"made for a target of {trained_on} layers, this target has {n_target}")
    ids = _value(draft_cfg, "target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(n_target, int(draft_cfg.num_hidden_layers))
    if not isinstance(ids, (list, tuple)) or not ids or not all(_int(i) and 0 <= i < n_target for i in ids):
        raise _err(f"target_layer_ids {ids!r} must be layer indices of the target (0..{n_target - 1})")
    mask = _value(draft_cfg, "mask_token_id")
    if mask is None:
        raise _err("its config has no dflash_config.mask_token_id (the token that fills the block's draft slots)")
    if not _int(mask) or not 0 <= mask < t_vocab:
        raise _err(f"mask_token_id {mask!r} is not a token id of the target (0..{t_vocab - 1})")
    block = _value(draft_cfg, "block_size")
    if not _int(block) or block < 2:
        raise _err(f"block_size {block!r} must be an integer >= 2")
    if k > block - 1:
        raise _err(f"num_speculative_tokens {k} exceeds block_size - 1 = {block - 1} (one forward drafts the block "
                   "after the known token)")
    if getattr(draft_cfg, "is_causal", None):
        raise _err("is_causal is set: only the non-causal block attention is built")
    types = getattr(draft_cfg, "layer_types", None) or []
    if any(t not in ("full_attention", "sliding_attention") for t in types):
        raise _err(f"layer types {draft_cfg.layer_types}: only full_attention and sliding_attention layers are built")
    window = model_window(draft_cfg)
    if window is not None and window < block:  # (so every row sees the whole block, whatever its side)
        raise _err(f"sliding_window {window} is shorter than block_size {block}")
    softcap = _value(draft_cfg, "final_logit_softcapping")
    v2 = _v2_params(draft_cfg, hidden, t_vocab) if ARCHITECTURE_V2 in archs else None
    return DFlashParams(block, mask, tuple(ids), float(_value(draft_cfg, "input_embedding_scale") or 1.0),
                        float(_value(draft_cfg, "output_multiplier") or 1.0),
                        float(softcap) if softcap else None, v2)


def _v2_params(draft_cfg: Any, hidden: int, vocab: int) -> DFlash2Params:
    """A DFlash2 drafter's convolution and selector sizes, each present and in range."""
    vals = {}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        v = _value(draft_cfg, name)
        if not _int(v) or v < 1:
            raise _err(f"DFlash2 needs a positive integer {name} in dflash_config (got {v!r})")
        vals[name] = v
    if hidden % vals["conv_group_size"]:
        raise _err(f"conv_group_size {vals['conv_group_size']} does not divide the hidden size {hidden}")
    if vals["selector_top_k"] > vocab:
        raise _err(f"selector_top_k {vals['selector_top_k']} exceeds the vocabulary ({vocab} ids)")
    return DFlash2Params(**vals)


def resolve_dflash(spec: SpeculativeConfig, target_hf_config: Any, download_dir: Optional[str] = None,
                   token: Any = None, trust_remote_code: bool = False) -> SpeculativeConfig:
    """spec with the drafter's local path and HF config, after the checks of dflash_params."""
    from voltllm.model.loader import ModelLoadError, load_hf_config, resolve_model

    try:
        source = resolve_model(spec.model, spec.revision, download_dir, token, trust_remote_code)
        if source.kind == "gguf":
            raise ValueError("a GGUF file is not a DFlash checkpoint (safetensors + config.json)")
        hf_config = load_hf_config(source, trust_remote_code=False)  # a Qwen3 config with DFlash keys: no remote code
    except (ModelLoadError, OSError, ValueError) as e:
        raise _err(f"cannot load {spec.model!r}: {e}") from None
    params = dflash_params(hf_config, target_hf_config, spec.num_speculative_tokens)
    window = model_window(hf_config)
    slides = [i for i in range(hf_config.num_hidden_layers) if layer_window(hf_config, i)]
    logger.info("DFlash%s drafter %s: %d layers, block %d, target layers %s, mask token %d%s%s",
                "2" if params.v2 else "", source.path, hf_config.num_hidden_layers, params.block_size,
                list(params.target_layer_ids), params.mask_token_id, f", {params.v2}" if params.v2 else "",
                f", sliding window {window} in layers {slides}" if window else "")
    if not window and "sliding_attention" in (getattr(hf_config, "layer_types", None) or []):
        logger.warning("DFlash drafter %s lists sliding_attention layers but its config has no sliding window (off "
                       "while use_sliding_window is false): they attend to the whole context, as in transformers",
                       source.path)
    return spec.with_draft(source.path, hf_config)
