"""A step's image inputs on the runner side: the vision tower's rows in place of the placeholder tokens' embeddings,
and the M-RoPE rotation of image tokens.

An image is encoded once, when a step first reaches its tokens, and its rows are kept until the step that computes
its last token (chunked prefill may split an image across steps; a prefix-cache hit may start inside one). Image
tokens whose (t, h, w) positions differ get cos / sin rows of their own in scratch rows at the end of the rotary
tables (RotaryEmbedding.reserve_rows) and those rows' indices as positions; every other token of a request with
images rotates as a 1-D position (multimodal/mrope.py), shifted by the prompt's delta after it."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from voltllm.multimodal.mrope import axis_of_frequency


class ImageStep:
    def __init__(self, tower: Any, rotary: Any, mrope_section: list[int], max_step_tokens: int,
                 device: torch.device):
        self.tower = tower
        self.rotary = rotary
        self.device = device
        self.capacity = max_step_tokens
        self.base = rotary.reserve_rows(max_step_tokens)
        self.axis = torch.from_numpy(axis_of_frequency(rotary.cos.shape[1], mrope_section)).to(device)
        self.inv_freq = rotary.inv_freq.to(device)
        self.encoded: dict[tuple[str, int], torch.Tensor] = {}  # (request id, image index) -> tower rows
        self.largest_grid = (1, 2 * tower.merge, 2 * tower.merge)  # memory profiling's image (image_step_for sets it)
        self._new_step()

    def _new_step(self) -> None:
        self._rows3d: list[np.ndarray] = []  # [3, k] positions of this step's scratch rows, in row order
        self._num_rows = 0
        self._embed_at: list[np.ndarray] = []  # the step's token indices that take tower rows
        self._embeds: list[torch.Tensor] = []

    def positions(self, req: Any, start: int, n: int, t: int) -> np.ndarray:
        """The rope positions of tokens [start, start + n) of `req` (a request with images), which sit at the step's
        token rows [t, t + n); notes the tower rows they take."""
        mm = req.multi_modal
        pos = np.arange(start, start + n, dtype=np.int64) + mm.rope_delta
        end = min(start + n, req.num_prompt_tokens)
        if start >= end:
            return pos
        p3 = mm.rope_positions[:, start:end]
        pos[:end - start] = p3[0]
        own = np.nonzero((p3[0] != p3[1]) | (p3[0] != p3[2]))[0]
        if len(own):
            if self._num_rows + len(own) > self.capacity:
                raise RuntimeError(f"a step's image tokens exceed the {self.capacity} rotary scratch rows")
            pos[own] = self.base + self._num_rows + np.arange(len(own))
            self._rows3d.append(p3[:, own])
            self._num_rows += len(own)
        for i, im in enumerate(mm.images):
            lo, hi = max(start, im.offset), min(end, im.end)
            if lo >= hi:
                continue
            rows = self._encoded(req.request_id, i, im)
            self._embed_at.append(np.arange(lo, hi) - start + t)
            self._embeds.append(rows[lo - im.offset:hi - im.offset])
            if hi == im.end:  # its last token is computed in this step: nothing later needs its rows
                del self.encoded[(req.request_id, i)]
        return pos

    def _encoded(self, request_id: str, index: int, image: Any) -> torch.Tensor:
        key = (request_id, index)
        rows = self.encoded.get(key)
        if rows is None:
            rows = self.tower(image.pixel_values.to(self.device, non_blocking=True), [image.grid_thw])
            if rows.shape[0] != image.num_tokens:
                raise RuntimeError(f"the vision tower gave {rows.shape[0]} rows for an image of {image.num_tokens} "
                                   "placeholder tokens")
            self.encoded[key] = rows
        return rows

    def finish(self, extra: dict) -> None:
        """Write the step's scratch rotary rows and hand the model its image rows (ctx.extra["image_embeds"])."""
        if self._rows3d:
            p3 = torch.from_numpy(np.concatenate(self._rows3d, axis=1)).to(self.device)
            k = p3.shape[1]
            angles = p3.double().index_select(0, self.axis).t() * self.inv_freq.double()
            self.rotary.cos[self.base:self.base + k] = (angles.cos() * self.rotary.scale).float()
            self.rotary.sin[self.base:self.base + k] = (angles.sin() * self.rotary.scale).float()
        if self._embeds:
            at = torch.from_numpy(np.concatenate(self._embed_at)).to(self.device)
            extra["image_embeds"] = (at, torch.cat(self._embeds))
        self._new_step()

    def profile(self, grid: tuple[int, int, int]) -> None:
        """Encode one random image of `grid` (the largest the processor makes): memory profiling's tower peak."""
        t, h, w = grid
        self.tower(torch.randn(t * h * w, self.tower.patch_dim, device=self.device), [grid])

    def forget(self, request_ids: list[str]) -> None:
        """Drop the kept rows of finished or preempted requests (a preempted one encodes again when it resumes)."""
        if self.encoded:
            gone = set(request_ids)
            for key in [k for k in self.encoded if k[0] in gone]:
                del self.encoded[key]


def largest_grid(model_dir: str, tower: Any) -> tuple[int, int, int]:
    """The patch grid of the largest image the checkpoint's image processor makes (its max pixels, as a square),
    from preprocessor_config.json: `size.longest_edge` or `max_pixels` (Qwen2-VL's default, 12845056, without)."""
    import json
    import math
    import os

    conf: dict = {}
    path = os.path.join(model_dir, "preprocessor_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            conf = json.load(f)
    size = conf.get("size") or {}
    pixels = size.get("longest_edge") or conf.get("max_pixels") or 12845056
    unit = tower.patch * tower.merge
    side = max(1, math.isqrt(int(pixels)) // unit) * tower.merge
    return (1, side, side)


def image_step_for(runner: Any) -> Optional[ImageStep]:
    """The runner's ImageStep when its engine takes images (multimodal/support.py), with the tower loaded."""
    from voltllm.multimodal.support import image_input_refusal

    config = runner.config
    if image_input_refusal(config) is not None:
        return None
    from voltllm.multimodal.vision_tower import load_vision_tower, vision_tower_for

    mc = config.model
    if mc.load_format == "dummy":  # random weights at the checkpoint's shapes, as the language model's
        from voltllm.worker.runner import init_dummy_weights

        tower = vision_tower_for(mc.hf_config, runner.dtype).to(runner.device).requires_grad_(False)
        with torch.no_grad():
            init_dummy_weights(tower, mc.seed, runner.device)
    else:
        tower = load_vision_tower(mc.model, mc.hf_config, runner.dtype, runner.device)
    text = getattr(mc.hf_config, "text_config", None) or mc.hf_config
    from voltllm.model.layers.rotary import rope_parameters

    section = rope_parameters(text).get("mrope_section") or [11, 11, 10]  # (transformers' default for Qwen3.5)
    sc = config.scheduler
    step = ImageStep(tower, runner.model.rotary, list(section), max(sc.max_num_batched_tokens, sc.max_num_seqs) + 8,
                     runner.device)
    step.largest_grid = largest_grid(mc.model, tower)
    return step
