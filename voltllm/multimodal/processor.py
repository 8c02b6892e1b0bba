"""A Qwen3.5, Qwen3-VL, Qwen2.5-VL or Qwen2-VL vision-language model's image and video preprocessing on the frontend:
transformers' Qwen2-VL image processor (its PIL backend, from the model's preprocessor_config.json, with
--mm-processor-kwargs over it), the video processor's settings (video.py), the model's vision tokens, and the
expansion of each image's placeholder token into one token per merged patch, and of each video's into its temporal
patches (inputs.py's MultiModalPrompt: one ImageInput per temporal patch):
- Qwen3.5 / Qwen3-VL: each patch as `<t seconds>` then its tokens between vision start / end;
- Qwen2.5-VL / Qwen2-VL: all patches' tokens in one run between the template's vision start / end, their M-RoPE time
  positions spaced by the patch's seconds (Qwen2.5-VL) or by one (Qwen2-VL): mrope.prompt_positions."""
from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from voltllm.config import ConfigError
from voltllm.multimodal.inputs import ImageInput, MultiModalPrompt
from voltllm.multimodal.mrope import prompt_positions, time_positions
from voltllm.multimodal.media import MediaError, MediaSettings, decode_image, read_media
from voltllm.multimodal.processed_cache import ProcessedCache
from voltllm.multimodal.video import (QWEN2_VIDEO_SETTINGS, VIDEO_SETTINGS, ProcessedVideo, VideoLoading,
                                      VideoSampling, decode_video, video_sampling_for)

# models whose video is one run of tokens over all temporal patches (no timestamps), as transformers' Qwen2-VL /
# Qwen2.5-VL processors write it
QWEN2_VIDEO_LAYOUT = ("qwen2_vl", "qwen2_5_vl")

# the processor's call-time settings a request could not mean (they pick the output's container, not the pixels)
_NOT_SETTINGS = frozenset({"return_tensors", "device", "data_format", "input_data_format"})


def image_processor_for(config: Any) -> Optional["ImageProcessor"]:
    """The image processor of an engine that takes images (multimodal/support.py), else None."""
    from voltllm.multimodal.support import image_input_refusal, takes_videos

    if image_input_refusal(config) is not None:
        return None
    processor = ImageProcessor.from_model(config.model.model, config.model.hf_config,
                                          config.multimodal.mm_processor_kwargs, takes_videos(config),
                                          config.model.mmproj)
    processor.video_loading = config.multimodal.video_loading
    processor.cache = ProcessedCache(int(config.multimodal.processor_cache_gb * 2**30))
    return processor


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [patches, C * T * P * P] float32, the processor's rows
    grid: tuple[int, int, int]
    content_hash: Optional[bytes]  # (None: computed when the prompt is prepared)


class ImageCountError(ValueError):
    """The rendered prompt's image or video placeholders do not match the items given (a 400)."""


class ImageProcessor:
    """Images and videos of one model: pixels -> (pixel_values, grid) -> placeholder expansion and M-RoPE
    positions. `video` None: the engine takes no video (--limit-mm-per-prompt video 0)."""

    def __init__(self, hf_processor: Any, image_token_id: int, spatial_merge_size: int,
                 video: Optional[VideoSampling] = None, video_token_ids: Optional[tuple[int, int, int]] = None,
                 tokens_per_second: Optional[float] = None):
        self.hf_processor = hf_processor
        self.image_token_id = int(image_token_id)
        self.merge = int(spatial_merge_size)
        self.video = video
        # (video token, vision start, vision end)
        self.video_token_id, self.vision_start_id, self.vision_end_id = video_token_ids or (-1, -1, -1)
        # Qwen2.5-VL's vision_config.tokens_per_second: a video patch's M-RoPE time step is this x its seconds
        # (Qwen2-VL, with video.qwen2_family and no such setting: a step of one)
        self.tokens_per_second = tokens_per_second
        self.video_loading = VideoLoading()  # --media-io-kwargs video (image_processor_for sets the engine's)
        self.cache = ProcessedCache(0)  # --mm-processor-cache-gb (image_processor_for sets the engine's)
        self.no_video = "this server takes no video (--limit-mm-per-prompt video 0)"  # (the 400's message)

    @classmethod
    def from_model(cls, model_dir: str, hf_config: Any, mm_processor_kwargs: Optional[dict] = None,
                   videos: bool = False, mmproj: Optional[str] = None) -> "ImageProcessor":
        """The model's processor (ConfigError naming --mm-processor-kwargs for a key neither the image nor the video
        processor takes, or a setting that contradicts the vision tower's). videos: build the video settings too.
        mmproj: a GGUF model's projector file, whose metadata gives the settings (model/loader/gguf_mmproj.py)
        instead of the directory's preprocessor_config.json."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        kwargs = dict(mm_processor_kwargs or {})
        qwen2_family = hf_config.model_type in QWEN2_VIDEO_LAYOUT
        video_settings = VIDEO_SETTINGS | (QWEN2_VIDEO_SETTINGS if qwen2_family else frozenset())
        allowed = set(Qwen2VLImageProcessorPil.valid_kwargs.__annotations__) - _NOT_SETTINGS
        unknown = sorted(set(kwargs) - allowed - video_settings)
        if unknown:
            raise ConfigError(f"--mm-processor-kwargs: neither the image processor (Qwen2-VL's) nor the video "
                              f"processor ({'Qwen2-VL' if qwen2_family else 'Qwen3-VL'}'s) takes "
                              f"{', '.join(unknown)}; they take {', '.join(sorted(allowed | video_settings))}")
        # (copies: a processor may change a setting's dict in place, e.g. the image one's size by its max_pixels)
        video_kwargs = copy.deepcopy({k: v for k, v in kwargs.items() if k in video_settings})
        kwargs = copy.deepcopy({k: v for k, v in kwargs.items() if k in allowed})
        settings = None
        if mmproj is not None:
            from voltllm.model.loader.gguf_mmproj import read_mmproj

            settings = read_mmproj(mmproj).preprocessor
        elif not os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
            raise ConfigError(f"{model_dir} has a vision_config but no preprocessor_config.json (the image "
                              "processor's settings); add it, or serve the text model alone with --language-model-only")
        try:
            hf = (Qwen2VLImageProcessorPil.from_pretrained(model_dir, **kwargs) if settings is None
                  else Qwen2VLImageProcessorPil(**{**settings, **kwargs}))
        except (TypeError, ValueError, OSError) as e:
            raise ConfigError(f"the image processor of {model_dir} could not be built (--mm-processor-kwargs "
                              f"{kwargs}): {e}") from None
        vision = hf_config.vision_config
        video = None
        if videos:
            try:
                video = video_sampling_for(model_dir, video_kwargs, qwen2_family, settings)
            except (TypeError, ValueError, OSError, AttributeError) as e:
                raise ConfigError(f"the video processor of {model_dir} could not be built (--mm-processor-kwargs "
                                  f"{video_kwargs}): {e}") from None
        for ours, theirs in (("merge_size", "spatial_merge_size"), ("patch_size", "patch_size"),
                             ("temporal_patch_size", "temporal_patch_size")):
            want = getattr(vision, theirs, None)
            for what, settings in (("image", hf), ("video", video)):
                if settings is not None and want is not None and getattr(settings, ours) != want:
                    raise ConfigError(f"the {what} processor's {ours} {getattr(settings, ours)} is not the vision "
                                      f"tower's {theirs} {want} (its processor config or --mm-processor-kwargs)")
        ids = None
        if video is not None:
            ids = (hf_config.video_token_id, hf_config.vision_start_token_id, hf_config.vision_end_token_id)
        tokens_per_second = None
        if hf_config.model_type == "qwen2_5_vl":
            tokens_per_second = float(getattr(vision, "tokens_per_second", None) or 4)  # (transformers' default)
        processor = cls(hf, hf_config.image_token_id, vision.spatial_merge_size, video, ids, tokens_per_second)
        from voltllm.multimodal.support import VIDEO_MODEL_TYPES

        if hf_config.model_type not in VIDEO_MODEL_TYPES:
            processor.no_video = f"video input is not built for {hf_config.model_type} models (images only)"
        return processor

    def process(self, images: Sequence[Any]) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """Each image's processor rows [patches, C * T * P * P] (float32) and patch grid (t, h, w)."""
        out = []
        for image in images:
            feats = self.hf_processor(images=[image], return_tensors="np")
            grid = tuple(int(x) for x in feats["image_grid_thw"][0])
            out.append((torch.from_numpy(np.ascontiguousarray(feats["pixel_values"], dtype=np.float32)), grid))
        return out

    def load_image(self, url: str, media: MediaSettings) -> ProcessedImage:
        """The image a part's URL names, read, decoded and processed (or taken from the processed cache by its
        bytes); MediaError for one that cannot be read."""
        return self.image_from_bytes(read_media(url, media), url)

    def image_from_bytes(self, data: bytes, what: str = "the image") -> ProcessedImage:
        def make() -> ProcessedImage:
            (pixels, grid), = self.process([decode_image(data, what)])
            return ProcessedImage(pixels, grid, content_hash(pixels, grid))

        return self.cache.get_or_make("image", data, make, lambda item: item.pixel_values.nbytes)

    def load_video(self, url: str, media: MediaSettings) -> ProcessedVideo:
        """The video a part's URL names, read under the image rules with video limits, decoded, sampled and
        processed (MediaError for one that cannot be read, or a server that takes no video)."""
        if self.video is None:
            raise MediaError(self.no_video)
        return self.video_from_bytes(read_media(url, media.for_videos()))

    def video_from_bytes(self, data: bytes) -> ProcessedVideo:
        if self.video is None:
            raise MediaError(self.no_video)
        return self.cache.get_or_make("video", data, lambda: decode_video(data, self.video_loading, self.video),
                                      lambda video: video.pixel_values.nbytes)

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def prepare(self, prompt_ids: Sequence[int], images: Sequence[Any], videos: Sequence[ProcessedVideo] = (),
                tokenizer: Any = None) -> tuple[list[int], MultiModalPrompt]:
        """The prompt with each image token (one per image, in order) expanded to the image's tokens and each video
        token to its temporal patches' tokens: Qwen3.x (with the vision start / end the chat template wrapped it
        in, when there) each `<t seconds>` (tokenized alone, by `tokenizer`) + vision start + its tokens + vision
        end, as transformers' Qwen3VLProcessor writes them; Qwen2.x all patches' tokens in place of the one, as
        Qwen2_5_VLProcessor does. And what the runner needs for them: one ImageInput of grid (1, h, w) per
        temporal patch (the tower attends within each frame; Qwen3.x's get_rope_index splits a video so too) and
        the prompt's M-RoPE positions. Videos are decode_video's output. ImageCountError when the placeholders and
        the items differ in number."""
        at = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ImageCountError(f"the prompt holds {len(at)} image placeholder(s) but {len(images)} image(s) were "
                                  "given (the chat template places one per image part)")
        video_at = [i for i, t in enumerate(prompt_ids) if t == self.video_token_id] if videos else []
        if len(video_at) != len(videos):
            raise ImageCountError(f"the prompt holds {len(video_at)} video placeholder(s) but {len(videos)} video(s) "
                                  "were given (the chat template places one per video part)")
        items = sorted([(i, 0, item) for i, item in zip(at, self._processed(images))] +
                       [(i, 1, item) for i, item in zip(video_at, videos)], key=lambda x: x[0])
        ids: list[int] = []
        inputs = []  # (offset, tokens, pixels, grid, content hash or None)
        spans = []  # mrope.prompt_positions' items: (offset, grid, time step), one per image or Qwen2.x video
        prev = 0
        for index, is_video, item in items:
            if not is_video:
                pixels, grid = item.pixel_values, item.grid
                ids.extend(prompt_ids[prev:index])
                n = self.num_tokens(grid)
                spans.append((len(ids), grid, 1.0))
                inputs.append((len(ids), n, pixels, grid, item.content_hash))
                ids.extend([self.image_token_id] * n)
                prev = index + 1
                continue
            if self.video is not None and self.video.qwen2_family:
                ids.extend(prompt_ids[prev:index])
                self._expand_video_run(item, ids, inputs, spans)
                prev = index + 1
                continue
            lo, hi = index, index + 1
            if (index - 1 >= prev and prompt_ids[index - 1] == self.vision_start_id and hi < len(prompt_ids)
                    and prompt_ids[hi] == self.vision_end_id):
                lo, hi = index - 1, index + 2  # (each temporal patch gets its own start / end instead)
            ids.extend(prompt_ids[prev:lo])
            self._expand_video(item, ids, inputs, spans, tokenizer)
            prev = hi
        ids.extend(prompt_ids[prev:])
        positions, delta = prompt_positions(len(ids), spans, self.merge)
        return ids, MultiModalPrompt(
            images=tuple(ImageInput(pixels, grid, digest or content_hash(pixels, grid), offset, n)
                         for offset, n, pixels, grid, digest in inputs),
            rope_positions=positions, rope_delta=delta)

    def _processed(self, images: Sequence[Any]) -> list[ProcessedImage]:
        """ProcessedImage items as they are; PIL images processed here."""
        out = [im if isinstance(im, ProcessedImage) else None for im in images]
        raw = [im for im in images if not isinstance(im, ProcessedImage)]
        made = iter(ProcessedImage(p, g, None) for p, g in self.process(raw))
        return [im if im is not None else next(made) for im in out]

    def _expand_video(self, video: ProcessedVideo, ids: list[int], inputs: list, spans: list,
                      tokenizer: Any) -> None:
        t, h, w = video.grid
        rows = torch.from_numpy(video.pixel_values)
        n = self.num_tokens((1, h, w))
        for k, secs in enumerate(video.timestamps[:t]):
            ids.extend(tokenizer.encode(f"<{secs:.1f} seconds>", add_special_tokens=False))
            ids.append(self.vision_start_id)
            spans.append((len(ids), (1, h, w), 1.0))
            inputs.append((len(ids), n, rows[k * h * w:(k + 1) * h * w], (1, h, w), None))
            ids.extend([self.video_token_id] * n)
            ids.append(self.vision_end_id)

    def video_time_step(self, video: ProcessedVideo) -> float:
        """The M-RoPE time position step between a Qwen2.x video's temporal patches: Qwen2.5-VL's tokens_per_second
        x second_per_grid_ts, in float32 as transformers' get_rope_index multiplies them; Qwen2-VL's one."""
        if self.tokens_per_second is None:
            return 1.0
        return float(np.float32(self.tokens_per_second) * np.float32(video.second_per_grid))

    def _expand_video_run(self, video: ProcessedVideo, ids: list[int], inputs: list, spans: list) -> None:
        """A Qwen2.x video: its t * h * w / merge**2 tokens in one run, one ImageInput per temporal patch, whose
        content hash also holds the patch's time position (two videos alike up to a patch but for their frame rate
        must not share that patch's KV blocks)."""
        t, h, w = video.grid
        rows = torch.from_numpy(video.pixel_values)
        n = self.num_tokens((1, h, w))
        step = self.video_time_step(video)
        spans.append((len(ids), (t, h, w), step))
        times = time_positions(t, step)
        for k in range(t):
            pixels = rows[k * h * w:(k + 1) * h * w]
            inputs.append((len(ids), n, pixels, (1, h, w), content_hash(pixels, (1, h, w), int(times[k]))))
            ids.extend([self.video_token_id] * n)


def content_hash(pixel_values: torch.Tensor, grid: tuple[int, int, int], time_position: int = 0) -> bytes:
    """sha256 over the processed pixels and the grid (and a Qwen2.x video patch's time position, past the video's
    start, when not 0): equal images (at equal processor settings) hash alike."""
    h = hashlib.sha256()
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    if time_position:
        h.update(b"t" + np.asarray([time_position], dtype=np.int64).tobytes())
    h.update(pixel_values.contiguous().numpy().tobytes())
    return h.digest()
