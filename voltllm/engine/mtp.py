"""MTP speculation at configuration time: is the target one whose checkpoint carries a usable MTP module?

`--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'` drafts with the target's own `mtp.*` weights
(model/models/qwen3_next_mtp.py; worker/mtp_runner.py runs it). Built for Qwen3-Next, Qwen3.5 and Qwen3.5-MoE
(the hybrid model class) with one MTP layer, chained K times per step.
"""
from __future__ import annotations

import glob
import os
from typing import Any

from voltllm.engine.speculative import SpeculativeConfigError

# the target model types whose MTP module is built (text and multimodal configs)
MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def _err(msg: str) -> SpeculativeConfigError:
    return SpeculativeConfigError(f"--speculative-config method mtp: {msg}")


def check_mtp_target(hf_config: Any) -> None:
    """The target's config: an architecture with a built MTP module, one MTP layer, the shared embedding."""
    from voltllm.model.models.qwen3_next import text_config
    from voltllm.model.models.qwen3_next_mtp import mtp_layer_count

    cfg = text_config(hf_config)
    mt = getattr(cfg, "model_type", None) or getattr(hf_config, "model_type", None)
    if mt not in MTP_MODEL_TYPES:
        raise _err(f"the target is {mt!r}; MTP drafting is built for qwen3_next, qwen3_5 and qwen3_5_moe "
                   "checkpoints (their mtp.* weights)")
    n = mtp_layer_count(cfg)
    if n is not None and n < 1:
        raise _err(f"the target's config says it has no MTP layer ({n})")
    if n is not None and n > 1:
        raise _err(f"the target has {n} MTP layers; only one (chained for every draft) is built")
    if getattr(cfg, "mtp_use_dedicated_embeddings", False):
        raise _err("mtp_use_dedicated_embeddings is set: an MTP module with its own embedding is not built")


def has_mtp_weights(path: str) -> bool:
    """Whether a safetensors checkpoint directory holds mtp.* tensors (read from the headers / index only)."""
    from safetensors import safe_open

    from voltllm.model.models.qwen3_next_mtp import mtp_name

    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt", device="cpu") as st:
            if any(mtp_name(k) is not None for k in st.keys()):
                return True
    return False


def check_mtp_checkpoint(source: Any, load_format: str) -> None:
    """The checkpoint itself carries the MTP weights (random weights: nothing to check)."""
    if load_format == "dummy":
        return
    if source.kind == "gguf":
        raise _err("a GGUF target's MTP (nextn) tensors are not read; use the safetensors checkpoint")
    if not has_mtp_weights(source.path):
        raise _err(f"the checkpoint {source.path} has no mtp.* weights (was the MTP module stripped, as some "
                   "quantized exports do?)")
