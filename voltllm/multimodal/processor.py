"""A Qwen3.5 or Qwen3-VL vision-language model's image preprocessing on the frontend: transformers' Qwen2-VL image
processor (its PIL backend, from the model's preprocessor_config.json, with --mm-processor-kwargs over it), the model's
image token, and the expansion of each image's placeholder token into one token per merged patch (inputs.py's
MultiModalPrompt)."""
from __future__ import annotations

import hashlib
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch

from voltllm.config import ConfigError
from voltllm.multimodal.inputs import ImageInput, MultiModalPrompt
from voltllm.multimodal.mrope import prompt_positions

# the processor's call-time settings a request could not mean (they pick the output's container, not the pixels)
_NOT_SETTINGS = frozenset({"return_tensors", "device", "data_format", "input_data_format"})


def image_processor_for(config: Any) -> Optional["ImageProcessor"]:
    """The image processor of an engine that takes images (multimodal/support.py), else None."""
    from voltllm.multimodal.support import image_input_refusal

    if image_input_refusal(config) is not None:
        return None
    return ImageProcessor.from_model(config.model.model, config.model.hf_config,
                                     config.multimodal.mm_processor_kwargs)


class ImageCountError(ValueError):
    """The rendered prompt's image placeholders do not match the images given (a 400)."""


class ImageProcessor:
    """Images of one model: pixels -> (pixel_values, grid) -> placeholder expansion and M-RoPE positions."""

    def __init__(self, hf_processor: Any, image_token_id: int, spatial_merge_size: int):
        self.hf_processor = hf_processor
        self.image_token_id = int(image_token_id)
        self.merge = int(spatial_merge_size)

    @classmethod
    def from_model(cls, model_dir: str, hf_config: Any, mm_processor_kwargs: Optional[dict] = None
                   ) -> "ImageProcessor":
        """The model's processor (ConfigError naming --mm-processor-kwargs for a key the processor does not take or
        a setting that contradicts the vision tower's)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        kwargs = dict(mm_processor_kwargs or {})
        allowed = set(Qwen2VLImageProcessorPil.valid_kwargs.__annotations__) - _NOT_SETTINGS
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise ConfigError(f"--mm-processor-kwargs: the image processor (Qwen2-VL's) takes no {', '.join(unknown)}; "
                              f"it takes {', '.join(sorted(allowed))}")
        if not os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
            raise ConfigError(f"{model_dir} has a vision_config but no preprocessor_config.json (the image "
                              "processor's settings); add it, or serve the text model alone with --language-model-only")
        try:
            hf = Qwen2VLImageProcessorPil.from_pretrained(model_dir, **kwargs)
        except (TypeError, ValueError, OSError) as e:
            raise ConfigError(f"the image processor of {model_dir} could not be built (--mm-processor-kwargs "
                              f"{kwargs}): {e}") from None
        vision = hf_config.vision_config
        for ours, theirs in (("merge_size", "spatial_merge_size"), ("patch_size", "patch_size"),
                             ("temporal_patch_size", "temporal_patch_size")):
            want = getattr(vision, theirs, None)
            if want is not None and getattr(hf, ours) != want:
                raise ConfigError(f"the image processor's {ours} {getattr(hf, ours)} is not the vision tower's "
                                  f"{theirs} {want} (preprocessor_config.json or --mm-processor-kwargs)")
        return cls(hf, hf_config.image_token_id, vision.spatial_merge_size)

    def process(self, images: Sequence[Any]) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """Each image's processor rows [patches, C * T * P * P] (float32) and patch grid (t, h, w)."""
        out = []
        for image in images:
            feats = self.hf_processor(images=[image], return_tensors="np")
            grid = tuple(int(x) for x in feats["image_grid_thw"][0])
            out.append((torch.from_numpy(np.ascontiguousarray(feats["pixel_values"], dtype=np.float32)), grid))
        return out

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def prepare(self, prompt_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], MultiModalPrompt]:
        """The prompt with each image token (one per image, in order) expanded to the image's tokens, and what the
        runner needs for them. ImageCountError when the placeholders and the images differ in number."""
        at = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ImageCountError(f"the prompt holds {len(at)} image placeholder(s) but {len(images)} image(s) were "
                                  "given (the chat template places one per image part)")
        processed = self.process(images)
        ids: list[int] = []
        inputs = []
        prev = 0
        for index, (pixels, grid) in zip(at, processed):
            ids.extend(prompt_ids[prev:index])
            n = self.num_tokens(grid)
            inputs.append((len(ids), n, pixels, grid))
            ids.extend([self.image_token_id] * n)
            prev = index + 1
        ids.extend(prompt_ids[prev:])
        positions, delta = prompt_positions(len(ids), [(offset, grid) for offset, _, _, grid in inputs], self.merge)
        return ids, MultiModalPrompt(
            images=tuple(ImageInput(pixels, grid, content_hash(pixels, grid), offset, n)
                         for offset, n, pixels, grid in inputs),
            rope_positions=positions, rope_delta=delta)


def content_hash(pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> bytes:
    """sha256 over the processed pixels and the grid: equal images (at equal processor settings) hash alike."""
    h = hashlib.sha256()
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    h.update(pixel_values.contiguous().numpy().tobytes())
    return h.digest()
