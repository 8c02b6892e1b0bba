"""A video part's bytes -> the vision tower's rows, as vLLM serves Qwen3-VL / Qwen3.5 and Qwen2.5-VL / Qwen2-VL
videos: PyAV decodes the frames, which are sampled as vLLM's video loader (--media-io-kwargs video num_frames / fps)
and then the model's transformers video processor do it (Qwen3-VL's samples by its fps, min_frames, max_frames;
Qwen2-VL's, which Qwen2.5-VL uses too, takes the loader's frames as they are), resized by the processor's smart-resize
rule (Qwen3-VL's pixel budget counts all frames, Qwen2-VL's each frame), normalized and cut into patch rows in the
processor's layout (temporal_patch_size frames per row). transformers' processors need torchvision for the pixel work
(Qwen2-VL's even to be imported); this does it with numpy and PIL (PIL's bicubic resize, as the PIL image
processor)."""
from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from voltllm.multimodal.media import MediaError

DEFAULT_NUM_FRAMES = 32  # vLLM's video loader: at most this many frames, evenly spread, unless it takes them all
DEFAULT_VIDEO_FPS = 24.0  # a stream that states no frame rate (transformers' fallback for the timestamps)
MAX_VIDEO_FRAMES = 1 << 20  # about 4.8 hours at 60 fps



@dataclass(frozen=True)
class VideoLoading:
    """--media-io-kwargs '{"video": {...}}' (vLLM's video loader settings)."""
    num_frames: int = DEFAULT_NUM_FRAMES  # -1: every frame (the processor then samples by its fps)
    fps: float = -1  # > 0: also at most duration x fps frames


@dataclass(frozen=True)
class VideoSampling:
    """The video processor's settings (video_preprocessor_config.json / preprocessor_config.json, class defaults,
    --mm-processor-kwargs over them)."""
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int  # size.shortest_edge: fewest pixels of all frames together
    max_pixels: int  # size.longest_edge: most pixels of all frames together
    fps: Optional[float]  # frames per second the processor samples (None with num_frames)
    num_frames: Optional[int]  # a fixed count the processor samples instead
    min_frames: int
    max_frames: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3  # PIL's BICUBIC
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768
    # Qwen3-VL's processor: min / max_pixels count all frames together and it samples among the loader's frames;
    # Qwen2-VL's (qwen2_family): they count one frame and it takes the loader's frames (do_sample_frames false)
    qwen2_family: bool = False


@dataclass(frozen=True)
class ProcessedVideo:
    pixel_values: np.ndarray  # [t * h * w, C * temporal_patch * patch * patch] float32, t-major
    grid: tuple[int, int, int]  # (t, h, w) patches; each temporal patch is one (1, h, w) grid to the tower
    timestamps: tuple[float, ...]  # seconds of each temporal patch (the mean of its first and last frame)
    # seconds one temporal patch spans: temporal_patch_size / the sampled frames' rate (transformers' Qwen2.5-VL
    # processor's second_per_grid_ts, which spaces the patches' M-RoPE time positions)
    second_per_grid: float = 1.0


@dataclass(frozen=True)
class _Stream:
    total_frames: int
    fps: float
    height: int
    width: int


def loader_indices(total: int, fps: float, loading: VideoLoading) -> tuple[list[int], bool]:
    """vLLM's video loader: the frames it reads, and whether the processor samples among them (it read them all)."""
    k = total
    if loading.num_frames > 0:
        k = min(loading.num_frames, total)
    if loading.fps > 0:
        k = min(k, math.floor(total / fps * loading.fps))
    k = max(1, k)
    if k == total:
        return list(range(total)), True
    return np.linspace(0, total - 1, k, dtype=int).tolist(), False  # (truncated, as vLLM's loader)


def sampled_indices(total: int, fps: float, loading: VideoLoading, s: VideoSampling) -> list[int]:
    """The video's frames that become the processor's frames, in order (a short video may repeat some)."""
    indices, processor_samples = loader_indices(total, fps, loading)
    if not processor_samples or s.qwen2_family:
        return indices
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    hf = Qwen3VLVideoProcessor(min_frames=s.min_frames, max_frames=s.max_frames, fps=s.fps or 2)
    chosen = hf.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), num_frames=s.num_frames,
                              fps=None if s.num_frames is not None else s.fps)
    return [int(i) for i in chosen]


def timestamps(indices: Sequence[int], fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's (the last frame repeats to
    fill the final patch), as Qwen3-VL's processor writes them before each patch's tokens."""
    idx = list(indices)
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    secs = [i / fps for i in idx]
    return tuple((secs[i] + secs[i + temporal_patch_size - 1]) / 2 for i in range(0, len(secs), temporal_patch_size))


def second_per_grid(num_sampled: int, total: int, fps: float, temporal_patch_size: int) -> float:
    """transformers' Qwen2.5-VL second_per_grid_ts: temporal_patch_size over the sampled frames' rate (its
    VideoMetadata.sampled_fps: sampled / total frames x the video's fps)."""
    return temporal_patch_size / (num_sampled / total * fps)


def resized_size(num_frames: int, height: int, width: int, s: VideoSampling) -> tuple[int, int]:
    """(height, width) of every frame after the processor's smart resize, whose pixel budget counts all frames
    (Qwen3-VL's) or each frame (Qwen2-VL's)."""
    if s.qwen2_family:
        return _qwen2_resized_size(num_frames, height, width, s)
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    factor = s.patch_size * s.merge_size
    max_pixels = s.max_pixels
    if s.cap_pixels_per_frame:  # (the processor's per-frame cap, when asked for)
        per_frame = max(min(s.max_video_tokens * factor * factor, s.max_pixels // num_frames),
                        int(s.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    try:
        return smart_resize(num_frames, height, width, temporal_factor=s.temporal_patch_size, factor=factor,
                            min_pixels=s.min_pixels, max_pixels=max_pixels)
    except ValueError as e:
        raise MediaError(f"the video cannot be used: {e}") from None


def _qwen2_resized_size(num_frames: int, height: int, width: int, s: VideoSampling) -> tuple[int, int]:
    """Qwen2-VL's video processor: the image smart resize per frame (its cap_pixels_per_frame: each frame at most an
    even share of 90% of max_video_tokens tokens' pixels, over temporal_patch_size frames, floored at 1.05 x
    min_pixels)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    factor = s.patch_size * s.merge_size
    max_pixels = s.max_pixels
    if s.cap_pixels_per_frame:
        total_pixels = int(s.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total_pixels * s.temporal_patch_size // num_frames), int(s.min_pixels * 1.05))
    try:
        return smart_resize(height, width, factor=factor, min_pixels=s.min_pixels, max_pixels=max_pixels)
    except ValueError as e:
        raise MediaError(f"the video cannot be used: {e}") from None


def resize_frame(frame: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """An RGB frame [H, W, 3] uint8 resized with PIL (the PIL image processor's resize)."""
    from PIL import Image

    return np.asarray(Image.fromarray(frame).resize((width, height), resample=resample))


def normalized(frames: np.ndarray, s: VideoSampling) -> np.ndarray:
    """[n, H, W, 3] uint8 -> [n, 3, H, W] float32, rescaled and normalized."""
    x = frames.astype(np.float32).transpose(0, 3, 1, 2)
    if s.do_rescale:
        x = x * np.float32(s.rescale_factor)
    if s.do_normalize:
        x = (x - np.asarray(s.mean, np.float32)[:, None, None]) / np.asarray(s.std, np.float32)[:, None, None]
    return x


def patchify(frames: np.ndarray, s: VideoSampling) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[n, C, H, W] -> rows [t * h * w, C * T * P * P] in the processor's order: temporal patch, then each
    merge x merge window of patches, row-major; within a row channel, frame, patch row, patch column. The last
    frame repeats to fill the final temporal patch."""
    n, c, height, width = frames.shape
    tp, p, m = s.temporal_patch_size, s.patch_size, s.merge_size
    if n % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], tp - n % tp, axis=0)])
    t, h, w = frames.shape[0] // tp, height // p, width // p
    x = frames.reshape(t, tp, c, h // m, m, p, w // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * h * w, c * tp * p * p), dtype=np.float32), (t, h, w)


def process_frames(frames: Sequence[np.ndarray], indices: Sequence[int], fps: float, s: VideoSampling,
                   total: Optional[int] = None) -> ProcessedVideo:
    """Sampled RGB frames (any size, uint8 [H, W, 3]) and their indices in the video of `total` frames (None: the
    frames are all of them) -> the tower's rows."""
    height, width = frames[0].shape[:2]
    rh, rw = resized_size(len(frames), height, width, s)
    resized = np.stack([resize_frame(f, rh, rw, s.resample) for f in frames])
    rows, grid = patchify(normalized(resized, s), s)
    return ProcessedVideo(rows, grid, timestamps(indices, fps, s.temporal_patch_size),
                          second_per_grid(len(indices), total or len(indices), fps, s.temporal_patch_size))


def decode_video(data: bytes, loading: VideoLoading, s: VideoSampling) -> ProcessedVideo:
    """Encoded video bytes (whatever FFmpeg reads: MP4, WebM, ...) -> the tower's rows. Only the sampled frames are
    converted, each resized as soon as it is decoded (the native frames are never all held)."""
    stream = _probe(data)
    total = stream.total_frames
    for _ in range(2):  # (again with the decoded count, for a container that overstated its frames)
        indices = sampled_indices(total, stream.fps, loading, s)
        rh, rw = resized_size(len(indices), stream.height, stream.width, s)
        frames, decoded = _decode_frames(data, indices, rh, rw, s.resample)
        if frames is not None:
            rows, grid = patchify(normalized(np.stack(frames), s), s)
            return ProcessedVideo(rows, grid, timestamps(indices, stream.fps, s.temporal_patch_size),
                                  second_per_grid(len(indices), total, stream.fps, s.temporal_patch_size))
        if decoded < 1:
            break
        total = decoded
    raise MediaError("the video has no frame that could be decoded")


def _open(data: bytes) -> Any:
    import av

    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as e:
        raise MediaError(f"the video is not a format FFmpeg can read: {e}") from None


def _probe(data: bytes) -> _Stream:
    """The first video stream's frame count (its header's, else its packets counted), frame rate and size."""
    import av

    with _open(data) as container:
        if not container.streams.video:
            raise MediaError("the video file holds no video stream")
        v = container.streams.video[0]
        rate = v.average_rate or v.guessed_rate or v.base_rate
        fps = float(rate) if rate else DEFAULT_VIDEO_FPS
        ctx = v.codec_context
        if ctx is None:
            raise MediaError("the video stream has no decoder FFmpeg knows")
        height, width = ctx.height, ctx.width
        total = v.frames
        if not total:
            try:
                total = sum(1 for packet in container.demux(v) if packet.size)
            except av.FFmpegError as e:
                raise MediaError(f"the video could not be read: {e}") from None
    if total < 1 or height < 1 or width < 1:
        raise MediaError("the video has no frames")
    if total > MAX_VIDEO_FRAMES:  # (a header's count is the sender's word: no frame list of a billion entries)
        raise MediaError(f"the video claims {total} frames: more than {MAX_VIDEO_FRAMES} are not read")
    return _Stream(total, fps, height, width)


def _decode_frames(data: bytes, indices: Sequence[int], height: int, width: int, resample: int
                   ) -> tuple[Optional[list[np.ndarray]], int]:
    """The frames at `indices` (repeats allowed), resized; (None, frames decoded) when the video ends first."""
    import av

    wanted: dict[int, int] = {}
    for i in indices:
        wanted[i] = wanted.get(i, 0) + 1
    last = max(indices)
    got: dict[int, np.ndarray] = {}
    decoded = 0
    with _open(data) as container:
        v = container.streams.video[0]
        v.thread_type = "AUTO"
        try:
            for frame in container.decode(v):
                if decoded in wanted:
                    got[decoded] = resize_frame(frame.to_ndarray(format="rgb24"), height, width, resample)
                decoded += 1
                if decoded > last:
                    break
        except av.FFmpegError as e:
            raise MediaError(f"the video could not be decoded: {e}") from None
    if len(got) < len(wanted):
        return None, decoded
    return [got[i] for i in indices], decoded


# --mm-processor-kwargs keys the video processor takes here (transformers' Qwen3-VL video processor's settings,
# less those that pick the output's container, and do_sample_frames / video_metadata: the loader decides)
VIDEO_SETTINGS = frozenset({"size", "patch_size", "temporal_patch_size", "merge_size", "fps", "num_frames",
                            "min_frames", "max_frames", "image_mean", "image_std", "rescale_factor", "do_rescale",
                            "do_normalize", "resample", "do_resize", "do_convert_rgb", "cap_pixels_per_frame",
                            "max_video_tokens"})


# keys Qwen2-VL's video processor takes besides those (its older per-frame pixel bounds, over size's)
QWEN2_VIDEO_SETTINGS = frozenset({"min_pixels", "max_pixels"})


def video_sampling_for(model_dir: str, kwargs: dict, qwen2_family: bool = False,
                       settings: Optional[dict] = None) -> VideoSampling:
    """The video processor's settings: transformers' Qwen3-VL video processor (qwen2_family: Qwen2-VL's, which
    Qwen2.5-VL uses too) as from_pretrained builds it (video_preprocessor_config.json, else preprocessor_config.json,
    over its class defaults) with `kwargs` (the --mm-processor-kwargs it takes) over them; `settings` in place of
    the directory's files (a GGUF projector's, model/loader/gguf_mmproj.py). ValueError for settings that cannot
    run."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if kwargs.get("do_resize") is False:
        raise ValueError("do_resize false: video frames are always resized to the patch grid")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("do_resize", "do_convert_rgb")}
    if kwargs.get("fps") is not None and kwargs.get("num_frames") is not None:
        raise ValueError("fps and num_frames are exclusive (the processor samples by one of them)")
    if qwen2_family:
        given = sorted(k for k in ("fps", "num_frames") if kwargs.get(k) is not None)
        if given:
            raise ValueError(f"{' and '.join(given)}: Qwen2-VL's video processor samples no frames (its "
                             "do_sample_frames is false), it takes the loader's; choose them with --media-io-kwargs "
                             "'{\"video\": {\"num_frames\": N, \"fps\": F}}'")
    cls = _qwen2_vl_video_processor() if qwen2_family else Qwen3VLVideoProcessor
    hf = cls.from_pretrained(model_dir, **kwargs) if settings is None else cls(**{**settings, **kwargs})
    size = hf.size
    if not size.shortest_edge or not size.longest_edge:
        raise ValueError(f"the video processor's size needs shortest_edge and longest_edge, got {dict(size)}")
    num_frames = kwargs.get("num_frames", getattr(hf, "num_frames", None))
    fps = None if num_frames is not None or qwen2_family else float(hf.fps)
    if num_frames is not None and not 1 <= int(num_frames) <= hf.max_frames:
        raise ValueError(f"num_frames {num_frames} must be between 1 and max_frames {hf.max_frames}")
    if fps is not None and fps <= 0:
        raise ValueError(f"fps must be above 0, got {fps}")
    if not 1 <= hf.min_frames <= hf.max_frames:
        raise ValueError(f"min_frames {hf.min_frames} / max_frames {hf.max_frames}: need 1 <= min <= max")
    mean, std = (tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
                 for v in (hf.image_mean, hf.image_std))
    return VideoSampling(patch_size=int(hf.patch_size), temporal_patch_size=int(hf.temporal_patch_size),
                         merge_size=int(hf.merge_size), min_pixels=int(size.shortest_edge),
                         max_pixels=int(size.longest_edge), fps=fps,
                         num_frames=None if num_frames is None else int(num_frames), min_frames=int(hf.min_frames),
                         max_frames=int(hf.max_frames), mean=mean, std=std, rescale_factor=float(hf.rescale_factor),
                         do_rescale=bool(hf.do_rescale), do_normalize=bool(hf.do_normalize),
                         resample=int(hf.resample), cap_pixels_per_frame=bool(hf.cap_pixels_per_frame),
                         max_video_tokens=int(hf.max_video_tokens), qwen2_family=qwen2_family)


@functools.lru_cache(maxsize=None)
def _qwen2_vl_video_processor() -> type:
    """transformers' Qwen2VLVideoProcessor's settings (class defaults, min_pixels / max_pixels over size) on
    BaseVideoProcessor's from_pretrained: its own module imports torchvision, which voltllm does not install."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
    from transformers.processing_utils import VideosKwargs
    from transformers.video_processing_utils import BaseVideoProcessor

    class Qwen2VLVideoKwargs(VideosKwargs, total=False):
        min_pixels: int
        max_pixels: int
        patch_size: int
        temporal_patch_size: int
        merge_size: int
        min_frames: int
        max_frames: int
        cap_pixels_per_frame: bool
        max_video_tokens: int

    class Qwen2VLVideoSettings(BaseVideoProcessor):
        resample = PILImageResampling.BICUBIC
        size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
        image_mean = OPENAI_CLIP_MEAN
        image_std = OPENAI_CLIP_STD
        do_resize = do_rescale = do_normalize = do_convert_rgb = True
        patch_size, temporal_patch_size, merge_size = 14, 2, 2
        min_frames, max_frames = 4, 768
        do_sample_frames = False
        cap_pixels_per_frame = None
        max_video_tokens = 128000
        valid_kwargs = Qwen2VLVideoKwargs

        def __init__(self, **kwargs: Any):
            size = dict(kwargs.pop("size", None) or self.size)
            for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                if kwargs.get(key) is not None:
                    size[edge] = kwargs.pop(key)
                kwargs.pop(key, None)
            super().__init__(size=size, **kwargs)

    return Qwen2VLVideoSettings
