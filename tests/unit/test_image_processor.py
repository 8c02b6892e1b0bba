"""voltllm.multimodal.processor: the tiny Qwen3.5 VL checkpoint's image processor, placeholder expansion, content
hashes and M-RoPE positions."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from voltllm.config import ConfigError
from voltllm.multimodal.mrope import prompt_positions
from voltllm.multimodal.processor import ImageCountError, ImageProcessor
from vl_models import make_tiny_qwen3_5_vl


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_qwen3_5_vl(str(tmp_path_factory.mktemp("vl")))


@pytest.fixture(scope="module")
def hf_config(vl_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(vl_dir)


@pytest.fixture(scope="module")
def proc(vl_dir, hf_config):
    return ImageProcessor.from_model(vl_dir, hf_config)


def noise_image(w, h, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def test_expansion_offsets_and_pixels(proc, hf_config):
    img = hf_config.image_token_id
    a, b = noise_image(48, 32, 0), noise_image(32, 40, 1)  # grids (1, 8, 12) and (1, 10, 8): 24 and 20 tokens
    prompt = [5, 6, img, 7, img, 8, 9]
    ids, mm = proc.prepare(prompt, [a, b])
    assert [im.grid_thw for im in mm.images] == [(1, 8, 12), (1, 10, 8)]
    assert [(im.offset, im.num_tokens) for im in mm.images] == [(2, 24), (27, 20)]
    assert ids == [5, 6] + [img] * 24 + [7] + [img] * 20 + [8, 9]
    # the rows are transformers' processor's for that image alone
    ref = proc.hf_processor(images=[a], return_tensors="np")
    assert torch.equal(mm.images[0].pixel_values, torch.from_numpy(ref["pixel_values"]))
    assert mm.images[0].pixel_values.dtype == torch.float32
    # positions: mrope.prompt_positions over the expanded prompt
    pos, delta = prompt_positions(len(ids), [(2, (1, 8, 12)), (27, (1, 10, 8))], 2)
    assert np.array_equal(mm.rope_positions, pos) and mm.rope_delta == delta
    assert mm.rope_positions.shape == (3, len(ids))
    assert mm.rope_positions[:, 0].tolist() == [0, 0, 0] and mm.rope_positions[:, 2].tolist() == [2, 2, 2]
    assert mm.rope_positions[:, 2 + 23].tolist() == [2, 2 + 3, 2 + 5]  # (the last of a 4 x 6 merged grid)


def test_count_mismatch(proc, hf_config):
    img = hf_config.image_token_id
    with pytest.raises(ImageCountError, match="1 image placeholder.*2 image"):
        proc.prepare([1, img, 2], [noise_image(16, 16, 0), noise_image(16, 16, 1)])
    with pytest.raises(ImageCountError, match="2 image placeholder.*0 image"):
        proc.prepare([img, img], [])


def test_content_hash(proc, hf_config):
    img = hf_config.image_token_id
    _, mm = proc.prepare([img, img, img], [noise_image(32, 32, 0), noise_image(32, 32, 0), noise_image(32, 32, 1)])
    same, again, other = (im.content_hash for im in mm.images)
    assert same == again and same != other and len(same) == 32
    _, resized = proc.prepare([img], [noise_image(32, 32, 0).resize((40, 32))])
    assert resized.images[0].content_hash != same


def test_processor_kwargs(vl_dir, hf_config):
    small = ImageProcessor.from_model(vl_dir, hf_config, {"max_pixels": 8 * 8 * 16})
    _, mm = small.prepare([hf_config.image_token_id], [noise_image(64, 64, 0)])
    assert mm.images[0].grid_thw == (1, 8, 8) and mm.images[0].num_tokens == 16
    with pytest.raises(ConfigError, match="--mm-processor-kwargs.*takes num_crops"):
        ImageProcessor.from_model(vl_dir, hf_config, {"num_crops": 4})
    with pytest.raises(ConfigError, match="merge_size 4 is not the vision tower's spatial_merge_size 2"):
        ImageProcessor.from_model(vl_dir, hf_config, {"merge_size": 4})


def test_missing_preprocessor_config(tmp_path, hf_config):
    with pytest.raises(ConfigError, match="no preprocessor_config.json.*--language-model-only"):
        ImageProcessor.from_model(str(tmp_path), hf_config)
