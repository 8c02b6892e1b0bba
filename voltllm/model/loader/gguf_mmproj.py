"""llama.cpp's multimodal projector files (mmproj-*.gguf) beside a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 GGUF
language model.

llama.cpp ships a vision-language model as two GGUF files: the language model (general.architecture "qwen2vl", a
qwen2 with M-RoPE sections in qwen2vl.rope.dimension_sections; "qwen3vl" / "qwen3vlmoe", a qwen3 / qwen3moe with
interleaved M-RoPE sections and n_deepstack_layers; "qwen35" / "qwen35moe", the hybrids of gguf_hybrid.py) and a
projector file (general.architecture "clip", written by convert_hf_to_gguf.py --mmproj) holding the vision tower. Here
the projector's metadata becomes the transformers vision_config and image-processor settings, its tensors the HF vision
tower's, and the two files together a Qwen2_5_VLConfig / Qwen2VLConfig / Qwen3VLConfig / Qwen3VLMoeConfig /
Qwen3_5Config / Qwen3_5MoeConfig, so the engine serves them as it serves the safetensors checkpoint.

What the converter changes, undone here (learnt from its Qwen2VLVisionModel, Qwen3VLVisionModel and clip.cpp's loader;
no code taken):
- the Conv3d patch embedding [out, C, 2, P, P] is written as two 2-D kernels, v.patch_embd.weight (the first frame of
  the temporal pair) and v.patch_embd.weight.1 (the second); Qwen3-VL's / Qwen3.5's bias as v.patch_embd.bias;
- Qwen2-VL / Qwen2.5-VL: each block's fused attn.qkv is split into attn_q / attn_k / attn_v (weights and biases);
  Qwen3-VL / Qwen3.5 keep it whole as attn_qkv;
- HF names become llama.cpp's: blocks.N.norm1 / norm2 -> v.blk.N.ln1 / ln2, attn.proj -> attn_out, the MLP's
  fc1 / fc2 (Qwen2-VL), gate_proj / up_proj / down_proj (Qwen2.5-VL) or linear_fc1 / linear_fc2 (Qwen3-VL, Qwen3.5)
  -> ffn_up / ffn_down / ffn_gate, merger.ln_q / merger.norm -> v.post_ln, merger.mlp.0 / mlp.2 / linear_fc1 /
  linear_fc2 -> mm.0 / mm.2, Qwen3-VL's pos_embed -> v.position_embd;
- Qwen3-VL's deepstack mergers (deepstack_merger_list.k, k-th of deepstack_visual_indexes) are named by the block they
  follow, v.deepstack.B.norm / fc1 / fc2 with B = deepstack_visual_indexes[k], and the blocks are flagged in
  clip.vision.is_deepstack_layers: level k is the k-th such block in block order (the order the tower runs them);
- Qwen3.5 and Qwen3-VL share the projector type qwen3vl_merger (the converter's one Qwen3VLVisionModel writes both; a
  Qwen3.5 tower flags no deepstack block): the language model's architecture tells which model the pair is;
- Qwen2.5-VL's fullatt_block_indexes [n-1, 2n-1, ...] become clip.vision.n_wa_pattern = n; the window size and spatial
  merge size are not written (clip.cpp assumes 112 pixels and 2; clip.vision.window_size /
  clip.vision.spatial_merge_size are read when present);
- Qwen2-VL's feed_forward_length is its vision_config.hidden_size (the output width), not the MLP's: the MLP width is
  taken from the ffn_up tensor instead (for every family).
The image processor's settings come from clip.vision.image_mean / image_std / patch_size (+ image_min_pixels /
image_max_pixels when written; else the released models' preprocessor_config.json bounds: 4 and 16384 merged squares
for Qwen2-VL / Qwen2.5-VL, 64 and 16384 for Qwen3-VL / Qwen3.5 (shortest_edge 65536, longest_edge 16777216 pixels at
32-pixel squares))."""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

# clip.projector_type -> the tower it holds ("qwen3_vl": Qwen3-VL's, or Qwen3.5's: Qwen3-VL's without deepstack)
PROJECTOR_FAMILIES = {"qwen2vl_merger": "qwen2_vl", "qwen2.5vl_merger": "qwen2_5_vl", "qwen3vl_merger": "qwen3_vl"}
# language-model architecture -> (the projector family it takes, its multimodal transformers config, architecture)
_LM_MODELS = {"qwen2vl": ("qwen2", None, None),  # (Qwen2-VL's or Qwen2.5-VL's: the projector tells which)
              "qwen3vl": ("qwen3_vl", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
              "qwen3vlmoe": ("qwen3_vl", "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
              "qwen35": ("qwen3_vl", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
              "qwen35moe": ("qwen3_vl", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")}
# language-model architectures that take a projector file
MMPROJ_LM_ARCHS = tuple(_LM_MODELS)
_VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                  "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
_DEFAULT_WINDOW = 112  # clip.cpp's window size for Qwen2.5-VL files without clip.vision.window_size
# the released configs' bounds in merged squares: Qwen2.x min_pixels 3136 / max_pixels 12845056 at 28-pixel squares,
# Qwen3-VL / Qwen3.5 shortest_edge 65536 / longest_edge 16777216 at 32-pixel squares
_SQUARES = {"qwen2_vl": (4, 16384), "qwen2_5_vl": (4, 16384), "qwen3_vl": (64, 16384)}

# llama.cpp block tensor -> HF tower name (under blocks.N.); Qwen2-VL's MLP is fc1 / fc2, Qwen2.5-VL's gated
_BLOCK_NAMES = {"ln1": "norm1", "ln2": "norm2", "attn_out": "attn.proj"}
_MLP_NAMES = {"qwen2_vl": {"ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
              "qwen2_5_vl": {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
              "qwen3_vl": {"ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2", "attn_qkv": "attn.qkv"}}
_GLOBAL_NAMES = {"qwen2": {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"},
                 "qwen3_vl": {"v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2",
                              "v.patch_embd": "patch_embed.proj", "v.position_embd": "pos_embed"}}
_DEEPSTACK_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
_BLOCK_RE = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
_DEEPSTACK_RE = re.compile(r"v\.deepstack\.(\d+)\.(\w+)\.(weight|bias)")
_QKV = ("attn_q", "attn_k", "attn_v")


def is_projector_name(file_name: str) -> bool:
    """Whether a .gguf file's name marks a vision projector, not a language model: "mmproj" anywhere in it, in any
    letter case (as llama.cpp tells them apart in a Hub repo: mmproj-F16.gguf, mmproj-model-f16.gguf,
    Qwen2.5-VL-7B-Instruct-mmproj-f16.gguf)."""
    name = os.path.basename(file_name).lower()
    return name.endswith(".gguf") and "mmproj" in name


def find_mmproj(model_file: str, explicit: Optional[str] = None) -> Optional[str]:
    """The projector file of the GGUF model `model_file`: `explicit` (--mmproj) when given, else the one projector
    file (is_projector_name) beside the model (None when there is none). ValueError for a missing explicit file or
    several candidates."""
    if explicit:
        path = os.path.expanduser(explicit)
        if not os.path.isfile(path):
            raise ValueError(f"--mmproj {explicit}: no such file")
        return path
    folder = os.path.dirname(os.path.abspath(model_file))
    found = sorted(f for f in os.listdir(folder) if is_projector_name(f))
    if len(found) > 1:
        raise ValueError(f"{folder} holds {len(found)} projector files ({', '.join(found)}): name the one to use with "
                         "--mmproj PATH (or serve the text model alone with --language-model-only)")
    return os.path.join(folder, found[0]) if found else None


@dataclass(frozen=True)
class Mmproj:
    """What a projector file describes: the tower family ("qwen2_vl" / "qwen2_5_vl"), its transformers
    vision_config (a dict) and the image processor's settings (Qwen2VLImageProcessor keyword arguments)."""
    path: str
    family: str
    vision_config: dict
    preprocessor: dict


@functools.lru_cache(maxsize=2)
def _reader(path: str, size: int, mtime: int) -> Any:
    from voltllm.model.loader.gguf_reader import open_gguf

    return open_gguf(path)


def _open(path: str) -> Any:
    st = os.stat(path)
    return _reader(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def _meta(reader: Any) -> dict:
    return {k: f.contents() for k, f in reader.fields.items()}


def read_mmproj(path: str) -> Mmproj:
    """The projector file's vision_config and processor settings; ValueError naming what is wrong for a file that is
    no Qwen vision projector voltllm reads."""
    try:
        reader = _open(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"projector file {path!r} is not a readable GGUF file: {e}") from None
    meta = _meta(reader)
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder"):
        raise ValueError(f"{path!r} is not a llama.cpp vision projector (mmproj) file: its general.architecture is "
                         f"{meta.get('general.architecture')!r}, not 'clip' with a vision encoder")
    kind = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    family = PROJECTOR_FAMILIES.get(kind)
    if family is None:
        raise ValueError(f"projector file {path!r} holds a {kind!r} projector; built: "
                         f"{', '.join(PROJECTOR_FAMILIES)} (Qwen2-VL, Qwen2.5-VL, Qwen3-VL / Qwen3.5)")

    def key(name: str, default: Any = KeyError) -> Any:
        value = meta.get(f"clip.vision.{name}", default)
        if value is KeyError:
            raise ValueError(f"projector file {path!r} lacks metadata key clip.vision.{name}")
        return value

    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    needed = ["v.patch_embd.weight", "v.patch_embd.weight.1", "v.blk.0.ffn_up.weight", "mm.2.weight"]
    if family == "qwen3_vl":
        needed.append("v.position_embd.weight")
    for name in needed:
        if name not in shapes:
            raise ValueError(f"projector file {path!r} lacks tensor {name} (not a {family} projector as "
                             "convert_hf_to_gguf.py --mmproj writes it)")
    hidden, depth, heads = int(key("embedding_length")), int(key("block_count")), int(key("attention.head_count"))
    patch, merge = int(key("patch_size")), int(key("spatial_merge_size", 2))
    out = int(key("projection_dim"))
    if shapes["mm.2.weight"][0] != out:
        raise ValueError(f"projector file {path!r}: mm.2 gives {shapes['mm.2.weight'][0]} columns, its "
                         f"projection_dim says {out}")
    intermediate = shapes["v.blk.0.ffn_up.weight"][0]  # (Qwen2-VL's feed_forward_length is not the MLP's width)
    common = dict(depth=depth, num_heads=heads, patch_size=patch, temporal_patch_size=2, spatial_merge_size=merge,
                  in_channels=shapes["v.patch_embd.weight"][1], rope_parameters={"rope_type": "axial",
                                                                                 "rope_theta": 10000.0})
    if family == "qwen2_vl":
        if intermediate % hidden:
            raise ValueError(f"projector file {path!r}: MLP width {intermediate} is no multiple of the width {hidden}")
        vision = dict(common, model_type="qwen2_vl", embed_dim=hidden, hidden_size=out,
                      mlp_ratio=intermediate // hidden, hidden_act="quick_gelu")
    elif family == "qwen2_5_vl":
        pattern = int(key("n_wa_pattern"))
        if pattern < 1:
            raise ValueError(f"projector file {path!r}: clip.vision.n_wa_pattern {pattern} must be >= 1")
        vision = dict(common, model_type="qwen2_5_vl", hidden_size=hidden, intermediate_size=intermediate,
                      out_hidden_size=out, hidden_act="silu", window_size=int(key("window_size", _DEFAULT_WINDOW)),
                      fullatt_block_indexes=[i for i in range(depth) if (i + 1) % pattern == 0])
    else:
        vision = dict(common, hidden_size=hidden, intermediate_size=intermediate, out_hidden_size=out,
                      hidden_act="gelu_pytorch_tanh", num_position_embeddings=shapes["v.position_embd.weight"][0],
                      deepstack_visual_indexes=_deepstack_blocks(path, meta, shapes, depth))
    square = (patch * merge) ** 2
    least, most = _SQUARES[family]
    mean, std = [float(x) for x in key("image_mean")], [float(x) for x in key("image_std")]
    if len(mean) != 3 or len(std) != 3 or not all(x > 0 for x in std):
        raise ValueError(f"projector file {path!r}: clip.vision.image_mean {mean} / image_std {std} must give one "
                         "value per RGB channel, each std above 0")
    preprocessor = dict(patch_size=patch, temporal_patch_size=2, merge_size=merge, image_mean=mean, image_std=std,
                        size={"shortest_edge": int(key("image_min_pixels", least * square)),
                              "longest_edge": int(key("image_max_pixels", most * square))})
    return Mmproj(path, family, vision, preprocessor)


def _deepstack_blocks(path: str, meta: dict, shapes: dict, depth: int) -> list[int]:
    """The blocks whose outputs feed Qwen3-VL's deepstack mergers, in block order (level k: the k-th): flagged in
    clip.vision.is_deepstack_layers, each with its v.deepstack.B.* tensors; [] for a Qwen3.5 tower."""
    flags = [bool(f) for f in meta.get("clip.vision.is_deepstack_layers") or ()]
    flagged = [i for i, f in enumerate(flags) if f]
    held = sorted({int(m.group(1)) for name in shapes if (m := _DEEPSTACK_RE.fullmatch(name))})
    if flagged != held or any(b >= depth for b in held):
        raise ValueError(f"projector file {path!r}: clip.vision.is_deepstack_layers flags blocks {flagged}, its "
                         f"v.deepstack.* tensors follow blocks {held} (of {depth})")
    return held


def mmproj_weights(mm: Mmproj) -> Iterator[tuple[str, torch.Tensor]]:
    """The projector's tensors as float32 HF vision-tower tensors, named below "visual." (what
    vision_tower.load_tower_weights takes): the two patch-embedding halves joined into the Conv3d kernel, q / k / v
    joined into qkv (Qwen2.x), the deepstack mergers numbered by level."""
    from gguf.quants import dequantize

    reader = _open(mm.path)
    arrays: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        arrays[t.name] = torch.from_numpy(array.copy()).reshape(shape)
    mlp = _MLP_NAMES[mm.family]
    globals_ = _GLOBAL_NAMES["qwen3_vl" if mm.family == "qwen3_vl" else "qwen2"]
    level = {b: k for k, b in enumerate(mm.vision_config.get("deepstack_visual_indexes") or ())}
    first, second = arrays.pop("v.patch_embd.weight"), arrays.pop("v.patch_embd.weight.1")
    yield "patch_embed.proj.weight", torch.stack((first, second), dim=2)  # [out, C, T=2, P, P]
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for name, tensor in arrays.items():
        base, _, suffix = name.rpartition(".")
        if base in globals_:
            yield f"{globals_[base]}.{suffix}", tensor
            continue
        m = _DEEPSTACK_RE.fullmatch(name)
        if m is not None and int(m.group(1)) in level and m.group(2) in _DEEPSTACK_NAMES:
            yield f"deepstack_merger_list.{level[int(m.group(1))]}.{_DEEPSTACK_NAMES[m.group(2)]}.{suffix}", tensor
            continue
        m = _BLOCK_RE.fullmatch(name)
        if m is None:
            unknown.append(name)
            continue
        block, part, suffix = int(m.group(1)), m.group(2), m.group(3)
        if part in _QKV:
            qkv.setdefault((block, suffix), {})[part] = tensor
        elif part in _BLOCK_NAMES or part in mlp:
            yield f"blocks.{block}.{_BLOCK_NAMES.get(part) or mlp[part]}.{suffix}", tensor
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"projector file {mm.path!r} holds tensors with no place in a {mm.family} vision tower: "
                         f"{sorted(unknown)}")
    for (block, suffix), parts in sorted(qkv.items()):
        missing = [p for p in _QKV if p not in parts]
        if missing:
            raise ValueError(f"projector file {mm.path!r} lacks v.blk.{block}.{missing[0]}.{suffix}")
        yield f"blocks.{block}.attn.qkv.{suffix}", torch.cat([parts[p] for p in _QKV])


def vision_token_ids(lm_path: str) -> dict:
    """image / video / vision start / vision end token ids, found by their text in the GGUF model's vocabulary."""
    from voltllm.model.loader.gguf_loader import gguf_field

    tokens = gguf_field(lm_path, "tokenizer.ggml.tokens") or []
    index = {tok: i for i, tok in enumerate(tokens) if tok.startswith("<|")}
    missing = [tok for tok in _VISION_TOKENS.values() if tok not in index]
    if missing:
        raise ValueError(f"GGUF model {lm_path!r}: its vocabulary lacks {', '.join(missing)} (Qwen's vision tokens)")
    return {name: index[tok] for name, tok in _VISION_TOKENS.items()}


def multimodal_config(lm_path: str, text_config: Any, mm: Mmproj) -> Any:
    """The multimodal transformers config (Qwen2_5_VLConfig / Qwen2VLConfig / Qwen3VLConfig / Qwen3VLMoeConfig /
    Qwen3_5Config / Qwen3_5MoeConfig) of the GGUF language model at `lm_path` (its config `text_config`, from
    gguf_loader.gguf_config) and the projector `mm`. ValueError when the two do not belong together."""
    from voltllm.model.loader.gguf_loader import gguf_field

    arch = gguf_field(lm_path, "general.architecture")
    if arch not in _LM_MODELS:
        raise ValueError(f"projector file {mm.path!r} was given with a GGUF model of architecture {arch!r}; a "
                         f"projector belongs to a {' / '.join(MMPROJ_LM_ARCHS)} model (Qwen2-VL / Qwen2.5-VL / "
                         "Qwen3-VL / Qwen3.5)")
    takes, config_name, hf_arch = _LM_MODELS[arch]
    if not mm.family.startswith(takes):
        raise ValueError(f"projector file {mm.path!r} holds a {mm.family} vision tower, which does not go with a "
                         f"GGUF model of architecture {arch!r}: the two files are of different models")
    out = mm.vision_config.get("out_hidden_size", mm.vision_config["hidden_size"])
    if out != text_config.hidden_size:
        raise ValueError(f"projector file {mm.path!r} projects to width {out}, but the GGUF model {lm_path!r} has "
                         f"hidden size {text_config.hidden_size}: the two files are of different models")
    deepstack = len(mm.vision_config.get("deepstack_visual_indexes") or ())
    wanted = int(gguf_field(lm_path, f"{arch}.n_deepstack_layers") or 0)
    if deepstack != wanted:
        raise ValueError(f"projector file {mm.path!r} has {deepstack} deepstack levels, but the GGUF model {lm_path!r} "
                         f"takes {wanted} ({arch}.n_deepstack_layers): the two files are of different models")
    sections = [int(s) for s in gguf_field(lm_path, f"{arch}.rope.dimension_sections") or ()]
    sections = sections[:3]
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    rotary = int(head_dim * (text_config.rope_parameters or {}).get("partial_rotary_factor", 1.0))
    # (interleaved sections need not add up: transformers and llama.cpp deal frequencies t, h, w, t, ... in turn)
    contiguous = arch == "qwen2vl"
    if len(sections) != 3 or min(sections) < 0 or contiguous and sum(sections) != rotary // 2:
        need = f" adding up to half the rotary width ({rotary // 2})" if contiguous else ""
        raise ValueError(f"GGUF model {lm_path!r}: {arch}.rope.dimension_sections {sections} must give three M-RoPE "
                         f"sections (t, h, w){need}")
    text = text_config.to_dict()
    for k in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype"):
        text.pop(k, None)
    rope = {**text.get("rope_parameters", {}), "mrope_section": sections}
    if arch != "qwen2vl":  # Qwen3-VL / Qwen3.5 interleave the t / h / w frequencies (llama.cpp's IMROPE)
        rope["mrope_interleaved"] = True
    text["rope_parameters"] = rope
    import transformers

    vision = {k: v for k, v in mm.vision_config.items() if k != "model_type"}
    if config_name is None:  # qwen2vl: Qwen2-VL or Qwen2.5-VL as the projector says
        qwen25 = mm.family == "qwen2_5_vl"
        config_name = "Qwen2_5_VLConfig" if qwen25 else "Qwen2VLConfig"
        hf_arch = "Qwen2_5_VLForConditionalGeneration" if qwen25 else "Qwen2VLForConditionalGeneration"
    cfg = getattr(transformers, config_name)(text_config=text, vision_config=vision,
                                             tie_word_embeddings=text_config.tie_word_embeddings,
                                             **vision_token_ids(lm_path))
    cfg.architectures = [hf_arch]
    return cfg
