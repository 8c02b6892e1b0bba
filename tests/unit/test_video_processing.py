"""Video preprocessing (voltllm/multimodal/video.py, processor.py): frame sampling as vLLM's loader and transformers'
Qwen3-VL video processor, the patch rows in the image processor's layout, PyAV decoding of small MP4 / WebM files,
the placeholder expansion with timestamps, and the video flags (--limit-mm-per-prompt video, --media-io-kwargs,
--mm-processor-kwargs' video keys)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("av")

from voltllm.config import ConfigError, EngineArgs  # noqa: E402
from voltllm.multimodal.config import resolve_multimodal  # noqa: E402
from voltllm.multimodal.media import MediaError  # noqa: E402
from voltllm.multimodal.video import (VideoLoading, VideoSampling, decode_video, loader_indices,  # noqa: E402
                                      process_frames, sampled_indices, timestamps)
from vl_models import VL_PREPROCESSOR, vl_video_bytes  # noqa: E402

# the tiny checkpoint's settings (tests/vl_models.py): 4-pixel patches, 2 x 2 merge, 2 frames per temporal patch
TINY = VideoSampling(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=1024, max_pixels=65536, fps=2.0,
                     num_frames=None, min_frames=4, max_frames=768, mean=(0.5,) * 3, std=(0.5,) * 3,
                     rescale_factor=1 / 255)


def _frame(seed: int, h: int = 32, w: int = 48) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _image_rows(frame: np.ndarray) -> np.ndarray:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from PIL import Image

    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in VL_PREPROCESSOR.items()
                                            if k not in ("image_processor_type", "processor_class")})
    out = processor(images=[Image.fromarray(frame)], return_tensors="np")
    return out["pixel_values"], tuple(out["image_grid_thw"][0])


def test_rows_are_the_image_processors_layout():
    """A frame pair's rows hold each frame where the image processor puts its (repeated) frame: channel, then the
    temporal slot, then the patch's pixels; windows of merge x merge patches in the same order."""
    a, b = _frame(1), _frame(2)
    same = process_frames([a, a], [0, 1], 4.0, TINY)
    rows, grid = _image_rows(a)
    assert same.grid == grid == (1, 8, 12)
    np.testing.assert_allclose(same.pixel_values, rows, atol=1e-6)
    pair = process_frames([a, b], [0, 1], 4.0, TINY).pixel_values.reshape(-1, 3, 2, 16)
    np.testing.assert_allclose(pair[:, :, 0], rows.reshape(-1, 3, 2, 16)[:, :, 0], atol=1e-6)
    np.testing.assert_allclose(pair[:, :, 1], _image_rows(b)[0].reshape(-1, 3, 2, 16)[:, :, 0], atol=1e-6)
    # an odd count repeats the last frame; the patches are t-major
    three = process_frames([a, b, a], [0, 1, 2], 4.0, TINY)
    assert three.grid == (2, 8, 12)
    np.testing.assert_allclose(three.pixel_values[:96], pair.reshape(96, -1), atol=1e-6)
    np.testing.assert_allclose(three.pixel_values[96:], same.pixel_values, atol=1e-6)
    assert three.timestamps == (0.125, 0.5)


def test_frame_sampling_as_vllms_loader_then_the_processor():
    # vLLM's loader: 32 frames (its default) evenly spread, truncated, and then no processor sampling
    assert loader_indices(100, 25.0, VideoLoading()) == (np.linspace(0, 99, 32, dtype=int).tolist(), False)
    assert loader_indices(100, 25.0, VideoLoading(num_frames=-1, fps=1)) == ([0, 33, 66, 99], False)
    # a video of at most 32 frames is read whole: the processor samples at its fps (2), at least min_frames
    assert loader_indices(20, 4.0, VideoLoading()) == (list(range(20)), True)
    assert sampled_indices(20, 4.0, VideoLoading(), TINY) == np.linspace(0, 19, 10).round().astype(int).tolist()
    assert sampled_indices(6, 4.0, VideoLoading(), TINY) == [0, 2, 3, 5]  # (min_frames 4)
    assert sampled_indices(3, 4.0, VideoLoading(), TINY) == [0, 1, 2]  # (never more than the video has)
    fixed = VideoSampling(**{**TINY.__dict__, "fps": None, "num_frames": 6})
    assert sampled_indices(20, 4.0, VideoLoading(), fixed) == np.linspace(0, 19, 6).round().astype(int).tolist()
    assert timestamps([0, 3, 5, 8], 4.0, 2) == (0.375, 1.625)
    assert timestamps([0, 3, 5], 2.0, 2) == (0.75, 2.5)  # (the last frame fills the final patch)


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_decode_small_videos(fmt):
    video = decode_video(vl_video_bytes(0, 9, 32, 48, fps=4, fmt=fmt), VideoLoading(), TINY)
    assert video.grid == (2, 8, 12) and video.pixel_values.shape == (2 * 96, 3 * 2 * 16)
    assert video.timestamps == (0.375, 1.625)  # frames 0, 3, 5, 8 of 9 at 4 fps
    assert np.abs(video.pixel_values).max() <= 1.0 + 1e-6
    # 40 frames: the loader's num_frames (here 6) picks them, the processor takes them as they are
    six = decode_video(vl_video_bytes(1, 40, 32, 48, fps=8, fmt=fmt), VideoLoading(num_frames=6), TINY)
    assert six.grid[0] == 3 and six.timestamps == ((0 + 7) / 16, (15 + 23) / 16, (31 + 39) / 16)


def test_decode_refusals():
    with pytest.raises(MediaError, match="not a format FFmpeg can read"):
        decode_video(b"not a video at all", VideoLoading(), TINY)
    with pytest.raises(MediaError, match="temporal_factor"):  # one frame cannot fill a temporal patch
        decode_video(vl_video_bytes(2, 1, 32, 48), VideoLoading(), TINY)


def test_matches_transformers_video_processor():
    """transformers' Qwen3-VL video processor (needs torchvision, which CI lacks: skipped there) on the same
    frames: the same grid and rows up to the resize's rounding (torchvision's bicubic against PIL's)."""
    pytest.importorskip("torchvision")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    frames = np.stack([_frame(i, 40, 56) for i in range(8)])
    hf = Qwen3VLVideoProcessor(patch_size=4, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                               image_std=[0.5] * 3, size={"shortest_edge": 1024, "longest_edge": 65536},
                               cap_pixels_per_frame=False)
    out = hf(videos=[frames], video_metadata=[VideoMetadata(total_num_frames=8, fps=4.0)], do_sample_frames=True,
             return_tensors="np")
    indices = sampled_indices(8, 4.0, VideoLoading(), TINY)
    ours = process_frames(list(frames[indices]), indices, 4.0, TINY)
    assert tuple(out["video_grid_thw"][0]) == ours.grid
    assert np.abs(out["pixel_values_videos"] - ours.pixel_values).mean() < 0.02


def test_placeholder_expansion(tmp_path):
    """The template's <|vision_start|><|video_pad|><|vision_end|> becomes, per temporal patch, `<t seconds>`, vision
    start, its tokens, vision end; each patch one ImageInput of grid (1, h, w) at its first video token."""
    import transformers

    from vl_models import make_tiny_qwen3_vl
    from voltllm.multimodal.processor import ImageCountError, ImageProcessor

    path = make_tiny_qwen3_vl(str(tmp_path / "vl"))
    cfg = transformers.AutoConfig.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    proc = ImageProcessor.from_model(path, cfg, videos=True)
    assert proc.video.fps == 2 and proc.video.max_pixels == 65536  # (preprocessor_config.json's, as transformers)
    video = proc.video_from_bytes(vl_video_bytes(0, 9, 32, 48))
    start, end, pad = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.video_token_id
    ids, mm = proc.prepare([5, start, pad, end, 6], [], [video], tok)
    first = tok.encode("<0.4 seconds>", add_special_tokens=False)
    second = tok.encode("<1.6 seconds>", add_special_tokens=False)
    assert ids == [5, *first, start, *[pad] * 24, end, *second, start, *[pad] * 24, end, 6]
    assert [(im.offset, im.grid_thw, im.num_tokens) for im in mm.images] == [
        (len(first) + 2, (1, 8, 12), 24), (len(first) + len(second) + 28, (1, 8, 12), 24)]
    assert torch.equal(torch.cat([im.pixel_values for im in mm.images]), torch.from_numpy(video.pixel_values))
    assert mm.images[0].content_hash != mm.images[1].content_hash
    bare, _ = proc.prepare([5, pad, 6], [], [video], tok)  # a template without the wrapper: the same expansion
    assert bare == ids
    with pytest.raises(ImageCountError, match="1 video placeholder.* 2 video"):
        proc.prepare([5, start, pad, end], [], [video, video], tok)


def test_video_flags():
    mm = resolve_multimodal()
    assert mm.video_limit == 999 and mm.video_loading == VideoLoading(num_frames=32, fps=-1)
    mm = resolve_multimodal({"image": 0, "video": {"count": 2}}, media_io_kwargs='{"video": {"num_frames": 8}}')
    assert (mm.image_limit, mm.video_limit, mm.video_loading.num_frames) == (0, 2, 8)
    assert resolve_multimodal(media_io_kwargs={"video": {"num_frames": -1, "fps": 1}}).video_loading.fps == 1.0
    for bad, why in (({"video": {"num_frames": 0}}, "num_frames: a frame count"),
                     ({"video": {"frames": 4}}, "takes num_frames and fps, not frames"),
                     ({"image": {"image_mode": "L"}}, "only the video loader's settings"),
                     ({"video": 4}, "expected a JSON object")):
        with pytest.raises(ConfigError, match="--media-io-kwargs") as e:
            resolve_multimodal(media_io_kwargs=bad)
        assert why in str(e.value)
    with pytest.raises(ConfigError, match="--limit-mm-per-prompt audio.*not built"):
        resolve_multimodal({"audio": 1})


def test_engine_config_video_settings(tmp_path):
    from vl_models import make_tiny_qwen3_5_vl
    from voltllm.multimodal.processor import image_processor_for
    from voltllm.multimodal.support import image_input_refusal

    vl = make_tiny_qwen3_5_vl(str(tmp_path / "vl"))
    config = EngineArgs(model=vl, device="cpu", mm_processor_kwargs={"fps": 1, "max_frames": 16, "max_pixels": 4096},
                        media_io_kwargs={"video": {"num_frames": 8}}).create_engine_config()
    proc = image_processor_for(config)
    assert (proc.video.fps, proc.video.max_frames, proc.hf_processor.size.longest_edge) == (1.0, 16, 4096)
    assert proc.video_loading.num_frames == 8
    no_video = EngineArgs(model=vl, device="cpu", limit_mm_per_prompt={"video": 0}).create_engine_config()
    assert image_processor_for(no_video).video is None
    images_off = EngineArgs(model=vl, device="cpu", limit_mm_per_prompt={"image": 0}).create_engine_config()
    assert image_input_refusal(images_off) is None and image_processor_for(images_off).video is not None
    both_off = EngineArgs(model=vl, device="cpu", limit_mm_per_prompt={"image": 0, "video": 0}).create_engine_config()
    assert "image 0 and video 0" in image_input_refusal(both_off)
    for kwargs, why in (({"fps": 1, "num_frames": 4}, "exclusive"), ({"num_frames": 1000}, "max_frames"),
                        ({"do_sample_frames": False}, "neither the image processor"),
                        ({"temporal_patch_size": 3}, "temporal_patch_size")):
        with pytest.raises(ConfigError, match="--mm-processor-kwargs|processor") as e:
            EngineArgs(model=vl, device="cpu", mm_processor_kwargs=kwargs).create_engine_config()
        assert why in str(e.value), e.value


def test_qwen2_vl_video_settings(tmp_path):
    """Qwen2.5-VL / Qwen2-VL: transformers' Qwen2-VL video processor's settings (read without its torchvision
    module): min_pixels / max_pixels over size, per frame; its class defaults (CLIP mean / std) where the config
    says nothing; no processor sampling (the loader's frames); fps / num_frames refused by name."""
    import json
    import os
    from dataclasses import replace

    from vl_models import make_tiny_qwen2_5_vl
    from voltllm.multimodal.processor import image_processor_for
    from voltllm.multimodal.video import resized_size, video_sampling_for

    vl = make_tiny_qwen2_5_vl(str(tmp_path / "vl"))
    config = EngineArgs(model=vl, device="cpu", mm_processor_kwargs={"max_pixels": 4096},
                        media_io_kwargs={"video": {"num_frames": 8}}).create_engine_config()
    proc = image_processor_for(config)
    v = proc.video
    assert v.qwen2_family and v.fps is None and (v.min_pixels, v.max_pixels) == (1024, 4096)
    assert proc.hf_processor.size.longest_edge == 4096 and proc.tokens_per_second == 4.0
    assert sampled_indices(40, 4.0, VideoLoading(), v) == np.linspace(0, 39, 32, dtype=int).tolist()
    assert sampled_indices(9, 4.0, VideoLoading(), v) == list(range(9))  # (all read: still not resampled)
    # the budget is per frame: 9 frames of 32 x 48 keep their size (Qwen3-VL's rule shrinks them to fit all 9)
    assert resized_size(9, 32, 48, v) == (32, 48) and resized_size(9, 32, 48, replace(v, qwen2_family=False))[0] < 32
    assert resized_size(9, 64, 96, v) == (48, 72)  # (over 4096 pixels: scaled by sqrt(6144 / 4096), floored to 8)
    # a released Qwen2.5-VL preprocessor_config.json: min_pixels / max_pixels and no size, CLIP's mean by default
    bare = tmp_path / "bare"
    os.makedirs(bare)
    with open(bare / "preprocessor_config.json", "w") as f:
        json.dump({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                   "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor",
                   "processor_class": "Qwen2_5_VLProcessor"}, f)
    s = video_sampling_for(str(bare), {}, qwen2_family=True)
    assert (s.min_pixels, s.max_pixels, s.patch_size, s.min_frames) == (3136, 12845056, 14, 4)
    assert s.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073)) and s.max_video_tokens == 128000
    assert video_sampling_for(str(bare), {"max_pixels": 50176}, qwen2_family=True).max_pixels == 50176
    for kwargs, why in (({"fps": 1}, "fps: Qwen2-VL's video processor samples no frames"),
                        ({"num_frames": 4}, "--media-io-kwargs"), ({"nonsense": 1}, "Qwen2-VL's) takes nonsense")):
        with pytest.raises(ConfigError, match="--mm-processor-kwargs") as e:
            EngineArgs(model=vl, device="cpu", mm_processor_kwargs=kwargs).create_engine_config()
        assert why in str(e.value), e.value


def test_qwen2_video_expansion_and_seconds(tmp_path):
    """A Qwen2.x video: its tokens in one run in place of the placeholder (the template's vision start / end kept,
    no timestamps), one ImageInput per temporal patch; seconds per patch from the frames read (9 at 4 fps, 4 read:
    4 / 9 x 4 fps, 2 frames a patch: 1.125 s)."""
    from vl_models import make_tiny_qwen2_5_vl
    from voltllm.multimodal.processor import ImageProcessor
    from voltllm.multimodal.video import second_per_grid
    import transformers

    vl = make_tiny_qwen2_5_vl(str(tmp_path / "vl"))
    cfg = transformers.AutoConfig.from_pretrained(vl)
    tok = transformers.AutoTokenizer.from_pretrained(vl)
    proc = ImageProcessor.from_model(vl, cfg, videos=True)
    proc.video_loading = VideoLoading(num_frames=4)
    video = proc.video_from_bytes(vl_video_bytes(0, 9, 32, 48, fps=4))
    assert video.grid == (2, 8, 12) and video.second_per_grid == pytest.approx(1.125)
    assert second_per_grid(9, 9, 4.0, 2) == 0.5
    start, end = cfg.vision_start_token_id, cfg.vision_end_token_id
    prompt = [5, start, cfg.video_token_id, end, 6]
    ids, mm = proc.prepare(prompt, [], [video], tok)
    assert ids == [5, start] + [cfg.video_token_id] * 48 + [end, 6]
    assert [(im.offset, im.num_tokens, im.grid_thw) for im in mm.images] == [(2, 24, (1, 8, 12)), (26, 24, (1, 8, 12))]
    assert mm.rope_positions[0, [2, 26]].tolist() == [2, 6]  # (time step 4 x 1.125 = 4.5, floored)
