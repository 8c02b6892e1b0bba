"""M-RoPE positions and rotation rows against transformers' Qwen3.5, Qwen3-VL, Qwen2-VL and Qwen2.5-VL (get_rope_index
and the text rotary): the four share the positions of images; Qwen3.x rotate interleaved, Qwen2-VL / Qwen2.5-VL
contiguous."""
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel, Qwen3VLTextRotaryEmbedding

from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel, Qwen2_5_VLRotaryEmbedding
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel, Qwen2VLRotaryEmbedding

from voltllm.multimodal.mrope import axis_of_frequency, mrope_layout, prompt_positions, rotation_rows

FAMILIES = {"qwen3_5": (Qwen3_5Config, Qwen3_5Model, Qwen3_5TextRotaryEmbedding),
            "qwen3_vl": (Qwen3VLConfig, Qwen3VLModel, Qwen3VLTextRotaryEmbedding),
            "qwen2_vl": (Qwen2VLConfig, Qwen2VLModel, Qwen2VLRotaryEmbedding),
            "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2_5_VLRotaryEmbedding)}


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


def _rows(family: str, images: list, interleaved: bool) -> tuple:
    """Our rotation rows under the family's default config's layout (or the other one), and transformers'."""
    pos, _ = _reference(34, images, family)
    config_cls, _, rotary_cls = FAMILIES[family]
    text = config_cls().text_config
    rotary = rotary_cls(text)
    cos, sin = rotary(torch.zeros(1), pos[:, None])
    half = rotary.inv_freq.shape[0]
    layout_interleaved, section = mrope_layout(family, text.rope_parameters)
    assert section == list(rotary.mrope_section)
    axis = torch.from_numpy(axis_of_frequency(half, section, layout_interleaved == interleaved))
    mine, _ = prompt_positions(34, images, 2)
    c, s = rotation_rows(torch.from_numpy(mine), rotary.inv_freq, axis)
    return c, s, cos[0, :, :half].float(), sin[0, :, :half].float()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rotation_rows_match_the_text_rotary(family):
    """Qwen3.x interleaved, Qwen2-VL / Qwen2.5-VL contiguous ([16, 24, 24] over 64 frequencies), as mrope_layout
    picks from the default configs; the other rule's rows differ."""
    images = [(3, (1, 4, 6)), (20, (1, 8, 4))]
    c, s, cos, sin = _rows(family, images, True)
    torch.testing.assert_close(c, cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(s, sin, rtol=0, atol=2e-6)
    c, s, cos, sin = _rows(family, images, False)
    assert (c - cos).abs().max() > 0.1 and (s - sin).abs().max() > 0.1
    with pytest.raises(ValueError, match="3 entries"):
        axis_of_frequency(64, [16, 16])


def test_layout_rules():
    assert axis_of_frequency(8, [2, 3, 3], interleaved=False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert axis_of_frequency(8, [4, 2, 2]).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    with pytest.raises(ValueError, match=r"\[2, 3, 2\] must split the rotary half's 8"):
        axis_of_frequency(8, [2, 3, 2], interleaved=False)
    # the config's flag decides when it says, else the model type; the config's section, else transformers' default
    assert mrope_layout("qwen2_5_vl", {}) == (False, [16, 24, 24])
    assert mrope_layout("qwen2_vl", {"mrope_section": [2, 3, 3]}) == (False, [2, 3, 3])
    assert mrope_layout("qwen3_vl", {}) == (True, [24, 20, 20])
    assert mrope_layout("qwen3_5", {"mrope_interleaved": True, "mrope_section": [11, 11, 10]}) == (True, [11, 11, 10])
    assert mrope_layout("qwen2_5_vl", {"mrope_interleaved": True})[0] is True
    with pytest.raises(ValueError, match="no M-RoPE layout is known for model type 'qwen2'"):
        mrope_layout("qwen2", {})


def _video_reference(n: int, videos: list, family: str, seconds: list) -> tuple[torch.Tensor, int]:
    """transformers' get_rope_index of a prompt holding Qwen2.x videos (offset, grid) with second_per_grid_ts."""
    config_cls, model_cls, _ = FAMILIES[family]
    model = model_cls.__new__(model_cls)
    torch.nn.Module.__init__(model)
    model.config = config_cls()
    types = torch.zeros(1, n, dtype=torch.int)
    for offset, (t, h, w) in videos:
        types[0, offset:offset + t * h * w // 4] = 2
    extra = {"second_per_grid_ts": torch.tensor(seconds)} if family == "qwen2_5_vl" else {}
    pos, delta = model.get_rope_index(torch.zeros(1, n, dtype=torch.long), types, None,
                                      torch.tensor([g for _, g in videos]), **extra)
    return pos[:, 0], int(delta)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_video_positions_match_transformers(family):
    """A Qwen2.x video is one grid over its temporal patches, time positions floor(k x tokens_per_second x seconds
    per patch) (Qwen2.5-VL's default tokens_per_second 4; 2/3 s: a fractional step 8/3) or k (Qwen2-VL)."""
    tps = Qwen2_5_VLConfig().vision_config.tokens_per_second
    videos, seconds = [(2, (3, 8, 12)), (80, (2, 4, 6))], [2 / 3, 0.25]
    want, delta = _video_reference(100, videos, family, seconds)
    steps = [float(np.float32(tps) * np.float32(s)) if family == "qwen2_5_vl" else 1.0 for s in seconds]
    got, got_delta = prompt_positions(100, [(o, g, s) for (o, g), s in zip(videos, steps)], 2)
    assert (got == want.numpy()).all() and got_delta == delta
    if family == "qwen2_5_vl":
        assert got[0, [2, 26, 50]].tolist() == [2, 4, 7]


def test_text_after_a_long_video_continues_past_its_last_time():
    """Where a video's time positions pass its rows and columns (8 patches of 2 x 2 merged squares), the text after
    it starts one past the largest, as the Qwen models' original get_rope_index and vLLM's do; transformers 5's
    starts at the video's start + max(h, w) / merge, overlapping the video's times (not followed here)."""
    got, delta = prompt_positions(40, [(3, (8, 4, 4), 1.0)], 2)
    assert got[0, 3:35:4].tolist() == list(range(3, 11))  # each patch's first token: times 3 .. 10
    assert (got[:, 35:] == np.arange(11, 16)).all() and delta == 16 - 40
    want, _ = _video_reference(40, [(3, (8, 4, 4))], "qwen2_vl", [1.0])
    assert (got[:, :35] == want[:, :35].numpy()).all() and (want[:, 35:] == torch.arange(5, 10)).all()
