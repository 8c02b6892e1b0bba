"""A step's image inputs on the runner side: the vision tower's rows in place of the placeholder tokens' embeddings,
and the M-RoPE rotation of image tokens.

An image is encoded once, when a step first reaches its tokens, and its rows are kept (by content hash: requests
showing the same image at once share them) until no request has tokens of it left to compute (chunked prefill may
split an image across steps; a prefix-cache hit may start inside one). Image
tokens whose (t, h, w) positions differ get cos / sin rows of their own in scratch rows at the end of the rotary
tables (RotaryEmbedding.reserve_rows) and those rows' indices as positions (each frequency taking its axis's position
by the model's rule, interleaved or contiguous); every other token of a request with images rotates as a 1-D position
(multimodal/mrope.py), shifted by the prompt's delta after it.

A Qwen3-VL tower also gives deepstack rows (one set per level, row for row with the main ones): an image's rows are
kept as one tensor [tokens, hidden * (1 + levels)], main rows first, so every slice, cache and broadcast carries the
levels with them; the forward gets them as extra["image_deepstack"], a list of [tokens, hidden] in the order of
extra["image_embeds"]'s indices."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from voltllm.host_to_device import upload
from voltllm.multimodal.mrope import axis_of_frequency, mrope_layout


@dataclass
class ImageRows:
    """A step's image work as the forward takes it: the (t, h, w) positions of its scratch rotary rows [3, k], the
    step's token indices that take tower rows, and those rows (rank 0 broadcasts them; StepInputs carries the rest)."""
    rows3d: Optional[np.ndarray]
    embed_at: Optional[np.ndarray]
    embeds: Optional[torch.Tensor] = None
    # {request's batch index: its tokens' M-RoPE positions [3, length]} (token_positions): Qwen4-Exp's QSA steps
    token_positions: Optional[dict] = None

    def for_followers(self) -> ImageRows:
        return ImageRows(self.rows3d, self.embed_at, token_positions=self.token_positions)


class ImageStep:
    def __init__(self, tower: Optional[Any], rotary: Any, mrope_section: list[int], max_step_tokens: int,
                 device: torch.device, deepstack_levels: int = 0, mrope_interleaved: bool = True):
        self.tower = tower
        self.deepstack_levels = deepstack_levels  # (the config's: a tensor-parallel rank > 0 has no tower)
        self.rotary = rotary
        self.device = device
        self.capacity = max_step_tokens
        self.base = rotary.reserve_rows(max_step_tokens)
        self.axis = torch.from_numpy(axis_of_frequency(rotary.cos.shape[1], mrope_section,
                                                       mrope_interleaved)).to(device)
        self.inv_freq = rotary.inv_freq.to(device)
        # an image's tower rows by content hash, kept while a request still has tokens of it to compute (requests
        # that show the same image at once, such as the n samples of one prompt, encode it once)
        self.encoded: dict[bytes, torch.Tensor] = {}
        self.waiting: dict[bytes, set[str]] = {}  # content hash -> the requests still to compute some of its tokens
        # then, up to a step's tokens of rows in all, the latest ones no request waits for (a request behind with the
        # same image, or the next turn of a chat that misses the prefix cache, takes them instead of encoding again)
        self.recent: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._recent_rows = 0
        self.largest_grid = (1, 4, 4)  # memory profiling's image (image_step_for sets the processor's largest)
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
            rows = self._encoded(im)
            self._embed_at.append(np.arange(lo, hi) - start + t)
            self._embeds.append(rows[lo - im.offset:hi - im.offset])
            waiting = self.waiting.setdefault(im.content_hash, set())
            if hi == im.end:  # its last token is computed in this step: this request needs its rows no more
                waiting.discard(req.request_id)
                if not waiting:
                    self._drop(im.content_hash)
            else:
                waiting.add(req.request_id)
        return pos

    def _encoded(self, image: Any) -> torch.Tensor:
        key = image.content_hash
        rows = self.encoded.get(key)
        if rows is None and key in self.recent:
            rows = self.encoded[key] = self.recent.pop(key)
            self._recent_rows -= rows.shape[0]
        if rows is None:
            rows = self._encode(upload(image.pixel_values, self.device), image.grid_thw)
            if rows.shape[0] != image.num_tokens:
                raise RuntimeError(f"the vision tower gave {rows.shape[0]} rows for an image of {image.num_tokens} "
                                   "placeholder tokens")
            self.encoded[image.content_hash] = rows
        return rows

    def _encode(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The tower's rows of one image, with its deepstack levels' beside them: [tokens, hidden * (1 + levels)]."""
        if not self.deepstack_levels:
            return self.tower(pixel_values, [grid])
        rows, deepstack = self.tower.forward_with_deepstack(pixel_values, [grid])
        if len(deepstack) != self.deepstack_levels:
            raise RuntimeError(f"the vision tower gave {len(deepstack)} deepstack levels, not the config's "
                               f"{self.deepstack_levels}")
        return torch.cat([rows, *deepstack], dim=1)

    def _drop(self, key: bytes) -> None:
        """No request waits for the image's rows: they become the most recent of the kept ones."""
        rows = self.encoded.pop(key, None)
        self.waiting.pop(key, None)
        if rows is None or rows.shape[0] > self.capacity:
            return
        self.recent[key] = rows
        self._recent_rows += rows.shape[0]
        while self._recent_rows > self.capacity:
            self._recent_rows -= self.recent.popitem(last=False)[1].shape[0]

    def finish(self, extra: dict, dtype: torch.dtype) -> Optional[ImageRows]:
        """Write the step's scratch rotary rows and hand the model its image rows (extra["image_embeds"]); returns
        what the other tensor-parallel ranks need for the same (None: the step has no image token)."""
        rows = None
        if self._rows3d or self._embeds:
            rows = ImageRows(np.concatenate(self._rows3d, axis=1) if self._rows3d else None,
                             np.concatenate(self._embed_at) if self._embeds else None,
                             torch.cat(self._embeds).to(dtype).contiguous() if self._embeds else None)
            self._apply(rows, extra)
        self._new_step()
        return rows

    def follow(self, rows: ImageRows, extra: dict, tp: Any, hidden_size: int, dtype: torch.dtype,
               with_embeds: bool = True) -> None:
        """A rank other than 0: rank 0's scratch rows and image rows (a broadcast from it, after the step's input
        ids) for this rank's forward. with_embeds False (a later pipeline stage, which starts from hidden states):
        the scratch rotary rows alone (it takes part in the broadcast, and drops the rows)."""
        if rows.embed_at is not None:
            width = hidden_size * (1 + self.deepstack_levels)
            embeds = tp.broadcast_(torch.empty(len(rows.embed_at), width, dtype=dtype, device=self.device))
            rows = ImageRows(rows.rows3d, rows.embed_at, embeds, rows.token_positions)
        if not with_embeds:
            rows = ImageRows(rows.rows3d, None, None, rows.token_positions)
        self._apply(rows, extra)
        if rows.token_positions:  # (rank 0's requests' positions: the same rotations on every rank)
            extra["token_rotations"] = {i: self.rotations(p3) for i, p3 in rows.token_positions.items()}

    def _apply(self, rows: ImageRows, extra: dict) -> None:
        if rows.rows3d is not None:
            p3 = upload(torch.from_numpy(rows.rows3d), self.device)
            k = p3.shape[1]
            angles = p3.double().index_select(0, self.axis).t() * self.inv_freq.double()
            self.rotary.cos[self.base:self.base + k] = (angles.cos() * self.rotary.scale).float()
            self.rotary.sin[self.base:self.base + k] = (angles.sin() * self.rotary.scale).float()
        if rows.embeds is not None:
            at = upload(torch.from_numpy(rows.embed_at), self.device)
            levels = rows.embeds.tensor_split(1 + self.deepstack_levels, dim=1)  # main rows, then each level's
            extra["image_embeds"] = (at, levels[0])
            if self.deepstack_levels:
                extra["image_deepstack"] = list(levels[1:])

    def token_rotations(self, req: Any, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin rows [length, half] of tokens 0..length-1 of a request with images, each at its M-RoPE position
        (the prompt's (t, h, w), then 1-D shifted by the delta): for a model that rotates past tokens' keys again by
        token index (Qwen4-Exp's QSA indexer pools and rotates cached raw keys)."""
        return self.rotations(token_positions(req, length))

    def rotations(self, p3: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin rows of tokens at M-RoPE positions p3 [3, length] (token_rotations)."""
        own = np.nonzero((p3[0] != p3[1]) | (p3[0] != p3[2]))[0]
        flat = upload(torch.from_numpy(p3[0].copy()), self.device)
        cos, sin = self.rotary.cos[flat], self.rotary.sin[flat]  # (copies; text tokens rotate as 1-D positions)
        if len(own):
            p = upload(torch.from_numpy(p3[:, own]), self.device)
            angles = p.double().index_select(0, self.axis).t() * self.inv_freq.double()
            at = upload(torch.from_numpy(own), self.device)
            cos[at] = (angles.cos() * self.rotary.scale).float()
            sin[at] = (angles.sin() * self.rotary.scale).float()
        return cos, sin

    def profile(self, grid: tuple[int, int, int]) -> None:
        """Encode one random image of `grid` (the largest the processor makes): memory profiling's tower peak
        (nothing on a rank without the tower)."""
        if self.tower is None:
            return
        t, h, w = grid
        self._encode(torch.randn(t * h * w, self.tower.patch_dim, device=self.device), grid)

    def forget(self, request_ids: list[str]) -> None:
        """Drop the kept rows of finished or preempted requests (a preempted one encodes again when it resumes)."""
        if self.waiting:
            gone = set(request_ids)
            for key, waiting in list(self.waiting.items()):
                waiting -= gone
                if not waiting:
                    self._drop(key)


def token_positions(req: Any, length: int) -> np.ndarray:
    """The M-RoPE positions [3, length] of tokens 0..length-1 of a request with images: the prompt's (t, h, w), then
    1-D shifted by its delta."""
    mm = req.multi_modal
    n = min(length, req.num_prompt_tokens)
    p3 = np.empty((3, length), dtype=np.int64)
    p3[:, :n] = mm.rope_positions[:, :n]
    p3[:, n:] = np.arange(n, length, dtype=np.int64) + mm.rope_delta
    return p3


def largest_grid(config: Any, tower: Any) -> tuple[int, int, int]:
    """The patch grid of the largest image the engine's image processor makes (its longest_edge pixels, with
    --mm-processor-kwargs applied, as a square; Qwen2-VL's default 12845056 when it cannot be built), or of a video's
    largest temporal patch when that is larger (Qwen3.x: its budget over at least temporal_patch_size frames; Qwen2.x:
    its per-frame budget)."""
    import math

    from voltllm.config import ConfigError
    from voltllm.multimodal.processor import image_processor_for

    pixels = None
    try:
        processor = image_processor_for(config)
        pixels = processor.hf_processor.size.longest_edge if processor is not None else None
        video = processor.video if processor is not None else None
        if video is not None:  # (Qwen2-VL's video processor bounds each frame's pixels, Qwen3-VL's all frames')
            pixels = max(pixels or 0, video.max_pixels if video.qwen2_family else
                         video.max_pixels // video.temporal_patch_size)
    except (ConfigError, AttributeError):
        pass
    unit = tower.patch * tower.merge
    side = max(1, math.isqrt(int(pixels or 12845056)) // unit) * tower.merge
    return (1, side, side)


def image_step_for(runner: Any) -> Optional[ImageStep]:
    """The runner's ImageStep when its engine takes images (multimodal/support.py), with the tower loaded."""
    from voltllm.multimodal.support import image_input_refusal

    config = runner.config
    if image_input_refusal(config) is not None:
        return None
    from voltllm.multimodal.vision_tower import deepstack_levels, load_vision_tower, vision_tower_for

    mc = config.model
    if runner.group is not None and runner.group.rank > 0:  # rank 0 encodes and broadcasts the rows: no tower here
        tower = None
    elif mc.load_format == "dummy":  # random weights at the checkpoint's shapes, as the language model's
        from voltllm.worker.runner import init_dummy_weights

        tower = vision_tower_for(mc.hf_config, runner.dtype).to(runner.device).requires_grad_(False)
        with torch.no_grad():
            init_dummy_weights(tower, mc.seed, runner.device)
    else:
        tower = load_vision_tower(mc.model, mc.hf_config, runner.dtype, runner.device, mc.mmproj)
    text = getattr(mc.hf_config, "text_config", None) or mc.hf_config
    from voltllm.model.layers.rotary import rope_parameters

    interleaved, section = mrope_layout(mc.hf_config.model_type, rope_parameters(text))
    sc = config.scheduler
    step = ImageStep(tower, runner.model.rotary, section, max(sc.max_num_batched_tokens, sc.max_num_seqs) + 8,
                     runner.device, deepstack_levels(mc.hf_config), interleaved)
    if tower is not None:
        step.largest_grid = largest_grid(config, tower)
    return step
