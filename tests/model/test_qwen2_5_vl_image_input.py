"""Qwen2.5-VL and Qwen2-VL image input end to end in the engine (tiny random checkpoints, fp32 CPU) against
transformers' Qwen2_5_VLForConditionalGeneration / Qwen2VLForConditionalGeneration: greedy tokens and their logprobs
with one image, two images split by chunked prefill beside a text request (also under -tp 2), the checkpoint named
either way (the released model.layers.* / visual.*, or model.language_model.* / model.visual.*); and the contiguous
M-RoPE rule matters (the interleaved one moves the output)."""
from __future__ import annotations

import glob
import os
import shutil

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from vl_models import (cpu_llm as _llm, run_greedy as _run, same_greedy as _same, vl_image as _image,  # noqa: E402
                       vl_prompt as _prompt, vl_reference as _reference, vl_setup)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def vl(request, tmp_path_factory):
    return vl_setup(str(tmp_path_factory.mktemp(request.param)), request.param)


def _two_images_and_text(vl):
    # 32 x 48: 6 windows of the Qwen2.5-VL tower; 40 x 56: 12 windows of 4 sizes
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 56)])
    text_ids, _, _ = _prompt(vl, ["Just some text here."], [])
    return (ids, out, mm), text_ids


def test_one_image_matches_transformers(vl):
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    llm = _llm(vl[0])
    step = llm.engine.runner.image_step
    assert step is not None and step.deepstack_levels == 0 and type(step.tower).__name__ == "Qwen2VisionTower"
    assert llm.engine.runner.model.tie == (vl[3].config.model_type == "qwen2_vl")  # (the tiny Qwen2-VL ties them)
    assert _same(_run(llm, [(ids, mm)])[0], _reference(vl, ids, out))
    assert not step.encoded


def test_two_images_split_by_chunked_prefill_and_a_text_request_beside(vl):
    (ids, out, mm), text_ids = _two_images_and_text(vl)
    llm = _llm(vl[0], max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_tensor_parallel_two_ranks_match_transformers(tmp_path):
    """-tp 2 (the Qwen2.5-VL kind): rank 0 encodes and broadcasts the rows; the qwen2 text model is split."""
    vl = vl_setup(str(tmp_path / "tp"), "qwen2_5_vl")
    (ids, out, mm), text_ids = _two_images_and_text(vl)
    llm = _llm(vl[0], tensor_parallel_size=2, max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_contiguous_mrope_matters(vl, monkeypatch):
    """The comparison above sees the contiguous rule: rotating the image tokens by the interleaved one (Qwen3.x's)
    moves the logprobs off transformers'."""
    from voltllm.worker import image_step

    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    layout = image_step.mrope_layout
    monkeypatch.setattr(image_step, "mrope_layout", lambda *a: (True, layout(*a)[1]))
    assert not _same(_run(_llm(vl[0]), [(ids, mm)])[0], _reference(vl, ids, out))


def test_checkpoint_named_under_language_model_and_model_visual(vl, tmp_path):
    """The tiny checkpoint is named as the released Qwen2-VL / Qwen2.5-VL ones (model.layers.*, visual.*, lm_head.*);
    the same tensors under model.language_model.* / model.visual.* give the same output."""
    from safetensors.torch import load_file, save_file

    assert any(k.startswith("visual.") for k in load_file(glob.glob(os.path.join(vl[0], "*.safetensors"))[0]))
    path = str(tmp_path / "renamed")
    shutil.copytree(vl[0], path)
    (file,) = glob.glob(os.path.join(path, "*.safetensors"))

    def renamed(name: str) -> str:
        if name.startswith("visual."):
            return "model." + name
        return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name

    save_file({renamed(k): v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    ids, out, mm = _prompt(vl, ["Look:", None, "and tell."], [_image(3, 40, 56)])
    assert _same(_run(_llm(path), [(ids, mm)])[0], _reference(vl, ids, out))


def test_dummy_weights_build_the_tower_and_profile_through_it(vl):
    """--load-format dummy builds a random Qwen2-VL / Qwen2.5-VL tower; memory profiling encodes through it."""
    ids, _, mm = _prompt(vl, ["Look:", None, "and tell."], [_image(5, 32, 48)])
    llm = _llm(vl[0], load_format="dummy", max_num_batched_tokens=16, enable_chunked_prefill=True)
    step = llm.engine.runner.image_step
    assert step.largest_grid == (1, 64, 64)  # the processor's longest_edge, 64 x 64 patches' pixels, as a square
    step.profile((1, 8, 8))
    assert len(_run(llm, [(ids, mm)])[0]) == 6


def test_lora_adapters_on_the_text_model_with_an_image(vl, tmp_path):
    """PEFT adapters on the qwen2 text model (named base_model.model.model.layers.*, as the checkpoint's), with an
    image in the prompt: the engine with the adapter equals the engine on the merged checkpoint."""
    from lora_adapters import make_adapter, merged_copy
    from vl_models import GREEDY
    from voltllm import LoRARequest
    from voltllm.engine.types import EngineCoreRequest

    adapter = make_adapter(str(tmp_path / "a"), vl[0], rank=4, alpha=8, seed=3, std=0.15)
    ids, _, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    want = _run(_llm(merged_copy(vl[0], adapter, str(tmp_path / "merged"))), [(ids, mm)])[0]
    core = _llm(vl[0], enable_lora=True, max_lora_rank=8).engine
    core.add_request(EngineCoreRequest("l", ids, GREEDY, multi_modal=mm, lora_request=LoRARequest("a", 1, adapter)))
    got = []
    while core.has_unfinished_requests():
        for o in core.step():
            got += [(t, lp[t][0]) for t, lp in zip(o.new_token_ids, o.new_logprobs)]
    assert _same(got, want) and not _same(got, _run(_llm(vl[0]), [(ids, mm)])[0])


def test_video_settings_follow_the_limit(vl):
    """Qwen2-VL / Qwen2.5-VL take videos (tests/model/test_qwen2_5_vl_video_input.py) with Qwen2-VL's video
    processor settings; --limit-mm-per-prompt video 0 refuses a video part by that name, images still work."""
    from voltllm.multimodal.media import MediaError
    from voltllm.multimodal.processor import image_processor_for

    proc = image_processor_for(_llm(vl[0]).config)
    assert proc is not None and proc.video is not None and proc.video.qwen2_family
    proc = image_processor_for(_llm(vl[0], limit_mm_per_prompt={"video": 0}).config)
    assert proc is not None and proc.video is None
    with pytest.raises(MediaError, match="video 0"):
        proc.video_from_bytes(b"\x00")
