"""The tiny Qwen3.5, Qwen3-VL, Qwen2.5-VL and Qwen2-VL test checkpoints (tests/vl_models.py) are what the vision tests
assume: transformers loads them, their vision token ids are the tokenizer's and inside the vocabulary, their chat
template places images, and the image processor lays a 32x48 image out as a (1, 8, 12) grid."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

from vl_models import (VISION_TOKENS, VL_VOCAB, make_tiny_qwen2_5_vl, make_tiny_qwen3_5_vl,  # noqa: E402
                       make_tiny_qwen3_vl)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl", "qwen2_vl"])
def test_tiny_vl_checkpoint_loads_and_sees_the_image(tmp_path, kind):
    make = (make_tiny_qwen3_vl if kind.startswith("qwen3_vl") else
            make_tiny_qwen2_5_vl if kind.startswith("qwen2") else make_tiny_qwen3_5_vl)
    path = make(str(tmp_path), kind)
    model = transformers.AutoModelForImageTextToText.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    proc = transformers.AutoImageProcessor.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == kind and cfg.text_config.vocab_size == VL_VOCAB
    ids = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    assert ids == [cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id]
    assert max(ids) < VL_VOCAB

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": "What is this?"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
                    "<|im_start|>assistant\n")

    image = PIL_Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8))
    pixels = proc(images=[image], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 8, 12]]
    assert tuple(pixels["pixel_values"].shape) == (96, 3 * 2 * 4 * 4)

    n_tokens = 8 * 12 // 4
    input_ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n_tokens), return_tensors="pt")["input_ids"]
    token_types = (input_ids == cfg.image_token_id).long()
    with torch.no_grad():
        logits = [model(input_ids=input_ids, pixel_values=pv, image_grid_thw=pixels["image_grid_thw"],
                        mm_token_type_ids=token_types).logits[0, -1]
                  for pv in (pixels["pixel_values"], pixels["pixel_values"] * 0.5)]
    assert torch.isfinite(logits[0]).all()
    assert (logits[0] - logits[1]).abs().max() > 0.05  # the image reaches the answer
