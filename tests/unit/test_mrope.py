"""M-RoPE positions and rotation rows against transformers' Qwen3.5 (get_rope_index and the text rotary)."""
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5TextRotaryEmbedding

from voltllm.multimodal.mrope import axis_of_frequency, prompt_positions, rotation_rows


def _reference(n: int, images: list) -> tuple[torch.Tensor, int]:
    cfg = Qwen3_5Config()
    model = Qwen3_5Model.__new__(Qwen3_5Model)
    torch.nn.Module.__init__(model)
    model.config = cfg
    types = torch.zeros(1, n, dtype=torch.int)
    for offset, (t, h, w) in images:
        types[0, offset:offset + t * h * w // 4] = 1
    grids = torch.tensor([g for _, g in images]) if images else None
    pos, delta = model.get_rope_index(torch.zeros(1, n, dtype=torch.long), types, grids)
    return pos[:, 0], int(delta)


@pytest.mark.parametrize("images", [[], [(0, (1, 4, 6))], [(3, (1, 4, 6)), (20, (1, 8, 4))], [(30, (1, 4, 4))]],
                         ids=["text", "first", "two", "last"])
def test_prompt_positions_match_transformers(images):
    want, delta = _reference(34, images)
    got, got_delta = prompt_positions(34, images, 2)
    assert got.dtype == np.int64 and (got == want.numpy()).all()
    assert got_delta == delta


def test_overlapping_or_overlong_images_are_refused():
    with pytest.raises(ValueError, match="overlap"):
        prompt_positions(30, [(4, (1, 4, 4)), (6, (1, 4, 4))], 2)
    with pytest.raises(ValueError, match="past the prompt"):
        prompt_positions(10, [(8, (1, 4, 4))], 2)


def test_rotation_rows_match_the_interleaved_text_rotary():
    images = [(3, (1, 4, 6)), (20, (1, 8, 4))]
    pos, _ = _reference(34, images)
    rotary = Qwen3_5TextRotaryEmbedding(Qwen3_5Config().text_config)
    cos, sin = rotary(torch.zeros(1), pos[:, None])
    half = rotary.inv_freq.shape[0]
    axis = torch.from_numpy(axis_of_frequency(half, rotary.mrope_section))
    mine, _ = prompt_positions(34, images, 2)
    c, s = rotation_rows(torch.from_numpy(mine), rotary.inv_freq, axis)
    torch.testing.assert_close(c, cos[0, :, :half].float(), rtol=0, atol=2e-6)
    torch.testing.assert_close(s, sin[0, :, :half].float(), rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="3 entries"):
        axis_of_frequency(half, [16, 16])
