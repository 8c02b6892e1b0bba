"""Image input's settings (vLLM's flags): --limit-mm-per-prompt, --mm-processor-kwargs, --allowed-local-media-path,
--allowed-media-domains, checked and typed. A text-only model ignores them, as vLLM does."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from voltllm.config import ConfigError
from voltllm.multimodal.media import MediaSettings

DEFAULT_LIMIT = 999  # vLLM V1's default items per prompt of each modality
# modalities vLLM's models take; only images are built here, so the others may only be limited to 0
_UNBUILT_MODALITIES = ("video", "audio")


@dataclass(frozen=True)
class MultiModalConfig:
    image_limit: int = DEFAULT_LIMIT  # --limit-mm-per-prompt's "image": most images in one request
    mm_processor_kwargs: dict = field(default_factory=dict)  # over the image processor's preprocessor_config.json
    allowed_local_media_path: Optional[str] = None  # a real directory path: file:// image URLs are read under it
    allowed_media_domains: Optional[tuple[str, ...]] = None  # host names http(s) image URLs may name (None: any)

    def media_settings(self) -> MediaSettings:
        return MediaSettings(self.allowed_local_media_path, self.allowed_media_domains)


def resolve_multimodal(limit_mm_per_prompt: Any = None, mm_processor_kwargs: Any = None,
                       allowed_local_media_path: Optional[str] = None,
                       allowed_media_domains: Any = None) -> MultiModalConfig:
    """The flags as a MultiModalConfig; ConfigError naming the flag for a value that cannot run."""
    return MultiModalConfig(image_limit=_image_limit(_json_object("--limit-mm-per-prompt", limit_mm_per_prompt)),
                            mm_processor_kwargs=_json_object("--mm-processor-kwargs", mm_processor_kwargs),
                            allowed_local_media_path=_local_path(allowed_local_media_path),
                            allowed_media_domains=_domains(allowed_media_domains))


def _json_object(flag: str, value: Any) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {json.dumps(value)}")
    return dict(value)


def _image_limit(limits: dict) -> int:
    image = DEFAULT_LIMIT
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
        elif count != 0:
            what = f"{modality} input" if modality in _UNBUILT_MODALITIES else f"the modality {modality!r}"
            raise ConfigError(f"--limit-mm-per-prompt {modality}={json.dumps(limit)}: {what} is not built (images "
                              f"only); give {modality} 0 or leave it out")
    return image


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
