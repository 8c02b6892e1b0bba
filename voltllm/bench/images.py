"""Requests with images for `voltllm bench --scenario random-mm`: vLLM's random multimodal dataset (`vllm bench serve
--dataset-name random-mm`) with its flags and semantics where they fit (docs/benchmarks.md says where they differ).

Each request is random text token ids (--input-len, spread by --random-range-ratio as in the concurrency scenario) and
N random images: N is drawn uniformly from [floor(n * (1 - r)), ceil(n * (1 + r))] (n = --random-mm-base-items-per-
request, r = --random-mm-num-mm-items-range-ratio), capped by --random-mm-limit-mm-per-prompt's image count; each
image's (height, width) is drawn from --random-mm-bucket-config's buckets by their (normalized) probabilities and its
pixels are uniform random bytes. Everything is drawn from the run's seed (numpy's default_rng, as vLLM), so every
runner gets the same requests; an image is sent as a JPEG data URL (vLLM's encoding), and in process the same JPEG
bytes are decoded, so both paths see the same pixels.

In process a request goes the way the server's chat route sends it: the text ids, then per image the model's
<|vision_start|><|image_pad|><|vision_end|> ids, through the frontend's image processor (multimodal/processor.py:
placeholders expanded, MultiModalPrompt) into an EngineCoreRequest. The processor runs before the run's clock starts
(its time per image is reported apart); TTFT is the engine's: the tower's encode and the prefill of text and image
tokens. Against a server: a streaming chat completion of one text part (the ids decoded with the model's tokenizer)
and the image_url parts, as vLLM's openai-chat backend sends them.
"""
from __future__ import annotations

import ast
import base64
import io
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from voltllm.config import ConfigError

# vLLM's defaults (its RandomMultiModalDataset): 1 item per request, fixed count, a cap of 255 images, and half of the
# images 256x256, half 720x1280 (its zero-probability video bucket is dropped, as vLLM drops it)
DEFAULT_BASE_ITEMS = 1
DEFAULT_LIMIT = {"image": 255, "video": 1}
DEFAULT_BUCKETS = {(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}
JPEG_QUALITY = 75  # Pillow's default, which vLLM's encoding uses


@dataclass(frozen=True)
class RandomMM:
    """The image part of the requests (vLLM's --random-mm-* flags), checked: buckets (height, width, probability)
    with probabilities > 0 summing to 1."""

    base_items: int = DEFAULT_BASE_ITEMS
    items_range_ratio: float = 0.0
    image_limit: int = DEFAULT_LIMIT["image"]
    buckets: tuple[tuple[int, int, float], ...] = ((256, 256, 0.5), (720, 1280, 0.5))

    @property
    def items_range(self) -> tuple[int, int]:
        """The inclusive range of images per request."""
        lo = max(0, math.floor(self.base_items * (1 - self.items_range_ratio)))
        return lo, min(self.image_limit, math.ceil(self.base_items * (1 + self.items_range_ratio)))

    @property
    def mean_items(self) -> float:
        lo, hi = self.items_range
        return (lo + hi) / 2

    def describe(self) -> dict:
        lo, hi = self.items_range
        return {"base_items_per_request": self.base_items, "num_mm_items_range_ratio": self.items_range_ratio,
                "image_limit": self.image_limit, "images_per_request_range": [lo, hi],
                "buckets": [{"height": h, "width": w, "probability": p} for h, w, p in self.buckets]}


def random_mm(base_items: Optional[int] = None, range_ratio: Optional[float] = None, limit: Any = None,
              buckets: Any = None) -> RandomMM:
    """RandomMM from the flags' values (None: vLLM's default); ConfigError naming the flag for a value that cannot
    run. limit and buckets may be given as the command line's strings."""
    base = DEFAULT_BASE_ITEMS if base_items is None else base_items
    ratio = 0.0 if range_ratio is None else range_ratio
    if base < 0:
        raise ConfigError(f"--random-mm-base-items-per-request must be >= 0, got {base}")
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"--random-mm-num-mm-items-range-ratio must be in [0, 1], got {ratio}")
    image_limit = _image_limit(DEFAULT_LIMIT if limit is None else limit)
    spec = RandomMM(base, ratio, image_limit, _buckets(DEFAULT_BUCKETS if buckets is None else buckets))
    lo, hi = spec.items_range
    if lo > hi:
        raise ConfigError(f"--random-mm-base-items-per-request {base} with --random-mm-num-mm-items-range-ratio "
                          f"{ratio} needs at least {lo} images per request, more than "
                          f"--random-mm-limit-mm-per-prompt's image {image_limit}")
    return spec


def _image_limit(limit: Any) -> int:
    if isinstance(limit, str):
        try:
            limit = json.loads(limit)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--random-mm-limit-mm-per-prompt must be a JSON object such as "
                              f"'{{\"image\": 3, \"video\": 0}}': {e}") from None
    if not isinstance(limit, dict):
        raise ConfigError(f"--random-mm-limit-mm-per-prompt must be a JSON object, got {json.dumps(limit)}")
    for modality, count in limit.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"--random-mm-limit-mm-per-prompt {modality}: a count >= 0, got {json.dumps(count)}")
    if "image" not in limit:  # (vLLM: only the modalities of the buckets count, and the buckets here are images)
        raise ConfigError("--random-mm-limit-mm-per-prompt must give an \"image\" count: the buckets are images")
    return limit["image"]


def _buckets(value: Any) -> tuple[tuple[int, int, float], ...]:
    """{(height, width, num_frames): probability} (a Python dict literal, or JSON with "(h, w, f)" keys as vLLM takes
    it) -> the image buckets, zero-probability ones dropped and the rest normalized."""
    flag = "--random-mm-bucket-config"
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ConfigError(f"{flag} must be a dict such as '{{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}}'"
                                  ) from None
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{flag} must be a non-empty dict {{(height, width, num_frames): probability}}")
    kept = []
    for key, p in value.items():
        if isinstance(key, str):
            try:
                key = ast.literal_eval(key)
            except (ValueError, SyntaxError):
                raise ConfigError(f"{flag}: the key {key!r} is not a (height, width, num_frames) tuple") from None
        if (not isinstance(key, (tuple, list)) or len(key) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in key)):
            raise ConfigError(f"{flag}: the key {key!r} is not a (height, width, num_frames) tuple of integers")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not p >= 0 or math.isinf(p):
            raise ConfigError(f"{flag}: the probability of {tuple(key)} must be a number >= 0, got {p!r}")
        h, w, frames = key
        if p == 0:
            continue
        if frames != 1:
            raise ConfigError(f"{flag}: the bucket {tuple(key)} is a {'video' if frames > 1 else 'audio'} item: "
                              "voltllm takes images only (num_frames 1); give it probability 0 or leave it out")
        if h < 1 or w < 1:
            raise ConfigError(f"{flag}: the image bucket {tuple(key)} needs a height and width >= 1")
        kept.append((h, w, float(p)))
    total = sum(p for _, _, p in kept)
    if not kept or total <= 0:
        raise ConfigError(f"{flag}: no bucket has a probability above 0")
    return tuple((h, w, p / total) for h, w, p in kept)


# -- the requests ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchImage:
    """One random image: its size and the seed of its pixels (made when it is sent, not held by the workload)."""

    height: int
    width: int
    seed: int

    def pixels(self) -> np.ndarray:
        return np.random.default_rng(self.seed).integers(0, 256, (self.height, self.width, 3), dtype=np.uint8)

    def jpeg(self) -> bytes:
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(self.pixels(), "RGB").save(buf, format="JPEG", quality=JPEG_QUALITY)
        return buf.getvalue()

    def data_url(self) -> str:
        return "data:image/jpeg;base64," + base64.b64encode(self.jpeg()).decode()


@dataclass(frozen=True)
class ImageTokens:
    """The model's vision token ids: a request's image placeholder (<|vision_start|><|image_pad|><|vision_end|>, as
    Qwen's chat templates write it) and the ids random text must not hold (a stray image token would not match the
    images given)."""

    image: int
    start: Optional[int]
    end: Optional[int]
    avoid: tuple[int, ...]

    @property
    def placeholder(self) -> list[int]:
        return [t for t in (self.start, self.image, self.end) if t is not None]


def image_tokens_of(hf_config: Any) -> ImageTokens:
    ids = {name: getattr(hf_config, name, None) for name in ("image_token_id", "vision_start_token_id",
                                                             "vision_end_token_id", "video_token_id")}
    return ImageTokens(int(ids["image_token_id"]), ids["vision_start_token_id"], ids["vision_end_token_id"],
                       tuple(sorted(int(v) for v in ids.values() if v is not None)))


def draw_requests(spec: RandomMM, tokens: ImageTokens, n: int, input_lens: list[int], vocab_size: int, seed: int
                  ) -> tuple[list[list[int]], list[tuple[BenchImage, ...]]]:
    """n requests' text ids (input_lens[i] ids from the vocabulary less the vision tokens) and images."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(tokens.avoid, dtype=np.int64))
    if not len(allowed):
        raise ConfigError(f"--prompt-vocab {vocab_size} holds only the model's vision tokens")
    lo, hi = spec.items_range
    sizes = [(h, w) for h, w, _ in spec.buckets]
    probs = np.asarray([p for _, _, p in spec.buckets])
    prompts, images = [], []
    for i in range(n):
        prompts.append(allowed[rng.integers(0, len(allowed), input_lens[i])].tolist())
        count = int(rng.integers(lo, hi + 1))
        picks = rng.choice(len(sizes), size=count, p=probs) if count else []
        images.append(tuple(BenchImage(*sizes[k], int(rng.integers(0, 2 ** 63))) for k in picks))
    return prompts, images


def bucket_grids(processor: Any, spec: RandomMM) -> dict[tuple[int, int], tuple[int, int, int]]:
    """The patch grid the image processor makes of each bucket's size (it depends on the size only)."""
    from PIL import Image

    return {(h, w): processor.process([Image.new("RGB", (w, h))])[0][1] for h, w, _ in spec.buckets}


def prepare_inprocess(processor: Any, tokens: ImageTokens, text: list[int], images: tuple[BenchImage, ...]
                      ) -> tuple[list[int], Any, float]:
    """The server's path for one request: (prompt ids with each placeholder expanded, its MultiModalPrompt or None,
    seconds the processor took). The images are decoded from the same JPEG bytes a server would get."""
    from voltllm.multimodal.media import decode_image

    ids = list(text) + tokens.placeholder * len(images)
    if not images:
        return ids, None, 0.0
    pictures = [decode_image(im.jpeg()) for im in images]
    t = time.perf_counter()
    ids, mm = processor.prepare(ids, pictures)
    return ids, mm, time.perf_counter() - t


# -- the vision tower's time per image, in process -----------------------------------------------------------------
class TowerTimer:
    """Times each call of the runner's vision tower (ImageStep._encode, wrapped on the instance while entered, so an
    engine without the timer pays nothing): CUDA events around it on a GPU (read after the run, no sync inside it),
    the wall clock on the CPU (where the call is synchronous)."""

    def __init__(self, image_step: Any, device: Any):
        self.step = image_step
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._calls: list[Any] = []

    def __enter__(self) -> "TowerTimer":
        encode, calls, cuda = self.step._encode, self._calls, self.cuda

        def timed(pixel_values: Any, grid: Any) -> Any:
            if cuda:
                import torch

                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = encode(pixel_values, grid)
                end.record()
                calls.append((start, end))
                return out
            t = time.perf_counter()
            out = encode(pixel_values, grid)
            calls.append((time.perf_counter() - t) * 1e3)
            return out

        self.step._encode = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.step._encode  # the class's method shows through again

    def mark(self) -> int:
        return len(self._calls)

    def since(self, mark: int) -> list[float]:
        """Milliseconds of each tower call after `mark`."""
        calls = self._calls[mark:]
        if self.cuda and calls:
            calls[-1][1].synchronize()  # (the last call's end event: every earlier one has completed too)
            return [s.elapsed_time(e) for s, e in calls]
        return list(calls)


# -- the hardware limit's image part -------------------------------------------------------------------------------
def image_cost(spec: RandomMM, grids: dict[tuple[int, int], tuple[int, int, int]], vision_config: Any,
               tokens: ImageTokens) -> dict:
    """What an image adds to a request on average over the buckets (by their probabilities): prompt tokens (one per
    merged patch window, and the placeholder's start / end tokens) and the vision tower's FLOPs (limits.tower_flops);
    and the images per request on average (the middle of the count range)."""
    from voltllm.bench.limits import tower_flops

    merge = int(vision_config.get("spatial_merge_size", 2) if isinstance(vision_config, dict)
                else getattr(vision_config, "spatial_merge_size", 2))
    extra = len(tokens.placeholder) - 1
    per_bucket = {f"{h}x{w}": {"grid": list(grids[(h, w)]), "probability": p,
                               "tokens": math.prod(grids[(h, w)]) // (merge * merge),
                               "tower_flops": tower_flops(vision_config, grids[(h, w)])} for h, w, p in spec.buckets}
    return {"images_per_request": spec.mean_items,
            "prompt_tokens_per_image": sum(b["probability"] * (b["tokens"] + extra) for b in per_bucket.values()),
            "tower_flops_per_image": sum(b["probability"] * b["tower_flops"] for b in per_bucket.values()),
            "buckets": per_bucket}
