"""Qwen2.5-VL / Qwen2-VL as llama.cpp ships them: a qwen2vl GGUF language model plus its mmproj-*.gguf vision projector
(tests/gguf_files.py writes both from a tiny random checkpoint as convert_hf_to_gguf.py does, F16 matrices that hold
the checkpoint exactly). The engine on the two files matches transformers on the original checkpoint (greedy tokens and
logprobs, one image; two images split by chunked prefill beside a text request); the projector beside the model is
found, or named with mmproj=; without one the model serves text; a wrong projector is a clear error; and the
comparison sees the Conv3d halves' order."""
from __future__ import annotations

import os
import shutil

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
pytest.importorskip("gguf")

from gguf_files import fp16_exact_checkpoint, use_qwen_pre_tokenizer, write_qwen2_vl_ggufs  # noqa: E402
from vl_models import (VL_PREPROCESSOR, cpu_llm as _llm, make_tiny_qwen2_5_vl, run_greedy as _run,  # noqa: E402
                       same_greedy as _same, vl_image as _image, vl_prompt as _prompt, vl_reference as _reference)

from voltllm.config import ConfigError  # noqa: E402


def _setup(root: str, kind: str, **write) -> tuple:
    """(vl tuple for vl_models' helpers, the GGUF model's path, its projector's path), the two files in root/gguf."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = make_tiny_qwen2_5_vl(os.path.join(root, "hf"), kind, seed=0)
    use_qwen_pre_tokenizer(hf, "qwen2vl")
    fp16_exact_checkpoint(hf)
    os.makedirs(os.path.join(root, "gguf"))
    lm, mmproj = os.path.join(root, "gguf", "tiny-F16.gguf"), os.path.join(root, "gguf", "mmproj-tiny-F16.gguf")
    write_qwen2_vl_ggufs(hf, lm, mmproj, **write)
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in VL_PREPROCESSOR.items()
                                            if k not in ("image_processor_type", "processor_class")})
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    model_cls = getattr(transformers, "Qwen2_5_VLForConditionalGeneration" if kind == "qwen2_5_vl"
                        else "Qwen2VLForConditionalGeneration")
    ref = model_cls.from_pretrained(hf, dtype=torch.float32).eval()
    return (hf, processor, tok, ref), lm, mmproj


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def files(request, tmp_path_factory):
    return _setup(str(tmp_path_factory.mktemp(request.param)), request.param)


def test_model_and_projector_match_transformers(files):
    vl, lm, mmproj = files
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    llm = _llm(lm)
    mc = llm.engine.config.model
    assert mc.mmproj == mmproj and mc.quantization == "gguf"  # (found beside the model file)
    assert mc.hf_config.model_type == vl[3].config.model_type
    step = llm.engine.runner.image_step
    assert step is not None and type(step.tower).__name__ == "Qwen2VisionTower"
    assert _same(_run(llm, [(ids, mm)])[0], _reference(vl, ids, out))


def test_two_images_by_chunked_prefill_beside_text(files):
    vl, lm, _ = files
    # 32 x 48: 6 windows of the Qwen2.5-VL tower; 40 x 56: 12 windows of 4 sizes
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 56)])
    text_ids, _, _ = _prompt(vl, ["Just some text here."], [])
    llm = _llm(lm, max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


def test_chat_with_an_image_url_matches_transformers(files, tmp_path):
    """LLM.chat end to end: the GGUF file's tokenizer and chat template, the projector's processor settings."""
    import base64
    import io

    from voltllm import SamplingParams

    vl, lm, _ = files
    image = _image(3, 32, 48)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    ids, out, _ = _prompt(vl, [None, "Describe it."], [image])
    want = _reference(vl, ids, out)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe it."}]}]
    got = _llm(lm).chat(messages, SamplingParams(max_tokens=len(want), temperature=0, ignore_eos=True))[0]
    assert list(got.prompt_token_ids) == ids
    assert list(got.outputs[0].token_ids) == [t for t, _ in want]


def test_projector_named_with_mmproj_elsewhere(files, tmp_path):
    vl, lm, mmproj = files
    alone = str(tmp_path / "alone")
    os.makedirs(alone)
    lm2 = shutil.copy(lm, alone)
    other = shutil.copy(mmproj, str(tmp_path / "vision.gguf"))
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    llm = _llm(lm2, mmproj=other)
    assert llm.engine.config.model.mmproj == other
    assert _same(_run(llm, [(ids, mm)])[0], _reference(vl, ids, out))


def test_without_a_projector_the_model_serves_text(files, tmp_path):
    from voltllm.multimodal.support import image_input_refusal

    vl, lm, _ = files
    lm2 = shutil.copy(lm, str(tmp_path))
    text_ids, _, _ = _prompt(vl, ["Just some text here."], [])
    llm = _llm(lm2)
    assert llm.engine.config.model.mmproj is None and "text-only" in image_input_refusal(llm.engine.config)
    assert _same(_run(llm, [(text_ids, None)])[0], _reference(vl, text_ids, None))
    # --language-model-only: the projector beside the model is not read
    llm = _llm(lm, language_model_only=True)
    assert llm.engine.config.model.mmproj is None and llm.engine.runner.image_step is None


def test_wrong_projector_files_are_clear_errors(files, tmp_path):
    from voltllm.model.loader import ModelLoadError

    vl, lm, mmproj = files
    with pytest.raises(ConfigError, match="not a llama.cpp vision projector"):
        _llm(lm, mmproj=lm)
    with pytest.raises(ConfigError, match="no such file"):
        _llm(lm, mmproj=str(tmp_path / "missing.gguf"))
    with pytest.raises((ValueError, ModelLoadError), match="vision projector"):
        _llm(mmproj)  # the projector given as the model
    both = str(tmp_path / "two")
    os.makedirs(both)
    lm2 = shutil.copy(lm, both)
    shutil.copy(mmproj, os.path.join(both, "mmproj-a.gguf"))
    shutil.copy(mmproj, os.path.join(both, "mmproj-b.gguf"))
    with pytest.raises(ConfigError, match="--mmproj PATH"):
        _llm(lm2)
    with pytest.raises(ConfigError, match="Hugging Face directory"):
        _llm(vl[0], mmproj=mmproj)


def test_projector_of_another_model_is_refused(tmp_path):
    """A projector whose output width is not the language model's hidden size."""
    from voltllm.model.loader.gguf_loader import gguf_config
    from voltllm.model.loader.gguf_mmproj import multimodal_config, read_mmproj

    _, lm, mmproj = _setup(str(tmp_path / "a"), "qwen2_5_vl")
    text = gguf_config(lm)
    text.hidden_size = 48
    with pytest.raises(ValueError, match="different models"):
        multimodal_config(lm, text, read_mmproj(mmproj))


def test_metadata_as_the_converter_writes_it(tmp_path):
    """Without clip.vision.window_size (the converter writes none) the window is clip.cpp's 112 pixels; the full
    attention blocks come from n_wa_pattern; Qwen2-VL's MLP width from its tensors (its feed_forward_length is the
    output width)."""
    from voltllm.model.loader.gguf_mmproj import read_mmproj

    vl, _, mmproj = _setup(str(tmp_path / "a"), "qwen2_5_vl", window_size=False)
    mm = read_mmproj(mmproj)
    vision = vl[3].config.vision_config
    assert mm.family == "qwen2_5_vl" and mm.vision_config["window_size"] == 112
    assert mm.vision_config["fullatt_block_indexes"] == list(vision.fullatt_block_indexes)
    assert mm.preprocessor["image_mean"] == VL_PREPROCESSOR["image_mean"]
    vl2, _, mmproj2 = _setup(str(tmp_path / "b"), "qwen2_vl")
    mm2 = read_mmproj(mmproj2)
    assert mm2.vision_config["mlp_ratio"] == vl2[3].config.vision_config.mlp_ratio
    assert mm2.vision_config["embed_dim"] == vl2[3].config.vision_config.embed_dim


def test_a_video_matches_and_sees_the_patch_embedding_halves(tmp_path, monkeypatch):
    """A video (its temporal patches hold two different frames; an image's two are the same, which makes the halves'
    order invisible to images) matches transformers; reading the Conv3d's two halves in the wrong order moves the
    output off it."""
    import torch

    from voltllm.model.loader import gguf_mmproj
    from vl_models import vl_video_bytes, vl_video_prompt

    vl, lm, _ = _setup(str(tmp_path / "a"), "qwen2_5_vl")
    ids, out, mm = vl_video_prompt(vl, [None, "What happens?"], [vl_video_bytes(0, 4, 32, 48)])
    want = _reference(vl, ids, out)
    assert _same(_run(_llm(lm), [(ids, mm)])[0], want)
    real = gguf_mmproj.mmproj_weights

    def swapped(m):
        for name, t in real(m):
            yield name, (torch.flip(t, dims=(2,)) if name == "patch_embed.proj.weight" else t)

    monkeypatch.setattr(gguf_mmproj, "mmproj_weights", swapped)
    assert not _same(_run(_llm(lm), [(ids, mm)])[0], want)


def test_the_comparison_sees_the_qkv_order(tmp_path, monkeypatch):
    """Joining attn_q / attn_k / attn_v in another order moves an image prompt's output off transformers'."""
    from voltllm.model.loader import gguf_mmproj

    vl, lm, _ = _setup(str(tmp_path / "a"), "qwen2_5_vl")
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    monkeypatch.setattr(gguf_mmproj, "_QKV", ("attn_k", "attn_q", "attn_v"))
    assert not _same(_run(_llm(lm), [(ids, mm)])[0], _reference(vl, ids, out))


def test_mmproj_flag_reaches_the_engine_args():
    import argparse

    from voltllm.cli_args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["--mmproj", "/m/mmproj-F16.gguf"])).mmproj == "/m/mmproj-F16.gguf"
    assert engine_args_from(p.parse_args([])).mmproj is None
