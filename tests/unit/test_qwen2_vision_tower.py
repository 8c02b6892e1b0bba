"""voltllm's Qwen2.5-VL and Qwen2-VL vision towers against transformers' (model.model.visual(...).pooler_output) on
the tiny checkpoints of tests/vl_models.py, fed the real image processor's rows. Qwen2.5-VL's window attention is
really windowed there (several windows an image, some cut short at the edges; block 0 windowed, block 1 full), and
leaving out the window reordering or the windows moves the rows off transformers'."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

from vl_models import QWEN2_5_VL_VISION, QWEN2_VL_VISION, make_tiny_qwen2_5_vl, perturbed_tower  # noqa: E402
from voltllm.multimodal import qwen2_vision_tower as q2  # noqa: E402
from voltllm.multimodal.vision_tower import load_vision_tower  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def vl(request, tmp_path_factory):
    path = make_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp(request.param)), request.param, seed=4)
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    return SimpleNamespace(kind=request.param, path=path, model=model, processor=processor,
                           tower=load_vision_tower(path, model.config, torch.float32, "cpu"))


def _images(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [PIL_Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes]


def _rel_err(ours, ref):
    return ((ours.float() - ref).norm() / ref.norm()).item()


def _batch(vl, *shapes):
    batch = vl.processor(images=_images(*shapes), return_tensors="pt")
    grids = batch["image_grid_thw"].tolist()
    with torch.no_grad():
        ref = vl.model.model.visual(batch["pixel_values"], grid_thw=torch.tensor(grids)).pooler_output
    return batch["pixel_values"], grids, ref


def test_tower_matches_transformers(vl):
    # 32 x 48: grid 8 x 12, 6 whole windows; 40 x 56: grid 10 x 14 (5 x 7 merged squares), windows of 4 sizes
    pixels, grids, ref = _batch(vl, (32, 48), (40, 56))
    assert grids == [[1, 8, 12], [1, 10, 14]]
    assert type(vl.tower).__name__ == "Qwen2VisionTower" and vl.tower.family == vl.kind
    with torch.no_grad():
        ours = vl.tower(pixels, grids)
    assert ours.shape == ref.shape == (24 + 35, 64) and ours.dtype == torch.float32
    assert _rel_err(ours, ref) < 1e-4
    # one image alone gives its rows of the batch (windows and attention stay within an image)
    with torch.no_grad():
        alone = vl.tower(pixels[96:], [grids[1]])
    torch.testing.assert_close(alone, ours[24:], atol=1e-5, rtol=1e-5)
    assert not vl.tower(pixels, grids).requires_grad


def test_frames_of_a_clip_attend_separately_as_transformers(vl):
    grids = [[2, 8, 8], [1, 10, 6]]
    pixels = torch.randn(2 * 64 + 60, vl.tower.patch_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = vl.tower(pixels, grids)
        ref = vl.model.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    assert _rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 3e-2)])
def test_half_precision_stays_finite_and_close(vl, dtype, tol):
    pixels, grids, ref = _batch(vl, (32, 48), (40, 56))
    with torch.no_grad():
        ours = load_vision_tower(vl.path, vl.model.config, dtype, "cpu")(pixels, grids)
    assert ours.dtype == dtype and torch.isfinite(ours).all()
    assert _rel_err(ours, ref) < tol


def test_window_layout_of_an_image_with_cut_windows():
    """5 x 7 merged squares in windows of 2 x 2: rows of windows [2, 2, 1], columns [2, 2, 2, 1]."""
    order, lengths = q2.window_layout([(1, 10, 14)], 2, 2)
    assert sorted(order.tolist()) == list(range(35))
    assert order[:4].tolist() == [0, 1, 7, 8] and order[4:8].tolist() == [2, 3, 9, 10]
    assert [n // 4 for n in lengths] == [4, 4, 4, 2, 4, 4, 4, 2, 2, 2, 2, 1]
    order, lengths = q2.window_layout([(2, 4, 4), (1, 2, 4)], 2, 0)  # no windows: one per frame, in order
    assert order.tolist() == list(range(10)) and lengths == [16, 16, 8]


def test_windows_and_their_reordering_matter(monkeypatch):
    """The comparison above sees Qwen2.5-VL's windows: attending over the whole image in every block, or windowing
    the squares in the processor's order instead of window order, moves the rows off transformers'."""
    cfg = transformers.Qwen2_5_VLVisionConfig(**QWEN2_5_VL_VISION)
    torch.manual_seed(5)
    model_cls = transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
    visual, tower = perturbed_tower(model_cls(cfg).eval(), cfg)
    grids = [[1, 10, 14]]
    pixels = torch.randn(140, tower.patch_dim, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        assert _rel_err(tower(pixels, grids), ref) < 1e-4
        tower.full_blocks = frozenset(range(2))
        assert _rel_err(tower(pixels, grids), ref) > 1e-2
        tower.full_blocks = frozenset({1})
        layout = q2.window_layout
        monkeypatch.setattr(q2, "window_layout", lambda *a: (torch.arange(35), layout(*a)[1]))
        assert _rel_err(tower(pixels, grids), ref) > 1e-2


def test_family_and_sizes_from_the_vision_config():
    assert q2.qwen2_vision_family(QWEN2_5_VL_VISION) == "qwen2_5_vl"
    assert q2.qwen2_vision_family(QWEN2_VL_VISION) == "qwen2_vl"
    assert q2.qwen2_vision_family({"model_type": "qwen3_vl", "hidden_size": 32}) is None
    dims = q2.qwen2_vision_dims(QWEN2_VL_VISION)
    assert (dims["hidden"], dims["intermediate"], dims["out"], dims["window_units"]) == (32, 64, 64, 0)
    # a released Qwen2.5-VL's: windows of 112 pixels are 4 x 4 merged squares of 2 x 14 pixels
    dims = q2.qwen2_vision_dims({**QWEN2_5_VL_VISION, "patch_size": 14, "window_size": 112})
    assert dims["window_units"] == 4 and dims["full_blocks"] == {1}
    with pytest.raises(ValueError, match=r"fullatt_block_indexes \[2\].*depth 2"):
        q2.qwen2_vision_dims({**QWEN2_5_VL_VISION, "fullatt_block_indexes": [2]})
    with pytest.raises(ValueError, match="window_size 4 is smaller"):
        q2.qwen2_vision_dims({**QWEN2_5_VL_VISION, "window_size": 4})
