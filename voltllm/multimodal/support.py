"""Whether an engine takes images and videos, and why not when it does not (the reason is the 400's message). One
answer for both: they share the vision tower; --limit-mm-per-prompt's per-modality counts are checked per request."""
from __future__ import annotations

from typing import Any, Optional

# the natively multimodal checkpoints whose vision tower voltllm runs (voltllm/multimodal/vision_tower.py,
# qwen2_vision_tower.py; qwen4_exp's is Qwen3.5-MoE's)
IMAGE_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe", "qwen2_vl", "qwen2_5_vl", "qwen4_exp")
# those that also take videos (all of them: Qwen3.x's patches after timestamps, Qwen2.x's in one run; processor.py)
VIDEO_MODEL_TYPES = IMAGE_MODEL_TYPES


def takes_videos(config: Any) -> bool:
    """Whether an engine that takes images (image_input_refusal None) takes videos too."""
    return config.multimodal.video_limit > 0 and config.model.hf_config.model_type in VIDEO_MODEL_TYPES


def image_input_refusal(config: Any) -> Optional[str]:
    """None when the engine of `config` (an EngineConfig) takes images; else why it does not."""
    mc = config.model
    hf = mc.hf_config
    if getattr(hf, "vision_config", None) is None or getattr(hf, "model_type", None) not in IMAGE_MODEL_TYPES:
        return "this server serves a text-only model (no image, audio or video input)"
    if mc.quantization == "gguf" and mc.mmproj is None:  # (its config has a vision_config only with a projector)
        return "a GGUF file holds the language model only (no image input): give its projector file with --mmproj"
    if mc.language_model_only:
        return "the server was started with --language-model-only (no image input)"
    if mc.runner == "pooling":
        return "image input is built for generation, not for --runner pooling"
    spec = config.speculative
    if spec is not None and (spec.uses_draft_model or spec.uses_dflash or spec.uses_eagle3 or spec.uses_eagle1):
        # (their own models rotate 1-D positions: n-gram, suffix and MTP, which shares the target's rotary, work)
        return "image input is not built with a draft-model, DFlash or EAGLE speculative method (n-gram, suffix " \
               "and MTP work)"
    if config.multimodal.image_limit == 0 and config.multimodal.video_limit == 0:
        return "the server was started with --limit-mm-per-prompt image 0 and video 0 (no image or video input)"
    return None
