"""Qwen3-VL (dense and MoE) and Qwen3.5 (dense and MoE) as llama.cpp ships them: a qwen3vl / qwen3vlmoe / qwen35 /
qwen35moe GGUF language model plus its mmproj-*.gguf projector (qwen3vl_merger), written by tests/gguf_files.py from a
tiny random checkpoint as convert_hf_to_gguf.py does, in F16 that holds the checkpoint exactly. The engine on the two
files matches transformers' *ForConditionalGeneration on the original checkpoint (greedy tokens and logprobs, one
image); the comparison sees the deepstack levels' order; projector and model of different kinds are refused."""
from __future__ import annotations

import os

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
pytest.importorskip("gguf")

from gguf_files import fp16_exact_checkpoint, use_qwen_pre_tokenizer, write_qwen3_vl_ggufs  # noqa: E402
from vl_models import (VL_PREPROCESSOR, cpu_llm as _llm, make_tiny_qwen3_5_vl, make_tiny_qwen3_vl,  # noqa: E402
                       run_greedy as _run, same_greedy as _same, vl_image as _image, vl_prompt as _prompt,
                       vl_reference as _reference)

_PRE = {"qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35"}
_MODELS = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
           "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def _setup(root: str, kind: str, **write) -> tuple:
    """(vl tuple for vl_models' helpers, the GGUF model's path, its projector's path), the two files in root/gguf."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = os.path.join(root, "hf")
    if kind.startswith("qwen3_vl"):
        # (Qwen3-VL-MoE sparse in every layer, as the released models are: llama.cpp's qwen3vlmoe has no dense layer)
        make_tiny_qwen3_vl(hf, kind, seed=0, **({"mlp_only_layers": []} if kind == "qwen3_vl_moe" else {}))
    else:
        make_tiny_qwen3_5_vl(hf, kind, seed=0)
    use_qwen_pre_tokenizer(hf, _PRE[kind])
    fp16_exact_checkpoint(hf)
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in VL_PREPROCESSOR.items()
                                            if k not in ("image_processor_type", "processor_class")})
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    ref = getattr(transformers, _MODELS[kind]).from_pretrained(hf, dtype=torch.float32).eval()
    os.makedirs(os.path.join(root, "gguf"))
    lm, mmproj = os.path.join(root, "gguf", "tiny-F16.gguf"), os.path.join(root, "gguf", "mmproj-tiny-F16.gguf")
    write_qwen3_vl_ggufs(hf, lm, mmproj, **write)
    return (hf, processor, tok, ref), lm, mmproj


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
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
    assert step is not None and type(step.tower).__name__ == "VisionTower"
    assert step.tower.deepstack_levels == len(getattr(vl[3].config.vision_config, "deepstack_visual_indexes", None)
                                              or ())
    assert _same(_run(llm, [(ids, mm)])[0], _reference(vl, ids, out))


def test_the_comparison_sees_the_deepstack_level_order(tmp_path):
    """A projector whose deepstack mergers sit at each other's blocks (level 0's under block 2, level 1's under block
    0) moves an image prompt's output off transformers': the levels' order is the blocks' order."""
    vl, lm, _ = _setup(str(tmp_path / "a"), "qwen3_vl", deepstack_order=[1, 0])
    ids, out, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    assert not _same(_run(_llm(lm), [(ids, mm)])[0], _reference(vl, ids, out))


def test_metadata_as_the_converter_writes_it(files):
    """The deepstack blocks come from clip.vision.is_deepstack_layers (none for Qwen3.5), the position table's size
    from v.position_embd, and the processor's pixel bounds are the released Qwen3-VL / Qwen3.5 configs'."""
    from voltllm.model.loader.gguf_mmproj import read_mmproj

    vl, _, mmproj = files
    mm = read_mmproj(mmproj)
    vision = vl[3].config.vision_config
    assert mm.family == "qwen3_vl"
    assert mm.vision_config["deepstack_visual_indexes"] == list(getattr(vision, "deepstack_visual_indexes", None)
                                                                or ())
    assert mm.vision_config["num_position_embeddings"] == vision.num_position_embeddings
    assert mm.preprocessor["size"] == {"shortest_edge": 64 * 8 * 8, "longest_edge": 16384 * 8 * 8}


def test_projector_of_another_kind_is_refused(tmp_path):
    """A Qwen3.5 projector (no deepstack) beside a Qwen3-VL model, or a Qwen3-VL one beside a Qwen3.5 model."""
    import shutil

    from voltllm.config import ConfigError

    _, vl_lm, vl_proj = _setup(str(tmp_path / "vl"), "qwen3_vl")
    _, q35_lm, q35_proj = _setup(str(tmp_path / "q35"), "qwen3_5")
    for lm, proj in ((vl_lm, q35_proj), (q35_lm, vl_proj)):
        folder = str(tmp_path / f"pair-{os.path.basename(os.path.dirname(os.path.dirname(lm)))}")
        os.makedirs(folder)
        with pytest.raises(ConfigError, match="different models"):
            _llm(shutil.copy(lm, folder), mmproj=proj)
