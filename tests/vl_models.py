"""Tiny random vision-language checkpoints saved with transformers at test time (no network): Qwen3.5 (the hybrid text
model of tiny_models.HYBRID_COMMON, a 2-block vision tower), Qwen3-VL (a Qwen3 / Qwen3-MoE text model, a 3-block
tower with two deepstack levels) and Qwen2.5-VL / Qwen2-VL (a Qwen2 text model, 2-block towers), each with a small
BPE tokenizer with Qwen's vision tokens, a chat template that places images, and a Qwen2-VL image processor config."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np
import torch

from voltllm import SamplingParams
from voltllm.engine.types import EngineCoreRequest
from voltllm.multimodal.inputs import ImageInput, MultiModalPrompt
from voltllm.multimodal.mrope import prompt_positions

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
               "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
               "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
               "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
               "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
               "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
               "qwen4_exp": ("Qwen4ExpConfig", "Qwen4ExpForConditionalGeneration")}

# Qwen3-VL's text model: a Qwen3 (qwen3_vl_moe: Qwen3-MoE, layer 1 dense) as tiny_models.make_model's, with interleaved
# M-RoPE over its 8 rotary frequencies (t, h, w sections 4, 2, 2, summing to the half as [24, 20, 20] does for 128).
QWEN3_VL_TEXT = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                     initializer_range=0.08,
                     rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [4, 2, 2],
                                      "mrope_interleaved": True})
# (moe_intermediate_size 48: neither 2 * 48 nor 48 is the hidden size, so the stacked experts' orientation is plain)
QWEN3_VL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1,
                    mlp_only_layers=[1])
# its tower: Qwen3.5's with a third block and the outputs of blocks 0 and 2 as deepstack levels 0 and 1
QWEN3_VL_VISION = {**VL_VISION, "depth": 3, "deepstack_visual_indexes": [0, 2]}


# Qwen2-VL's / Qwen2.5-VL's text model: a Qwen2 (QKV bias) with contiguous M-RoPE over its 8 rotary frequencies (t,
# h, w sections 2, 3, 3 in order: they must add up to the half, as [16, 24, 24] does for 128).
QWEN2_VL_TEXT = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.08,
                     rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3]})
# Qwen2.5-VL's tower: RMSNorm, gated MLP, window attention. window_size 16 pixels is 2 x 2 merged squares (4 x 4
# patches), so a 32 x 48 image (grid 1 x 8 x 12) has 6 windows and a 40 x 24 one (1 x 10 x 6) 6 of 3 sizes; block 0
# attends within windows, block 1 over the whole image.
QWEN2_5_VL_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4,
                         temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=QWEN2_VL_TEXT["hidden_size"],
                         in_channels=3, hidden_act="silu", window_size=16, fullatt_block_indexes=[1])
# Qwen2-VL's tower: LayerNorm, QuickGELU MLP of embed_dim * mlp_ratio, full attention; its hidden_size is the output's
QWEN2_VL_VISION = dict(depth=2, embed_dim=32, hidden_size=QWEN2_VL_TEXT["hidden_size"], num_heads=2, mlp_ratio=2,
                       patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                       hidden_act="quick_gelu")


# Qwen4-Exp's text model (tests/model/test_qwen4_exp.py's shape): hyper-connections of 2 streams, MoE every layer, GDN
# and indexed attention; Qwen3.5's tower (VL_VISION). transformers always builds the QSA indexer: a budget past every
# context here is plain causal attention. QWEN4_EXP_PLE adds PLE layers 1 and 3 (n-gram hashes of the token ids).
QWEN4_EXP_TEXT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, hc_count=2,
                      hc_lowrank=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32,
                      indexer_budget=4096, indexer_compress_ratio=4,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                       "mrope_section": [4, 2, 2], "mrope_interleaved": True})
QWEN4_EXP_PLE = dict(ple_layer_ids=[1, 3], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=101,
                     make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, ple_conv_kernel_size=3)


def make_tiny_qwen4_exp_vl(path: str, kind: str = "qwen4_exp", seed: int = 0, ple: bool = True,
                           **text_overrides) -> str:
    """Save a tiny random Qwen4ExpForConditionalGeneration as make_tiny_qwen3_5_vl does: QWEN4_EXP_TEXT's text model
    (with QWEN4_EXP_PLE's PLE layers when ple; + text_overrides), VL_VISION's tower (Qwen3.5-MoE's)."""
    text = {**QWEN4_EXP_TEXT, **(QWEN4_EXP_PLE if ple else {}), **text_overrides}
    return _make_tiny_vl(path, "qwen4_exp", seed, text, dict(VL_VISION))


def make_tiny_qwen2_5_vl(path: str, kind: str = "qwen2_5_vl", seed: int = 0) -> str:
    """Save a tiny random Qwen2_5_VLForConditionalGeneration (kind "qwen2_vl": Qwen2VLForConditionalGeneration, with
    tied embeddings as Qwen2-VL-2B has) as make_tiny_qwen3_5_vl does: QWEN2_VL_TEXT's text model, QWEN2_5_VL_VISION's
    (QWEN2_VL_VISION's) tower."""
    vision = QWEN2_VL_VISION if kind == "qwen2_vl" else QWEN2_5_VL_VISION
    return _make_tiny_vl(path, kind, seed, dict(QWEN2_VL_TEXT), dict(vision), tie=kind == "qwen2_vl")


def make_tiny_qwen3_5_vl(path: str, kind: str = "qwen3_5", seed: int = 0) -> str:
    """Save a tiny random Qwen3_5ForConditionalGeneration (kind "qwen3_5_moe": the MoE one with
    tiny_models.HYBRID_MOE's small experts) with tokenizer, chat template and image processor config under path.
    Vision weights are random with std 0.2 and LayerNorms 1 + noise, so a wrong vision kernel changes the output."""
    text = {**HYBRID_COMMON, **small_moe(kind)}
    return _make_tiny_vl(path, kind, seed, text, dict(VL_VISION))


def make_tiny_qwen3_vl(path: str, kind: str = "qwen3_vl", seed: int = 0, **text_overrides) -> str:
    """Save a tiny random Qwen3VLForConditionalGeneration (kind "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration
    with QWEN3_VL_MOE's experts) as make_tiny_qwen3_5_vl does: QWEN3_VL_TEXT's text model (+ text_overrides),
    QWEN3_VL_VISION's tower (two deepstack levels, added after text layers 0 and 1)."""
    text = {**QWEN3_VL_TEXT, **(QWEN3_VL_MOE if kind == "qwen3_vl_moe" else {}), **text_overrides}
    return _make_tiny_vl(path, kind, seed, text, dict(QWEN3_VL_VISION))


def _make_tiny_vl(path: str, kind: str, seed: int, text: dict, vision: dict, tie: bool = False) -> str:
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in _VL_CONFIGS[kind])
    os.makedirs(path, exist_ok=True)
    tok = make_tokenizer(path, vocab_size=VL_TOKENIZER_VOCAB, added_tokens=VISION_TOKENS)
    ids = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
                   tok.convert_tokens_to_ids(list(VISION_TOKENS))))
    assert len(tok) <= VL_VOCAB and max(ids.values()) < VL_VOCAB, (len(tok), ids)
    tok.chat_template = VL_CHATML
    tok.save_pretrained(path)

    text = {**text, "vocab_size": VL_VOCAB, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}
    cfg = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=tie, **ids)
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
            elif "ngram_embedding" in name:  # (Qwen4-Exp's PLE tables: transformers' init is far smaller)
                p.copy_(noise)
    model.save_pretrained(path)
    if kind == "qwen3_vl_moe":
        _experts_as_released(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(VL_PREPROCESSOR, f, indent=2)
    return str(path)


def _experts_as_released(path: str) -> None:
    """Store the stacked experts as the released Qwen3-VL-MoE checkpoints do, [E, in, out] (gate_up [E, H, 2I], down
    [E, I, H]): transformers saves its in-memory [E, out, in] and reads either."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


# --- the engine vs transformers on the tiny checkpoint (tests/model/test_image_input.py, tests/gpu) -----------
NEW_TOKENS = 6  # greedy tokens per request


def vl_setup(path: str, kind: str = "qwen3_5", **make_kwargs) -> tuple:
    """(checkpoint path, its image processor, tokenizer, transformers' model): what the helpers below take as `vl`.
    kind: qwen3_5 / qwen3_5_moe (make_tiny_qwen3_5_vl), qwen3_vl / qwen3_vl_moe (make_tiny_qwen3_vl), qwen2_5_vl /
    qwen2_vl (make_tiny_qwen2_5_vl) or qwen4_exp (make_tiny_qwen4_exp_vl, which make_kwargs go to)."""
    import transformers

    make = (make_tiny_qwen3_vl if kind.startswith("qwen3_vl") else
            make_tiny_qwen2_5_vl if kind in ("qwen2_vl", "qwen2_5_vl") else
            make_tiny_qwen4_exp_vl if kind == "qwen4_exp" else make_tiny_qwen3_5_vl)
    path = make(path, kind, seed=0, **make_kwargs)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in VL_PREPROCESSOR.items()
                                            if k not in ("image_processor_type", "processor_class")})
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model_cls = getattr(transformers, _VL_CONFIGS[kind][1])
    ref = model_cls.from_pretrained(path, dtype=torch.float32).eval()
    return path, processor, tok, ref


def vl_image(seed: int, h: int, w: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def vl_prompt(vl, text_parts: list, images: list):
    """Token ids with each image's placeholder expanded, the processor's pixels, and our MultiModalPrompt."""
    _, processor, tok, ref = vl
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in text_parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    image_id = ref.config.image_token_id
    out = processor(images=images, return_tensors="pt") if images else None
    expanded, items, k = [], [], 0
    for t in ids:
        if t != image_id:
            expanded.append(t)
            continue
        grid = tuple(int(x) for x in out["image_grid_thw"][k])
        n = grid[0] * grid[1] * grid[2] // 4
        start = sum(int(np.prod(g)) for g in out["image_grid_thw"][:k].tolist())
        pixels = out["pixel_values"][start:start + int(np.prod(grid))]
        digest = hashlib.sha256(pixels.numpy().tobytes()).digest()
        items.append(ImageInput(pixels.float(), grid, digest, len(expanded), n))
        expanded += [image_id] * n
        k += 1
    assert k == len(images)
    pos, delta = prompt_positions(len(expanded), [(im.offset, im.grid_thw) for im in items], 2)
    mm = MultiModalPrompt(tuple(items), pos, delta) if items else None
    return expanded, out, mm


def vl_video_bytes(seed: int, frames: int, h: int, w: int, fps: int = 4, fmt: str = "mp4") -> bytes:
    """A small random video written with PyAV (mp4: MPEG-4 part 2; webm: VP8), in memory."""
    import io

    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream("mpeg4" if fmt == "mp4" else "libvpx", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buf.getvalue()


def vl_video_prompt(vl, text_parts: list, videos: list, processor=None):
    """Token ids with each video expanded by voltllm's processor (`processor`, else one built from the checkpoint),
    its MultiModalPrompt, and the reference's inputs: pixel_values_videos / video_grid_thw from that processor's
    rows (Qwen2.5-VL: and its second_per_grid_ts). videos: encoded video bytes, in the order of the None entries of
    text_parts."""
    from voltllm.multimodal.processor import ImageProcessor

    path, _, tok, ref = vl
    if processor is None:
        processor = ImageProcessor.from_model(path, ref.config, videos=True)
    content = [{"type": "video"} if p is None else {"type": "text", "text": p} for p in text_parts]
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    processed = [processor.video_from_bytes(data) for data in videos]
    ids, mm = processor.prepare(ids, [], processed, tok)
    out = {"pixel_values_videos": torch.cat([torch.from_numpy(v.pixel_values) for v in processed]),
           "video_grid_thw": torch.tensor([list(v.grid) for v in processed])}
    if ref.config.model_type == "qwen2_5_vl":  # (its processor's seconds per temporal patch: time positions' step)
        out["second_per_grid_ts"] = torch.tensor([v.second_per_grid for v in processed])
    return ids, out, mm


def vl_reference(vl, ids: list, out) -> list[tuple[int, float]]:
    """transformers' greedy tokens and their logprobs (out: the image processor's output, or vl_video_prompt's)."""
    ref = vl[3]
    inputs = {"input_ids": torch.tensor([ids])}
    if out is not None:
        types = ((inputs["input_ids"] == ref.config.image_token_id).int() +
                 2 * (inputs["input_ids"] == ref.config.video_token_id).int())
        inputs.update({k: v for k, v in out.items()}, mm_token_type_ids=types)
    with torch.no_grad():
        gen = ref.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                           output_logits=True, return_dict_in_generate=True)  # (raw: min_new_tokens masks EOS)
    tokens = gen.sequences[0, len(ids):].tolist()
    return [(t, torch.log_softmax(s[0].float(), -1)[t].item()) for t, s in zip(tokens, gen.logits)]


def same_greedy(got: list, want: list) -> bool:
    return [t for t, _ in got] == [t for t, _ in want] and all(abs(a - b) < 1e-4 for (_, a), (_, b) in
                                                               zip(got, want))


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


def run_greedy(llm, prompts: list, cached: Optional[list] = None) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy (token, logprob)s; `cached` gets each one's prefix-cache hit tokens."""
    core = llm.engine
    for i, (ids, mm) in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", ids, GREEDY, multi_modal=mm))
    got: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    hits: dict[str, int] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.request_id] += [(t, lp[t][0]) for t, lp in zip(o.new_token_ids, o.new_logprobs)]
            if o.finished:
                hits[o.request_id] = o.num_cached_tokens
    if cached is not None:
        cached += [hits[f"r{i}"] for i in range(len(prompts))]
    return [got[f"r{i}"] for i in range(len(prompts))]


def cpu_llm(path: str, **kw):
    """The engine the VL tests run: fp32 on the CPU, eager, 4 sequences."""
    from voltllm.entrypoints.llm import LLM

    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4, **kw)


def perturbed_tower(visual: torch.nn.Module, vision_config):
    """transformers' vision model `visual` (eval) with random weights from torch's generator (std 0.2, norms 1 +
    noise, as the tiny checkpoints' towers), and our tower holding the same weights: (visual, tower)."""
    from types import SimpleNamespace

    from voltllm.multimodal.vision_tower import vision_tower_for

    with torch.no_grad():
        for name, p in visual.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name and name.endswith("weight")
                    else 0.2 * torch.randn_like(p))
    tower = vision_tower_for(SimpleNamespace(vision_config=vision_config), torch.float32)
    tower.load_weights(visual.state_dict().items())
    return visual, tower
