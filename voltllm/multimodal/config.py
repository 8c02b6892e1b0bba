"""Image and video input's settings (vLLM's flags): --limit-mm-per-prompt, --mm-processor-kwargs, --media-io-kwargs,
--allowed-local-media-path, --allowed-media-domains, checked and typed. A text-only model ignores them, as vLLM does."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from voltllm.config import ConfigError, parse_json_object
from voltllm.multimodal.media import MediaSettings
from voltllm.multimodal.video import VideoLoading

DEFAULT_LIMIT = 999  # vLLM V1's default items per prompt of each modality
# modalities vLLM's models take; images and videos are built here, so the others may only be limited to 0
_UNBUILT_MODALITIES = ("audio",)


@dataclass(frozen=True)
class MultiModalConfig:
    image_limit: int = DEFAULT_LIMIT  # --limit-mm-per-prompt's "image": most images in one request
    video_limit: int = DEFAULT_LIMIT  # --limit-mm-per-prompt's "video": most videos in one request
    mm_processor_kwargs: dict = field(default_factory=dict)  # over the image / video processors' configs
    video_loading: VideoLoading = VideoLoading()  # --media-io-kwargs's "video": frames the loader reads
    allowed_local_media_path: Optional[str] = None  # a real directory path: file:// image URLs are read under it
    allowed_media_domains: Optional[tuple[str, ...]] = None  # host names http(s) image URLs may name (None: any)
    processor_cache_gb: float = 4.0  # --mm-processor-cache-gb (vLLM's default): processed items kept by their bytes

    def media_settings(self) -> MediaSettings:
        return MediaSettings(self.allowed_local_media_path, self.allowed_media_domains)


def resolve_multimodal(limit_mm_per_prompt: Any = None, mm_processor_kwargs: Any = None,
                       allowed_local_media_path: Optional[str] = None,
                       allowed_media_domains: Any = None, media_io_kwargs: Any = None,
                       mm_processor_cache_gb: Any = 4.0,
                       disable_mm_preprocessor_cache: bool = False) -> MultiModalConfig:
    """The flags as a MultiModalConfig; ConfigError naming the flag for a value that cannot run."""
    image, video = _limits(_json_object("--limit-mm-per-prompt", limit_mm_per_prompt))
    try:
        cache_gb = float(mm_processor_cache_gb)
    except (TypeError, ValueError):
        cache_gb = -1.0
    if not cache_gb >= 0:
        raise ConfigError(f"--mm-processor-cache-gb must be a number of GiB >= 0, got {mm_processor_cache_gb!r}")
    return MultiModalConfig(image_limit=image, video_limit=video,
                            mm_processor_kwargs=_json_object("--mm-processor-kwargs", mm_processor_kwargs),
                            video_loading=_video_loading(_json_object("--media-io-kwargs", media_io_kwargs)),
                            allowed_local_media_path=_local_path(allowed_local_media_path),
                            allowed_media_domains=_domains(allowed_media_domains),
                            # (vLLM's older switch: no cache)
                            processor_cache_gb=0.0 if disable_mm_preprocessor_cache else cache_gb)


def _video_loading(kwargs: dict) -> VideoLoading:
    """vLLM's --media-io-kwargs: per modality, its media loader's settings; the video loader's num_frames and fps
    are built (an image's loader has no setting here)."""
    for modality, settings in kwargs.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"--media-io-kwargs {modality}: expected a JSON object of settings, got "
                              f"{json.dumps(settings)}")
        if modality != "video" and settings:
            raise ConfigError(f"--media-io-kwargs {modality}: only the video loader's settings (num_frames, fps) are "
                              f"built, not {', '.join(sorted(settings))}")
    video = kwargs.get("video") or {}
    extra = sorted(set(video) - {"num_frames", "fps"})
    if extra:
        raise ConfigError(f"--media-io-kwargs video: the video loader takes num_frames and fps, not {', '.join(extra)}")
    num_frames = video.get("num_frames", VideoLoading.num_frames)
    fps = video.get("fps", VideoLoading.fps)
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames == 0 or num_frames < -1:
        raise ConfigError(f"--media-io-kwargs video num_frames: a frame count > 0, or -1 for every frame (the "
                          f"processor then samples by its fps), got {json.dumps(num_frames)}")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or (fps <= 0 and fps != -1):
        raise ConfigError(f"--media-io-kwargs video fps: frames per second > 0, or -1 for no fps cap, got "
                          f"{json.dumps(fps)}")
    return VideoLoading(num_frames=num_frames, fps=float(fps))


def _json_object(flag: str, value: Any) -> dict:
    """config.parse_json_object, None as {} (a copy: the flag's value is not shared)."""
    return dict(parse_json_object(flag, value) or {})


def _limits(limits: dict) -> tuple[int, int]:
    image = video = DEFAULT_LIMIT
    for modality, limit in limits.items():
        count = limit
        if isinstance(limit, dict):  # vLLM's {"count": N, ...}; its other keys size vLLM's memory profiling only
            extra = sorted(set(limit) - {"count"})
            if extra:
                raise ConfigError(f"--limit-mm-per-prompt {modality}: only \"count\" is taken here, not "
                                  f"{', '.join(extra)} (no multimodal memory profiling is built)")
            count = limit.get("count", DEFAULT_LIMIT)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"--limit-mm-per-prompt {modality}: the limit must be an integer >= 0, got "
                              f"{json.dumps(limit)}")
        if modality == "image":
            image = count
        elif modality == "video":
            video = count
        elif count != 0:
            what = f"{modality} input" if modality in _UNBUILT_MODALITIES else f"the modality {modality!r}"
            raise ConfigError(f"--limit-mm-per-prompt {modality}={json.dumps(limit)}: {what} is not built (images "
                              f"and videos only); give {modality} 0 or leave it out")
    return image, video


def _local_path(path: Optional[str]) -> Optional[str]:
    if path is None or path == "":  # ("" is vLLM's default: none)
        return None
    if not isinstance(path, str):
        raise ConfigError(f"--allowed-local-media-path must be a directory path, got {path!r}")
    if not os.path.isdir(path):
        raise ConfigError(f"--allowed-local-media-path {path}: no such directory")
    return os.path.realpath(path)


def _domains(domains: Any) -> Optional[tuple[str, ...]]:
    if domains is None:
        return None
    if isinstance(domains, str):
        domains = [domains]
    if not isinstance(domains, (list, tuple)) or not all(isinstance(d, str) and d for d in domains):
        raise ConfigError(f"--allowed-media-domains must be host names, got {domains!r}")
    return tuple(d.lower() for d in domains)
