"""What a prompt with images carries from the frontend to the runner.

The frontend expands each image's placeholder into `num_tokens` copies of the model's image token, runs the image
processor, and computes the prompt's M-RoPE positions; the engine hashes `content_hash` into the prefix-cache keys of
the blocks the image's tokens fall in; the runner encodes `pixel_values` with the vision tower when a step first
reaches the image's tokens and puts the encoder's rows in place of those tokens' embeddings."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass(frozen=True)
class ImageInput:
    # [patches, channels * temporal_patch * patch * patch]: the processor's float32 rows (or in a half-precision
    # tower's dtype: MultiModalPrompt.for_tower)
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]  # the patch grid (t, h, w), before the spatial merge
    content_hash: bytes  # identifies the pixels (and grid): prefix-cache blocks holding its tokens are keyed by it
    offset: int  # prompt index of its first placeholder token
    num_tokens: int  # its placeholder tokens: t * h * w // spatial_merge_size ** 2

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(frozen=True)
class MultiModalPrompt:
    images: tuple[ImageInput, ...]  # in prompt order, not overlapping
    rope_positions: np.ndarray  # [3, num_prompt_tokens] int64: each prompt token's (t, h, w) M-RoPE position
    rope_delta: int  # a token at index i >= num_prompt_tokens has position i + rope_delta on all three axes

    def position_row(self, index: int) -> int:
        """The 1-D position of a token past the prompt (all three axes equal)."""
        return index + self.rope_delta

    def for_tower(self, dtype: torch.dtype) -> "MultiModalPrompt":
        """This prompt with its pixel rows in a half-precision tower's dtype (the tower casts them to it first thing,
        so nothing changes but the bytes: half of them to pickle and send to the engine process). Content hashes
        stay those of the processor's float32 rows. Unchanged for a float32 tower."""
        if dtype not in (torch.float16, torch.bfloat16):
            return self
        return replace(self, images=tuple(replace(im, pixel_values=im.pixel_values.to(dtype)) for im in self.images))
