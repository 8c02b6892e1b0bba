"""Image input's flags (voltllm/multimodal/config.py): --limit-mm-per-prompt, --mm-processor-kwargs,
--allowed-local-media-path, --allowed-media-domains as typed config, and their refusals."""
from __future__ import annotations

import os

import pytest

from voltllm.config import ConfigError, EngineArgs
from voltllm.multimodal.config import DEFAULT_LIMIT, resolve_multimodal
from voltllm.multimodal.processor import image_processor_for
from voltllm.multimodal.support import image_input_refusal


def test_defaults():
    mm = resolve_multimodal()
    assert mm.image_limit == DEFAULT_LIMIT == 999 and mm.mm_processor_kwargs == {}
    assert mm.allowed_local_media_path is None and mm.allowed_media_domains is None
    assert resolve_multimodal(allowed_local_media_path="").allowed_local_media_path is None  # (vLLM's default)


def test_limits():
    assert resolve_multimodal({"image": 2}).image_limit == 2
    assert resolve_multimodal('{"image": {"count": 3}, "video": 0, "audio": 0}').image_limit == 3
    assert resolve_multimodal({"image": 0}).image_limit == 0
    assert resolve_multimodal({"video": 1}).video_limit == 1
    for bad, why in (({"audio": {"count": 2}}, "audio input"),
                     ({"image": -1}, "integer >= 0"), ({"image": "2"}, "integer >= 0"),
                     ({"image": {"count": 1, "width": 512}}, 'only "count"'), ('["image"]', "a JSON object"),
                     ({"vision_chunk": 1}, "modality 'vision_chunk'")):
        with pytest.raises(ConfigError, match="--limit-mm-per-prompt"):
            resolve_multimodal(bad)
        with pytest.raises(ConfigError, match=why):
            resolve_multimodal(bad)


def test_media_flags(tmp_path):
    mm = resolve_multimodal(allowed_local_media_path=str(tmp_path), allowed_media_domains=["Example.com", "a.org"])
    assert mm.allowed_local_media_path == os.path.realpath(tmp_path)
    assert mm.allowed_media_domains == ("example.com", "a.org")
    assert mm.media_settings().allowed_media_domains == ("example.com", "a.org")
    with pytest.raises(ConfigError, match="--allowed-local-media-path .*no such directory"):
        resolve_multimodal(allowed_local_media_path=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="--mm-processor-kwargs must be a JSON object"):
        resolve_multimodal(mm_processor_kwargs="[1]")


def test_cli_flags_reach_engine_args(tmp_path):
    import argparse

    from voltllm.cli import dashed_flags, dotted_json_flags
    from voltllm.cli_args import engine_args_from
    from voltllm.entrypoints.openai.cli_serve import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"), help="serve")
    argv = dotted_json_flags(dashed_flags(["serve", "m", "--limit-mm-per-prompt.image", "2", "--mm-processor-kwargs",
                                           '{"max_pixels": 4096}', "--allowed-local-media-path", str(tmp_path),
                                           "--media-io-kwargs", '{"video": {"num_frames": 8}}',
                                           "--allowed-media-domains", "a.com", "b.com"]))
    ea = engine_args_from(parser.parse_args(argv))
    assert ea.limit_mm_per_prompt == {"image": 2} and ea.mm_processor_kwargs == {"max_pixels": 4096}
    assert ea.allowed_local_media_path == str(tmp_path) and ea.allowed_media_domains == ["a.com", "b.com"]
    assert ea.media_io_kwargs == {"video": {"num_frames": 8}}


def test_engine_config(tmp_path):
    from tiny_models import make_model
    from vl_models import make_tiny_qwen3_5_vl

    text = make_model(str(tmp_path / "text"), "llama")
    # a text-only model ignores image settings, as vLLM's
    config = EngineArgs(model=text, device="cpu", limit_mm_per_prompt={"image": 4},
                        mm_processor_kwargs={"anything": 1}).create_engine_config()
    assert config.multimodal.image_limit == 4
    assert image_processor_for(config) is None
    vl = make_tiny_qwen3_5_vl(str(tmp_path / "vl"))
    config = EngineArgs(model=vl, device="cpu", mm_processor_kwargs={"max_pixels": 4096}).create_engine_config()
    assert config.multimodal.image_limit == 999 and image_input_refusal(config) is None
    assert image_processor_for(config).hf_processor.size.longest_edge == 4096
    # (videos stay on, vLLM's default 999, unless limited to 0 too)
    none = EngineArgs(model=vl, device="cpu", limit_mm_per_prompt={"image": 0, "video": 0}).create_engine_config()
    assert "--limit-mm-per-prompt image 0" in image_input_refusal(none) and image_processor_for(none) is None
    with pytest.raises(ConfigError, match="--mm-processor-kwargs.*takes num_crops"):  # checked at start
        EngineArgs(model=vl, device="cpu", mm_processor_kwargs={"num_crops": 4}).create_engine_config()
    # --language-model-only: the text model alone, so no processor is built (or checked)
    text_only = EngineArgs(model=vl, device="cpu", language_model_only=True,
                           mm_processor_kwargs={"num_crops": 4}).create_engine_config()
    assert "--language-model-only" in image_input_refusal(text_only) and image_processor_for(text_only) is None


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl", "qwen2_vl"])
def test_qwen3_vl_and_qwen2_vl_take_images_unless_told_otherwise(tmp_path, kind):
    from vl_models import make_tiny_qwen2_5_vl, make_tiny_qwen3_vl

    vl = (make_tiny_qwen2_5_vl if kind.startswith("qwen2") else make_tiny_qwen3_vl)(str(tmp_path / "vl"), kind)
    config = EngineArgs(model=vl, device="cpu").create_engine_config()
    assert image_input_refusal(config) is None and image_processor_for(config).merge == 2
    text_only = EngineArgs(model=vl, device="cpu", language_model_only=True).create_engine_config()
    assert "--language-model-only" in image_input_refusal(text_only)
    spec = EngineArgs(model=vl, device="cpu", speculative_config={"method": "draft_model", "model": vl,
                                                                  "num_speculative_tokens": 2}).create_engine_config()
    assert "draft-model" in image_input_refusal(spec)
