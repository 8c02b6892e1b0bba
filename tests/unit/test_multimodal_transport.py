"""MultiModalPrompt.for_tower: a half-precision engine's pixel rows go to the engine process in the tower's dtype
(half the bytes to pickle on the server's event loop), and the tower's output is the same as from float32 rows."""
import pickle

import numpy as np
import pytest
import torch

from voltllm.multimodal.inputs import ImageInput, MultiModalPrompt


def _prompt():
    pixels = torch.randn(16, 1176)
    return MultiModalPrompt((ImageInput(pixels, (1, 4, 4), b"h" * 32, 2, 4),), np.zeros((3, 8), dtype=np.int64), -2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_tower_gets_its_dtype(dtype):
    mm = _prompt()
    sent = mm.for_tower(dtype)
    im, orig = sent.images[0], mm.images[0]
    assert im.pixel_values.dtype == dtype and torch.equal(im.pixel_values, orig.pixel_values.to(dtype))
    assert (im.content_hash, im.grid_thw, im.offset, im.num_tokens) == (orig.content_hash, orig.grid_thw, orig.offset,
                                                                        orig.num_tokens)
    assert sent.rope_delta == mm.rope_delta and sent.rope_positions is mm.rope_positions
    assert len(pickle.dumps(sent)) < 0.6 * len(pickle.dumps(mm))


def test_float32_tower_unchanged():
    mm = _prompt()
    assert mm.for_tower(torch.float32) is mm


def test_tower_output_is_the_same_from_half_rows():
    """The tower casts its input to its own dtype first thing, so rows cast before sending change nothing."""
    from types import SimpleNamespace

    from voltllm.multimodal.vision_tower import vision_tower_for

    vision = SimpleNamespace(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, hidden_act="gelu_pytorch_tanh",
                             patch_size=4, temporal_patch_size=2, in_channels=3, spatial_merge_size=2,
                             out_hidden_size=24, num_position_embeddings=16, deepstack_visual_indexes=[])
    cfg = SimpleNamespace(model_type="qwen3_5", vision_config=vision)
    tower = vision_tower_for(cfg, torch.bfloat16)
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.2)
        pixels = torch.randn(16, 3 * 2 * 4 * 4)
        assert torch.equal(tower(pixels, [(1, 4, 4)]), tower(pixels.to(torch.bfloat16), [(1, 4, 4)]))
