"""A tiny random Qwen3.5 vision-language checkpoint saved with transformers at test time (no network): the hybrid text
model of tiny_models.HYBRID_COMMON, a 2-block vision tower, a small BPE tokenizer with Qwen's vision tokens and a
chat template that places images, and a Qwen2-VL image processor config."""
from __future__ import annotations

import json
import os

import torch

from tiny_models import HYBRID_COMMON, make_tokenizer, small_moe

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
# The byte-level tokenizer needs its 256-byte alphabet plus 3 specials, so its ids cannot fit HYBRID_COMMON's 192:
# the VL text model's vocabulary is padded up to VL_VOCAB instead (the tokenizer has 300 + 4 added tokens).
VL_TOKENIZER_VOCAB = 300
VL_VOCAB = 320

VL_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=2,
                 spatial_merge_size=2, num_position_embeddings=16, out_hidden_size=HYBRID_COMMON["hidden_size"],
                 in_channels=3, hidden_act="gelu_pytorch_tanh")

# ChatML whose content may be a list of parts: text parts as their text, image parts as Qwen's vision placeholder
# (the processor / engine expands <|image_pad|> to one token per merged patch), as Qwen3.5's own template does.
VL_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen2-VL's processor resizes to multiples of patch_size * merge_size (8 pixels) with between 8x8 and 64x64
# patches' worth of pixels: a 32x48 image keeps its size, grid (1, 8, 12).
_PATCH_PIXELS = VL_VISION["patch_size"] ** 2
VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": VL_VISION["patch_size"],
    "temporal_patch_size": VL_VISION["temporal_patch_size"],
    "merge_size": VL_VISION["spatial_merge_size"],
    "size": {"shortest_edge": 8 * 8 * _PATCH_PIXELS, "longest_edge": 64 * 64 * _PATCH_PIXELS},
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
}

_VL_CONFIGS = {"qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
               "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")}


def make_tiny_qwen3_5_vl(path: str, kind: str = "qwen3_5", seed: int = 0) -> str:
    """Save a tiny random Qwen3_5ForConditionalGeneration (kind "qwen3_5_moe": the MoE one with
    tiny_models.HYBRID_MOE's small experts) with tokenizer, chat template and image processor config under path.
    Vision weights are random with std 0.2 and LayerNorms 1 + noise, so a wrong vision kernel changes the output."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in _VL_CONFIGS[kind])
    os.makedirs(path, exist_ok=True)
    tok = make_tokenizer(path, vocab_size=VL_TOKENIZER_VOCAB, added_tokens=VISION_TOKENS)
    ids = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
                   tok.convert_tokens_to_ids(list(VISION_TOKENS))))
    assert len(tok) <= VL_VOCAB and max(ids.values()) < VL_VOCAB, (len(tok), ids)
    tok.chat_template = VL_CHATML
    tok.save_pretrained(path)

    text = {**HYBRID_COMMON, **small_moe(kind), "vocab_size": VL_VOCAB, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    cfg = config_cls(text_config=text, vision_config=dict(VL_VISION), tie_word_embeddings=False, **ids)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if ".visual." in f".{name}":
                is_norm_weight = "norm" in name and name.endswith("weight")
                p.copy_(1.0 + 0.1 * noise if is_norm_weight else 0.2 * noise)
            elif name.endswith("A_log"):  # slow-ish GDN decays, as tiny_models.make_tiny_hybrid
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=gen).log())
            elif "norm" in name:
                p.add_(0.2 * noise)
    model.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(VL_PREPROCESSOR, f, indent=2)
    return str(path)
