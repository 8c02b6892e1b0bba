"""M-RoPE positions and rotation rows against transformers' Qwen3.5 and Qwen3-VL (get_rope_index and the text
rotary): the two families share them."""
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel, Qwen3VLTextRotaryEmbedding

from voltllm.multimodal.mrope import axis_of_frequency, prompt_positions, rotation_rows

FAMILIES = {"qwen3_5": (Qwen3_5Config, Qwen3_5Model, Qwen3_5TextRotaryEmbedding),
            "qwen3_vl": (Qwen3VLConfig, Qwen3VLModel, Qwen3VLTextRotaryEmbedding)}


def _reference(n: int, images: list, family: str = "qwen3_5") -> tuple[torch.Tensor, int]:
    config_cls, model_cls, _ = FAMILIES[family]
    cfg = config_cls()
    model = model_cls.__new__(model_cls)
    torch.nn.Module.__init__(model)
    model.config = cfg
    types = torch.zeros(1, n, dtype=torch.int)
    for offset, (t, h, w) in images:
        types[0, offset:offset + t * h * w // 4] = 1
    grids = torch.tensor([g for _, g in images]) if images else None
    pos, delta = model.get_rope_index(torch.zeros(1, n, dtype=torch.long), types, grids)
    return pos[:, 0], int(delta)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("images", [[], [(0, (1, 4, 6))], [(3, (1, 4, 6)), (20, (1, 8, 4))], [(30, (1, 4, 4))]],
                         ids=["text", "first", "two", "last"])
def test_prompt_positions_match_transformers(images, family):
    want, delta = _reference(34, images, family)
    got, got_delta = prompt_positions(34, images, 2)
    assert got.dtype == np.int64 and (got == want.numpy()).all()
    assert got_delta == delta


def test_overlapping_or_overlong_images_are_refused():
    with pytest.raises(ValueError, match="overlap"):
        prompt_positions(30, [(4, (1, 4, 4)), (6, (1, 4, 4))], 2)
    with pytest.raises(ValueError, match="past the prompt"):
        prompt_positions(10, [(8, (1, 4, 4))], 2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rotation_rows_match_the_interleaved_text_rotary(family):
    images = [(3, (1, 4, 6)), (20, (1, 8, 4))]
    pos, _ = _reference(34, images, family)
    config_cls, _, rotary_cls = FAMILIES[family]
    rotary = rotary_cls(config_cls().text_config)
    cos, sin = rotary(torch.zeros(1), pos[:, None])
    half = rotary.inv_freq.shape[0]
    axis = torch.from_numpy(axis_of_frequency(half, rotary.mrope_section))
    mine, _ = prompt_positions(34, images, 2)
    c, s = rotation_rows(torch.from_numpy(mine), rotary.inv_freq, axis)
    torch.testing.assert_close(c, cos[0, :, :half].float(), rtol=0, atol=2e-6)
    torch.testing.assert_close(s, sin[0, :, :half].float(), rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="3 entries"):
        axis_of_frequency(half, [16, 16])
