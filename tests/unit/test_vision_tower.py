"""voltllm's Qwen3.5 vision tower against transformers' (model.model.visual(...).pooler_output) on the tiny VL
checkpoint (tests/vl_models.py), fed the real image processor's rows so the patch order is the processor's."""
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

from vl_models import make_tiny_qwen3_5_vl  # noqa: E402
from voltllm.multimodal.vision_tower import (  # noqa: E402
    image_token_count, load_vision_tower, vision_tower_for)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = make_tiny_qwen3_5_vl(str(tmp_path_factory.mktemp("vl")))
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    return SimpleNamespace(path=path, model=model, processor=processor,
                           tower=load_vision_tower(path, model.config, torch.float32, "cpu"))


def _images(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [PIL_Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes]


def _reference(model, pixel_values, grids):
    with torch.no_grad():
        return model.model.visual(pixel_values, grid_thw=torch.tensor(grids)).pooler_output


def _rel_err(ours, ref):
    return ((ours.float() - ref).norm() / ref.norm()).item()


def _check(vl, shapes, expect_grids):
    batch = vl.processor(images=_images(*shapes), return_tensors="pt")
    grids = batch["image_grid_thw"].tolist()
    assert grids == expect_grids
    with torch.no_grad():
        ours = vl.tower(batch["pixel_values"], grids)
    ref = _reference(vl.model, batch["pixel_values"], grids)
    assert ours.shape == ref.shape == (sum(image_token_count(g, 2) for g in grids), 64)
    assert ours.dtype == torch.float32
    assert _rel_err(ours, ref) < 1e-4
    return batch, ours


def test_one_image_matches_transformers(vl):
    batch, _ = _check(vl, [(32, 48)], [[1, 8, 12]])
    # Called outside no_grad (as the runner may), the loaded tower's rows hold no autograd graph.
    assert not vl.tower(batch["pixel_values"], [(1, 8, 12)]).requires_grad


def test_non_square_tall_grid_matches_transformers(vl):
    _check(vl, [(64, 24)], [[1, 16, 6]])


def test_two_images_of_different_grids_in_one_call(vl):
    batch, ours = _check(vl, [(32, 48), (40, 40)], [[1, 8, 12], [1, 10, 10]])
    # Each image attends only to itself: the batched rows equal each image run alone.
    alone = vl.tower(batch["pixel_values"][96:], [(1, 10, 10)])
    assert torch.allclose(ours[24:], alone, atol=1e-5, rtol=1e-5)


def test_frames_of_a_clip_attend_separately_as_transformers(vl):
    grids = [[2, 8, 8], [1, 8, 12]]
    pixels = torch.randn(2 * 64 + 96, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = vl.tower(pixels, grids)
    assert _rel_err(ours, _reference(vl.model, pixels, grids)) < 1e-4


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 3e-2)])
def test_half_precision_stays_finite_and_close(vl, dtype, tol):
    batch = vl.processor(images=_images((32, 48), (64, 24)), return_tensors="pt")
    grids = batch["image_grid_thw"].tolist()
    tower = load_vision_tower(vl.path, vl.model.config, dtype, "cpu")
    with torch.no_grad():
        ours = tower(batch["pixel_values"], grids)
    assert ours.dtype == dtype and torch.isfinite(ours).all()
    assert _rel_err(ours, _reference(vl.model, batch["pixel_values"], grids)) < tol


def test_moe_checkpoint_tower_matches_transformers(tmp_path):
    path = make_tiny_qwen3_5_vl(str(tmp_path), kind="qwen3_5_moe", seed=3)
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    batch = transformers.AutoImageProcessor.from_pretrained(path)(images=_images((48, 32)), return_tensors="pt")
    grids = batch["image_grid_thw"].tolist()
    with torch.no_grad():
        ours = load_vision_tower(path, model.config, torch.float32, "cpu")(batch["pixel_values"], grids)
    assert _rel_err(ours, _reference(model, batch["pixel_values"], grids)) < 1e-4


def _copy_checkpoint(src, dst, edit):
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_checkpoint_missing_a_vision_tensor_is_refused(vl, tmp_path):
    path = _copy_checkpoint(vl.path, str(tmp_path / "missing"),
                            lambda t: t.pop("model.visual.blocks.1.attn.qkv.bias"))
    with pytest.raises(ValueError, match=r"missing.*blocks\.1\.attn\.qkv\.bias"):
        load_vision_tower(path, vl.model.config, torch.float32, "cpu")


def test_checkpoint_with_an_unknown_vision_tensor_is_refused(vl, tmp_path):
    path = _copy_checkpoint(vl.path, str(tmp_path / "extra"),
                            lambda t: t.update({"model.visual.blocks.0.attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(ValueError, match=r"unknown.*blocks\.0\.attn\.q_norm\.weight"):
        load_vision_tower(path, vl.model.config, torch.float32, "cpu")


def test_pixel_rows_not_matching_the_grids_are_refused(vl):
    with pytest.raises(ValueError, match="do not match the grids"):
        vl.tower(torch.zeros(90, 96), [(1, 8, 12)])
    with pytest.raises(ValueError, match="spatial merge size"):
        vl.tower(torch.zeros(7 * 12, 96), [(1, 7, 12)])


def test_text_only_config_has_no_tower(vl):
    assert vision_tower_for(vl.model.config.text_config, torch.float32) is None
    assert vision_tower_for(vl.model.config, torch.float16) is not None
    assert image_token_count((1, 8, 12), 2) == 24 and image_token_count((2, 4, 4), 2) == 8


# --- Qwen3-VL: the same tower plus deepstack mergers -----------------------------------------------------------
def _qwen3_vl_reference(visual, pixel_values, grids):
    with torch.no_grad():
        out = visual(pixel_values, grid_thw=torch.tensor(grids))
    return out.pooler_output, out.deepstack_features


def test_qwen3_vl_tower_and_deepstack_rows_match_transformers(tmp_path):
    from vl_models import make_tiny_qwen3_vl

    path = make_tiny_qwen3_vl(str(tmp_path), "qwen3_vl", seed=2)
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    assert type(model.model.visual).__name__ == "Qwen3VLVisionModel"
    batch = transformers.AutoImageProcessor.from_pretrained(path)(images=_images((32, 48), (64, 24)),
                                                                  return_tensors="pt")
    grids = batch["image_grid_thw"].tolist()
    tower = load_vision_tower(path, model.config, torch.float32, "cpu")
    assert tower.deepstack_levels == 2
    with torch.no_grad():
        rows, deepstack = tower.forward_with_deepstack(batch["pixel_values"], grids)
        plain = tower(batch["pixel_values"], grids)
    ref_rows, ref_deepstack = _qwen3_vl_reference(model.model.visual, batch["pixel_values"], grids)
    assert rows.shape == ref_rows.shape == (24 + 24, 64) and torch.equal(plain, rows)
    assert _rel_err(rows, ref_rows) < 1e-4
    assert len(deepstack) == len(ref_deepstack) == 2
    for ours, ref in zip(deepstack, ref_deepstack):
        assert ours.shape == ref.shape == rows.shape and _rel_err(ours, ref) < 1e-4
    # the levels differ from the rows and from each other (a swapped merger or block would show)
    assert _rel_err(deepstack[0], deepstack[1]) > 0.1 and _rel_err(deepstack[0], rows) > 0.1


def test_deepstack_levels_follow_block_order_when_the_list_is_not_sorted():
    """transformers takes block i's merger at i's place in deepstack_visual_indexes and lists the levels in block
    order: with [2, 0], level 0 is block 0's output through merger 1."""
    from vl_models import QWEN3_VL_VISION, perturbed_tower

    cfg = transformers.Qwen3VLVisionConfig(**{**QWEN3_VL_VISION, "deepstack_visual_indexes": [2, 0]})
    torch.manual_seed(5)
    visual, tower = perturbed_tower(transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel(cfg).eval(),
                                    cfg)
    grids = [[1, 8, 12]]
    pixels = torch.randn(96, tower.patch_dim, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        rows, deepstack = tower.forward_with_deepstack(pixels, grids)
    ref_rows, ref_deepstack = _qwen3_vl_reference(visual, pixels, grids)
    assert _rel_err(rows, ref_rows) < 1e-4
    assert all(_rel_err(ours, ref) < 1e-4 for ours, ref in zip(deepstack, ref_deepstack))


def test_deepstack_indexes_outside_the_blocks_are_refused():
    from vl_models import QWEN3_VL_VISION

    with pytest.raises(ValueError, match=r"deepstack_visual_indexes \[0, 3\].*depth 3"):
        vision_tower_for(SimpleNamespace(vision_config={**QWEN3_VL_VISION, "deepstack_visual_indexes": [0, 3]}),
                         torch.float32)
