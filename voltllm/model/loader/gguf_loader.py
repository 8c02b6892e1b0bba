"""GGUF files (llama.cpp's format) as a transformers config plus HF-named tensors.

Supported architectures: llama, qwen2, qwen3 (dense), qwen3moe (Qwen3-30B-A3B style: llama.cpp stacks each layer's
experts into one [E, rows, cols] tensor per projection, read back here as HF's per-expert weights), and the hybrids
qwen35, qwen35moe and qwen3next (Gated DeltaNet + gated attention: gguf_hybrid.py undoes what llama.cpp's converter
changes in them), qwen2vl (Qwen2-VL's / Qwen2.5-VL's language model, a qwen2) and qwen3vl / qwen3vlmoe (Qwen3-VL's,
a qwen3 / qwen3moe); with its llama.cpp projector file each of the vision-language ones, Qwen3.5's included, is a
vision-language model: gguf_mmproj.py). Tensors are dequantized with the `gguf` package's numpy
code (the same code transformers uses), so the weights equal what
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` loads; the model loader casts them to the compute
dtype. On a GPU the linear layers' weights of the common types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
and the low-bit Q3_K, Q2_K, IQ4_XS, IQ4_NL of Q3_K_M / Q2_K / IQ4_XS files) instead come as raw blocks and stay
quantized there (model/layers/quantized_linear.py, re-laid by model/layers/gguf_planes.py); their dequantized values
are the same. Other types (IQ2 / IQ3 / IQ1, TQ*, BF16, ...) are dequantized here.

A model split by llama.cpp's gguf-split (NAME-00001-of-0000N.gguf, ...) is read as one file: the first part's
metadata and every part's tensors (split_files).

Two things differ from a Hugging Face checkpoint:
- ggml lists dims innermost first: a GGUF tensor of shape [in, out] is the torch (out, in) weight.
- llama.cpp's converter permutes llama-arch q/k projection rows so that RoPE rotates adjacent pairs
  (x0, x1), (x2, x3), ... instead of HF's halves (x_i, x_{i+d/2}). We undo that here. qwen2/qwen3
  files use the half-rotation already and are not permuted.
(The hybrids' further differences: gguf_hybrid.py.)
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any, Iterator, Optional

import numpy as np
import torch

from voltllm.model.loader import gguf_hybrid
from voltllm.model.loader.gguf_hybrid import HYBRID_ARCHS

# qwen2vl: Qwen2-VL's / Qwen2.5-VL's language model, a qwen2; qwen3vl / qwen3vlmoe: Qwen3-VL's, a qwen3 / qwen3moe
# (their M-RoPE sections and Qwen3-VL's deepstack matter with images only: a projector file beside it makes it
# multimodal, gguf_mmproj.py)
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2vl", "qwen3vl", "qwen3vlmoe", *HYBRID_ARCHS)
# a vision-language model's text architecture -> the text-only one it is read as
_TEXT_ARCH = {"qwen2vl": "qwen2", "qwen3vl": "qwen3", "qwen3vlmoe": "qwen3moe"}
_QWEN2_LIKE = ("qwen2", "qwen2vl")  # always q/k/v biases

# GGUF tensor name -> HF parameter name (both without the .weight/.bias suffix).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
}
# llama.cpp's stacked expert tensors [E, rows, cols] -> each expert's HF projection(s); ffn_gate_up_exps (the
# converter's --fuse-gate-up-exps) holds gate's rows then up's
_EXPERT_NAMES = {"ffn_gate_exps": ("gate_proj",), "ffn_up_exps": ("up_proj",), "ffn_down_exps": ("down_proj",),
                 "ffn_gate_up_exps": ("gate_proj", "up_proj")}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")  # (ssm_a has no suffix)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")


# llama.cpp's gguf-split names: NAME-00001-of-00003.gguf, ... (the first file holds the metadata, each holds a share
# of the tensors; big models on the Hub come this way, often in a folder per quantization)
_SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def split_files(path: str) -> list[str]:
    """Every file of the split GGUF that `path` is one of, in order (the first holds the metadata); [path] for a
    single-file GGUF. A missing part is a ValueError naming it."""
    m = _SPLIT_NAME.fullmatch(os.path.basename(path))
    if m is None:
        return [path]
    folder, count = os.path.dirname(path), int(m.group("count"))
    if count < 1 or not 1 <= int(m.group("no")) <= count:
        raise ValueError(f"GGUF file {path!r}: its name says part {int(m.group('no'))} of {count}")
    parts = [os.path.join(folder, f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"split GGUF {parts[0]!r} lacks {len(missing)} of its {count} files: {', '.join(missing)}")
    return parts


def first_split_file(path: str) -> str:
    """The file of a split GGUF that holds its metadata (the tokenizer's too); `path` itself for a single file."""
    return split_files(path)[0]


class _SplitReader:
    """The parts of a split GGUF read as one file: the first part's metadata, every part's tensors in order."""

    def __init__(self, readers: list[Any], paths: list[str]):
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]
        field = self.fields.get("split.count")
        if field is not None and int(field.contents()) != len(paths):
            raise ValueError(f"split GGUF {paths[0]!r} says it has {field.contents()} files; found {len(paths)}")
        field = self.fields.get("split.tensors.count")
        if field is not None and int(field.contents()) != len(self.tensors):
            raise ValueError(f"split GGUF {paths[0]!r} says it holds {field.contents()} tensors; its {len(paths)} "
                             f"files hold {len(self.tensors)} (a part from another conversion?)")


def _reader(path: str):
    # Parsing the header costs seconds (the tokenizer arrays are read element by element), so the usual
    # gguf_config() then gguf_weights() on one file shares one reader; gguf_weights drops it when done.
    stamps = []
    for part in split_files(path):
        st = os.stat(part)
        stamps.append((os.path.abspath(part), st.st_size, st.st_mtime_ns))
    return _cached_reader(tuple(stamps))


@functools.lru_cache(maxsize=1)
def _cached_reader(stamps: tuple[tuple[str, int, int], ...]):
    from voltllm.model.loader.gguf_reader import open_gguf

    readers = [open_gguf(path) for path, _, _ in stamps]
    return readers[0] if len(readers) == 1 else _SplitReader(readers, [path for path, _, _ in stamps])


def _arch(reader) -> str:
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch == "clip":
        raise ValueError("this GGUF file is a vision projector (llama.cpp's mmproj), not a language model: give the "
                         "language model's GGUF file as the model (the mmproj*.gguf beside it is found, or name it "
                         "with --mmproj)")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    return arch


def gguf_architecture(path: str) -> Optional[str]:
    """The file's general.architecture (whether voltllm reads it or not)."""
    field = _reader(path).fields.get("general.architecture")
    return field.contents() if field is not None else None


def gguf_field(path: str, name: str) -> Any:
    """One metadata field's value (an array as a list), or None when the file lacks it."""
    field = _reader(path).fields.get(name)
    return field.contents() if field is not None else None


def _f32(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.999999747e-06. Keep the shortest decimal
    # that rounds to the same float32 (1e-05, what the original config.json said); same value in f32.
    return float(str(np.float32(value)))


def gguf_config(path: str) -> Any:
    """The transformers config (LlamaConfig / Qwen2Config / Qwen3Config / Qwen3MoeConfig, or a hybrid's:
    gguf_hybrid.hybrid_config) described by a GGUF file's metadata."""
    reader = _reader(path)
    arch = _arch(reader)
    from gguf import GGUFValueType

    meta = {k: f.contents() for k, f in reader.fields.items() if f.types and f.types[0] != GGUFValueType.ARRAY}
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = KeyError) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise ValueError(f"GGUF file {path!r} lacks metadata key {arch}.{name}")
        return value

    if "rope_freqs.weight" in tensors:
        raise ValueError(f"GGUF file {path!r} uses per-dimension RoPE frequency factors (rope_freqs, "
                         "Llama-3.1-style scaling), which this loader does not support")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", None)
    if head_dim is None:
        head_dim = key("rope.dimension_count", None) if arch == "llama" else None
    rope = {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=_f32(key("rope.scaling.factor")))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    elif scaling != "none":
        raise ValueError(f"GGUF file {path!r}: RoPE scaling type {scaling!r} is not supported")

    kwargs = dict(
        # the embedding matrix is [hidden, vocab] in ggml order
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length", None),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim or hidden // heads,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        max_position_embeddings=key("context_length"),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    if gguf_hybrid.is_hybrid(arch):
        return gguf_hybrid.hybrid_config(arch, key, meta, reader.fields, kwargs)
    text_arch = _TEXT_ARCH.get(arch, arch)
    if kwargs["intermediate_size"] is None and text_arch != "qwen3moe":
        key("feed_forward_length")  # (raises: required)
    kwargs.update(architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                  "qwen3moe": "Qwen3MoeForCausalLM"}[text_arch]],
                  num_hidden_layers=key("block_count"))
    if arch not in _QWEN2_LIKE:  # Qwen2 always has q/k/v biases and no switch for them
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if text_arch == "qwen3moe":  # every layer sparse; llama.cpp renormalizes the top-k weights for this architecture
        moe_inter = key("expert_feed_forward_length")
        kwargs.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                      moe_intermediate_size=moe_inter, intermediate_size=kwargs["intermediate_size"] or moe_inter,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
            "qwen3moe": Qwen3MoeConfig}[text_arch](**kwargs)


def dense_bytes(path: str, itemsize: int) -> int:
    """Bytes of every tensor in the file once dequantized to elements of `itemsize` bytes."""
    return sum(int(np.prod(t.shape)) for t in _reader(path).tensors) * itemsize


def _hf_name(gguf_name: str, arch: str) -> Optional[str]:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = _LAYER_RE.fullmatch(gguf_name)
    if not m:
        return None
    if gguf_hybrid.is_hybrid(arch):
        inner = gguf_hybrid.layer_hf_name(m.group(2), m.group(3))
        return None if inner is None else f"model.layers.{m.group(1)}.{inner}"
    if m.group(2) in _LAYER_NAMES and m.group(3) is not None:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute_rope(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's q/k row permutation: per head, rows (0, d/2, 1, d/2+1, ...) back to (0..d-1).

    llama.cpp's converter viewed each head's rows as (2, d/2) and transposed to (d/2, 2); transposing back
    restores HF's layout. Works for weights (out, in), biases (out,) and quantized weights (rows of blocks).
    """
    from voltllm.model.layers.quantized_linear import GGUFBlocks

    if isinstance(w, GGUFBlocks):
        order = _unpermute_rope(torch.arange(w.out_features), n_heads)
        return w.take_rows(order)
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _is_matrix_kept(hf_name: str) -> bool:
    """Linear weights (the Gated DeltaNet input projections included) and the token embeddings
    (quantized_linear.QuantEmbedding) may stay quantized."""
    return (hf_name.endswith("_proj.weight") or ".linear_attn.in_proj_" in hf_name
            or hf_name in ("lm_head.weight", "model.embed_tokens.weight"))


# GGUF types that hold no quantized codes (a matrix of one is dense anyway)
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _kept(type_name: str, cols: int) -> bool:
    """Whether a matrix of this GGUF type and input width stays quantized (gguf_planes.supports); a quantized type
    that does not is dequantized here, said once per type and reason in the log (its memory is then fp16's)."""
    from voltllm.model.layers.gguf_planes import GROUP, KINDS, supports
    from voltllm.model.layers.quantized_linear import log_dense_at_load

    if supports(type_name, cols):
        return True
    if type_name in KINDS:
        log_dense_at_load(f"GGUF {type_name} matrices whose inputs are not a multiple of "
                          f"{max(GROUP, KINDS[type_name].block)}")
    elif type_name not in _FLOAT_TYPES:
        log_dense_at_load(f"GGUF {type_name} matrices (a type without a plane layout)")
    return False


def _expert_tensors(t: Any, layer: int, projs: tuple[str, ...], keep_quantized: bool,
                    held: Any = None) -> Iterator[tuple[str, Any]]:
    """One stacked expert tensor [E, rows, cols] as each expert's HF weight(s) (`projs`: one, or gate and up, whose
    rows the tensor holds one after the other): raw blocks (kept quantized) or float32. held: this rank's experts
    under expert parallelism (distributed.experts.ExpertShard; None: all), the only ones copied out of the file."""
    from gguf.quants import dequantize

    from voltllm.model.layers.quantized_linear import GGUFBlocks

    experts, rows, cols = (int(d) for d in reversed(t.shape.tolist()))
    first, count = (0, experts) if held is None else (held.start, held.count)
    prefix = f"model.layers.{layer}.mlp.experts"
    n = rows // len(projs)
    if keep_quantized and _kept(t.tensor_type.name, cols):
        stored = np.asarray(t.data, dtype=np.uint8).reshape(experts, rows, -1)  # (a view of the memory map)
        raw = torch.from_numpy(np.array(stored[first:first + count]))
        for e in range(count):
            for i, proj in enumerate(projs):
                yield (f"{prefix}.{first + e}.{proj}.weight",
                       GGUFBlocks(t.tensor_type.name, raw[e, i * n:(i + 1) * n], n, cols))
        return
    stored = np.asarray(t.data).reshape((experts, rows) + tuple(t.data.shape[-1:]))
    array = np.asarray(dequantize(stored[first:first + count], t.tensor_type), dtype=np.float32)
    array = array.reshape(count, rows, cols)
    for e in range(count):
        for i, proj in enumerate(projs):
            yield f"{prefix}.{first + e}.{proj}.weight", torch.from_numpy(array[e, i * n:(i + 1) * n].copy())


def gguf_weights(path: str, hf_config: Any = None, keep_quantized: bool = False,
                 experts: Any = None, layers: Any = None, progress: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF parameter name, tensor) for every tensor in the file, in file order: float32 CPU tensors, except with
    `keep_quantized`, where a linear layer's weight (or the embeddings) of a type with a device layout
    (model/layers/gguf_planes.py) comes as its raw blocks (GGUFBlocks) for the layer to keep quantized. A hybrid's
    MTP blocks are skipped. experts: this rank's routed experts under expert parallelism (the others' are skipped).
    layers: which decoder layers to read, by index (a pipeline stage's; None: all): the others are never dequantized.
    progress: a bar over the file's tensors (--use-tqdm-on-load)."""
    from gguf.quants import dequantize

    from voltllm.model.layers.quantized_linear import GGUFBlocks

    reader = _reader(path)
    arch = _arch(reader)
    if hf_config is None:
        hf_config = gguf_config(path)
    text = getattr(hf_config, "text_config", None) or hf_config  # (a multimodal config: its text model's)
    hybrid = gguf_hybrid.HybridTensors(arch, text) if gguf_hybrid.is_hybrid(arch) else None
    n_layers = text.num_hidden_layers
    from voltllm.model.loader.load_progress import load_progress

    for t in load_progress(reader.tensors, progress, "Loading GGUF tensors", "tensor"):
        block = _BLOCK_RE.match(t.name)
        if block and hybrid is not None and int(block.group(1)) >= n_layers:  # Qwen3.5's MTP (nextn) blocks
            continue
        if block and layers is not None and not layers(int(block.group(1))):
            continue
        m = _LAYER_RE.fullmatch(t.name)
        if m and m.group(2) in _EXPERT_NAMES:
            yield from _expert_tensors(t, int(m.group(1)), _EXPERT_NAMES[m.group(2)], keep_quantized, experts)
            continue
        name = _hf_name(t.name, arch)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} in {path!r} has no place in a {arch} model")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if keep_quantized and _is_matrix_kept(name) and len(shape) == 2 and _kept(t.tensor_type.name, shape[1]):
            tensor = GGUFBlocks(t.tensor_type.name, torch.from_numpy(np.array(t.data, dtype=np.uint8)), *shape)
        else:
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if not array.flags.writeable:  # F32 tensors come back as read-only views of the memory map
                array = array.copy()
            tensor = torch.from_numpy(array).reshape(shape)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _unpermute_rope(tensor, hf_config.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _unpermute_rope(tensor, hf_config.num_key_value_heads)
        if hybrid is not None:
            yield from hybrid.convert(name, tensor)
        else:
            yield name, tensor
    if hybrid is not None:
        hybrid.finish()
    _cached_reader.cache_clear()
