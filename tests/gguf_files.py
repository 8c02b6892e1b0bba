"""Writing tiny GGUF files in tests the way llama.cpp's converter lays out their metadata.

writer_with_header: the header of the llama / qwen2 / qwen3 / qwen3moe files the loader tests write tensor by tensor.
write_hybrid_gguf: a whole tiny hybrid checkpoint (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) converted as convert_hf_to_gguf.py
converts it; q8_exact_weights makes a checkpoint's matrices exact in F16 and Q8_0, so such a file holds the checkpoint's
weights bit for bit."""
import json
import os
from typing import Any


def writer_with_header(path: str, arch: str, cfg: Any, split_max_tensors: int = 0) -> Any:
    """A gguf.GGUFWriter for `arch` with the model metadata of the transformers config `cfg` (the shapes, RoPE,
    norm epsilon, special tokens; the expert counts of qwen3moe). split_max_tensors: write a split model as
    llama.cpp's gguf-split does (NAME-00001-of-0000N.gguf, ...), this many tensors per file."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if arch in ("qwen3", "qwen3moe"):  # llama.cpp writes key_length when the config has an explicit head_dim
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim if arch != "qwen2" else cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_id is not None:
        w.add_eos_token_id(cfg.eos_token_id)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    return w


# --- hybrid checkpoints, converted as llama.cpp's convert_hf_to_gguf.py does -------------------------------------
# Learnt from the converter (conversion/qwen.py and conversion/base.py of ggml-org/llama.cpp): Qwen3NextModel,
# _LinearAttentionVReorderBase, _Qwen35MRopeMixin, _Qwen35MtpMixin, Qwen3_5TextModel / Qwen3_5MoeTextModel,
# Qwen2MoeModel (expert stacking) and TextModel (metadata, tensor types).
HYBRID_GGUF_ARCH = {"Qwen3_5ForCausalLM": "qwen35", "Qwen3_5MoeForCausalLM": "qwen35moe",
                    "Qwen3NextForCausalLM": "qwen3next"}
KIND_ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}  # tiny_models kind -> GGUF
_QWEN35_DEFAULT_MROPE_SECTION = [11, 11, 10, 0]  # written when the checkpoint's rope_parameters has none
# tokenizer.ggml.pre the converter finds (by hashing a tokenization) for the real models' tokenizers
QWEN_PRE = {"qwen35": "qwen35", "qwen35moe": "qwen35", "qwen3next": "qwen2"}


def use_qwen_pre_tokenizer(hf_dir: str, arch: str) -> None:
    """Make the tokenizer in `hf_dir` split text as the real `arch` models' tokenizers do (their pre-tokenizer regex,
    which readers of a GGUF file take from its tokenizer.ggml.pre), so the file's tokenizer is the directory's."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    if QWEN_PRE[arch] == "qwen35":
        from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
    else:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    file = os.path.join(hf_dir, "tokenizer.json")
    tok = Tokenizer.from_file(file)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.save(file)


def q8_exact_weights(hf_dir: str, group: int = 16) -> None:
    """Round every matrix of the checkpoint in `hf_dir` (in place) so that F16 and Q8_0 hold it exactly: per row a
    power-of-two scale d and integer codes |q| <= 127, each `group` columns holding a code of +-127 (so every 32-input
    Q8_0 block made of whole groups gets scale d again, also after the converter moves value heads of `group` columns
    around). Lets a test demand the GGUF file's exact weights from the checkpoint itself."""
    import torch
    from safetensors.torch import load_file, save_file

    file = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(file)
    for name, w in tensors.items():
        if w.ndim != 2 or w.shape[1] % group:
            continue
        w = w.float()
        d = torch.exp2(torch.ceil(torch.log2(w.abs().amax(dim=1, keepdim=True).clamp_min(1e-6) / 127)))
        q = torch.round(w / d).clamp(-127, 127).reshape(w.shape[0], -1, group)
        top = q.abs().argmax(dim=-1, keepdim=True)
        sign = torch.where(q.gather(-1, top) < 0, -1.0, 1.0)
        q.scatter_(-1, top, sign * 127)
        tensors[name] = (q.reshape(w.shape) * d).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def exact_hybrid_checkpoint(path: str, kind: str, **overrides: Any) -> Any:
    """A tiny random hybrid (tiny_models.make_tiny_hybrid, small MoE sizes, + overrides) with a byte-level BPE tokenizer
    that splits text as the real model's (use_qwen_pre_tokenizer), its matrices exact in F16 and Q8_0
    (q8_exact_weights); None when this transformers lacks the architecture."""
    from tiny_models import make_tiny_hybrid, make_tokenizer, small_moe

    tok = make_tokenizer(path)
    use_qwen_pre_tokenizer(path, KIND_ARCH[kind])
    cfg = dict(small_moe(kind), vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if make_tiny_hybrid(path, kind, 0, 1, **{**cfg, **overrides}) is None:
        return None
    q8_exact_weights(path)
    return path


def _hparams(hf_dir: str) -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_dir).to_dict()


def _reorder_v_heads(t: Any, dim: int, num_k: int, r: int, head_dim: int) -> Any:
    """Value heads from grouped by key head (g * r + j) to tiled (j * Hk + g) along `dim`."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], num_k, r, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _converted(h: dict, arch: str, name: str, t: Any) -> list:
    """One HF tensor as the converter's modify_tensors chain leaves it (HF names): the value-head tiling of
    _LinearAttentionVReorderBase (Qwen3.5), then Qwen3NextModel's changes."""
    import torch

    nk, nv = h["linear_num_key_heads"], h["linear_num_value_heads"]
    dk, dv = h["linear_key_head_dim"], h["linear_value_head_dim"]
    if arch != "qwen3next" and nk != nv and "linear_attn." in name:
        r, qk = nv // nk, 2 * nk * dk
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, nk, r, dv)])
        elif ".in_proj_z." in name:
            t = _reorder_v_heads(t, 0, nk, r, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            t = _reorder_v_heads(t, 0, nk, r, 1)
        elif ".A_log" in name or ".dt_bias" in name:
            t = _reorder_v_heads(t.unsqueeze(-1), 0, nk, r, 1).squeeze(-1)
        elif ".conv1d" in name:
            t = t.squeeze()
            t = torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, nk, r, dv)])
        elif ".out_proj." in name:
            t = _reorder_v_heads(t, 1, nk, r, dv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if "in_proj_qkvz.weight" in name:  # [q k v z] per key head -> [q all heads | k | v] and z
        hidden = h["hidden_size"]
        parts = [dk, dk, nv // nk * dv, nv // nk * dv]
        q, k, v, z = torch.split(t.permute(1, 0).reshape(hidden, nk, sum(parts)), parts, dim=-1)
        qkv = torch.cat([q.reshape(hidden, -1), k.reshape(hidden, -1), v.reshape(hidden, -1)], dim=-1)
        layer = name.rpartition(".in_proj_qkvz")[0]
        return [(f"{layer}.in_proj_qkv.weight", qkv.permute(1, 0).contiguous()),
                (f"{layer}.in_proj_z.weight", z.reshape(hidden, -1).permute(1, 0).contiguous())]
    return [(name, t)]


def _tensor_type(gguf_name: str, n_dims: int, outtype: str) -> str:
    """TextModel.prepare_tensors' choice: 1-D tensors, norms, the routers and the conv kernel stay F32."""
    always_f32 = (".ffn_gate_inp.", ".ffn_gate_inp_shexp.", ".ssm_conv1d.")
    if n_dims <= 1 or gguf_name.endswith("_norm.weight") or any(s in gguf_name for s in always_f32) \
            or not gguf_name.endswith(".weight"):
        return "F32"
    return outtype


def _add_tensor(w: Any, gguf_name: str, t: Any, outtype: str) -> str:
    import gguf
    import numpy as np

    data = t.float().numpy()
    kind = _tensor_type(gguf_name, data.ndim, outtype)
    if kind == "F32":
        w.add_tensor(gguf_name, data.astype(np.float32))
    elif kind == "F16":
        w.add_tensor(gguf_name, data.astype(np.float16))
    else:
        qtype = gguf.GGMLQuantizationType[kind]
        try:
            q = gguf.quants.quantize(data, qtype)
        except gguf.QuantError:  # a row that is no whole number of blocks: the converter falls back to F16
            w.add_tensor(gguf_name, data.astype(np.float16))
            return "F16"
        w.add_tensor(gguf_name, q, raw_dtype=qtype)
    return kind


def _add_tokenizer(w: Any, hf_dir: str, vocab_size: int, arch: str) -> None:
    """TextModel._set_vocab_gpt2: the byte-level BPE vocabulary, its merges and special tokens, and the real models'
    pre-tokenizer name (see use_qwen_pre_tokenizer)."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            # (the converter: an added token is CONTROL when special or shaped like one, <|...|>, else USER_DEFINED)
            looks_special = by_id[i].startswith("<|") and by_id[i].endswith("|>")
            types.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if added[i].special or looks_special else gguf.TokenType.USER_DEFINED)
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        merges = json.load(f)["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(QWEN_PRE[arch])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for what, token in (("bos", tok.bos_token), ("eos", tok.eos_token), ("pad", tok.pad_token)):
        if token is not None:
            getattr(w, f"add_{what}_token_id")(tok.convert_tokens_to_ids(token))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def _add_metadata(w: Any, h: dict, arch: str, n_blocks: int, mtp_layers: int, file_type: int) -> None:
    """TextModel.set_gguf_parameters, then Qwen2MoeModel's, Qwen3NextModel's and the Qwen3.5 mixins' additions."""
    rope = h.get("rope_parameters") or {}
    w.add_block_count(n_blocks)
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    if h.get("intermediate_size") is not None:
        w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h["num_key_value_heads"])
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    if h.get("num_experts") is not None:
        w.add_expert_count(h["num_experts"])
        w.add_expert_used_count(h["num_experts_per_tok"])
    w.add_key_length(h["head_dim"])
    w.add_value_length(h["head_dim"])
    w.add_file_type(file_type)
    if h.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
    if h.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(h["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(h["linear_conv_kernel_dim"])
    w.add_ssm_state_size(h["linear_key_head_dim"])
    w.add_ssm_group_count(h["linear_num_key_heads"])
    w.add_ssm_time_step_rank(h["linear_num_value_heads"])
    w.add_ssm_inner_size(h["linear_value_head_dim"] * h["linear_num_value_heads"])
    w.add_full_attention_interval(h.get("full_attention_interval", 4))
    # (the converter reads a top-level partial_rotary_factor only; 0.25 is every Qwen hybrid's)
    w.add_rope_dimension_count(int(h["head_dim"] * h.get("partial_rotary_factor", 0.25)))
    if arch != "qwen3next":
        if "mrope_section" not in rope:
            w.add_rope_dimension_sections(_QWEN35_DEFAULT_MROPE_SECTION)
        if mtp_layers:
            w.add_nextn_predict_layers(mtp_layers)


def _mtp_tensors(h: dict, state: dict, n_layers: int) -> list:
    """A stand-in MTP module as Qwen3.5 checkpoints hold one (mtp.*: a full-attention decoder layer, the fc joining
    embedding and hidden state, three norms), renamed as _Qwen35MtpMixin renames it (HF names of block n_layers)."""
    import torch

    gen = torch.Generator().manual_seed(7)
    last_attn = max(int(k.split(".")[2]) for k in state if ".self_attn." in k)
    layer = {k.split(f"model.layers.{last_attn}.", 1)[1]: v for k, v in state.items()
             if k.startswith(f"model.layers.{last_attn}.")}
    out = [(f"model.layers.{n_layers}.{k}", torch.randn(v.shape, generator=gen) * 0.05) for k, v in layer.items()]
    hid = h["hidden_size"]
    for name, shape in (("eh_proj", (hid, 2 * hid)), ("enorm", (hid,)), ("hnorm", (hid,)),
                        ("shared_head.norm", (hid,))):
        out.append((f"model.layers.{n_layers}.{name}.weight", torch.randn(shape, generator=gen) * 0.05))
    return out


_NEXTN = {"eh_proj": "nextn.eh_proj", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm",
          "shared_head.norm": "nextn.shared_head_norm"}


def write_hybrid_gguf(path: str, hf_dir: str, outtype: str = "F16", fuse_gate_up: bool = False,
                      mtp_layers: int = 0) -> dict:
    """Convert the tiny HF hybrid checkpoint in `hf_dir` (config.json, model.safetensors, a byte-level BPE tokenizer:
    see use_qwen_pre_tokenizer) into a GGUF
    file at `path` as llama.cpp's convert_hf_to_gguf.py does (--outtype f32 / f16 / q8_0: outtype F32 / F16 / Q8_0;
    fuse_gate_up: --fuse-gate-up-exps). mtp_layers: also write a stand-in MTP module as nextn blocks (Qwen3.5 only).
    Returns {GGUF tensor name: GGUF type} of what it wrote."""
    import gguf
    import torch
    from safetensors.torch import load_file

    h = _hparams(hf_dir)
    arch = HYBRID_GGUF_ARCH[h["architectures"][0]]
    n_layers = h["num_hidden_layers"]
    n_blocks = n_layers + mtp_layers
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    items = [(n, t) for n, t in state.items() if not n.startswith("mtp.")]
    if mtp_layers:
        items += _mtp_tensors(h, state, n_layers)
    w = gguf.GGUFWriter(str(path), arch)
    _add_tokenizer(w, hf_dir, h["vocab_size"], arch)
    _add_metadata(w, h, arch, n_blocks, mtp_layers, file_type)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_blocks)
    experts: dict = {}
    written: dict = {}

    def add(hf_name: str, t: Any, bid: int) -> None:
        module = hf_name.rsplit(".", 1)[0].split(".", 3)[-1]
        if bid >= n_layers and module in _NEXTN:  # (gguf 0.19's name map has no qwen35 nextn tensors)
            gname = f"blk.{bid}.{_NEXTN[module]}.weight"
        else:
            gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        written[gname] = _add_tensor(w, gname, t, outtype)

    for name, t in items:
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        for hf_name, data in _converted(h, arch, name, t.float()):
            if ".mlp.experts." in hf_name:  # Qwen2MoeModel: a layer's experts stacked once all have come
                experts.setdefault(bid, {})[hf_name] = data
                if len(experts[bid]) < 3 * h["num_experts"]:
                    continue
                stacked = {p: torch.stack([experts[bid].pop(f"model.layers.{bid}.mlp.experts.{e}.{p}.weight")
                                           for e in range(h["num_experts"])]) for p in ("down_proj", "gate_proj",
                                                                                        "up_proj")}
                add(f"model.layers.{bid}.mlp.experts.down_proj.weight", stacked["down_proj"], bid)
                if fuse_gate_up:  # [E, 2I, H]: gate's rows, then up's
                    gname = f"blk.{bid}.ffn_gate_up_exps.weight"
                    written[gname] = _add_tensor(w, gname, torch.cat([stacked["gate_proj"], stacked["up_proj"]], 1),
                                                 outtype)
                else:
                    add(f"model.layers.{bid}.mlp.experts.gate_proj.weight", stacked["gate_proj"], bid)
                    add(f"model.layers.{bid}.mlp.experts.up_proj.weight", stacked["up_proj"], bid)
                continue
            add(hf_name, data, bid)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def split_copy(src: str, dst: str, max_tensors: int) -> list[str]:
    """Rewrite the GGUF `src` as llama.cpp's gguf-split would cut it (`dst` names the parts: dst-00001-of-0000N.gguf,
    ...), every metadata field and tensor as it was; the parts' paths, in order."""
    import glob
    import os

    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch, split_max_tensors=max_tensors)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # (the writer writes these itself)
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    stem = dst[: -len(".gguf")]
    return sorted(glob.glob(f"{glob.escape(stem)}-[0-9]*-of-[0-9]*.gguf")) or [os.path.abspath(dst)]


# --- llama.cpp's low-bit mixes (benchmarks/make_random_gguf.py: random blocks of each matrix's type) -------------
# case -> (transformers config class, shape, mix, the plane kinds a model kept quantized holds). Intermediate 320 is
# no whole 256-element blocks, so ffn_down takes llama.cpp's fallback types (IQ4_NL for IQ4_XS, Q5_1 / Q5_0 for Q5_K /
# Q4_K); the first case ties the LM head to its Q3_K embedding table; the last is a qwen3moe (Q2_K / Q3_K / Q4_K
# experts)
_LOW_BIT_COMMON = dict(vocab_size=1000, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
LOW_BIT_CASES = {
    "q3_k_m": ("Qwen3Config", dict(tie_word_embeddings=True), "Q3_K_M", {"Q3_K", "Q4_K", "Q5_K", "Q5_1", "Q5_0"}),
    "iq4_xs": ("Qwen3Config", dict(tie_word_embeddings=False), "IQ4_XS",
               {"IQ4_XS", "IQ4_NL", "Q5_K", "Q5_1", "Q6_K"}),
    "q2_k-moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=256), "Q2_K", {"Q2_K", "Q3_K", "Q4_K", "Q6_K"}),
}


_PARSED: dict = {}  # (path, size, mtime) -> a gguf.GGUFReader of a file that tests only read


def reuse_parsed_reader(mp: Any, path: str) -> None:
    """Under the monkeypatch `mp`, gguf.GGUFReader(path) (read-only) hands back one reader of `path` per process:
    parsing a header that holds a tokenizer (SmolLM2's 49152 tokens) takes seconds, and several tests copy the same
    tokenizer into the files they write (make_random_gguf.copy_tokenizer). Other files are read as usual."""
    import gguf
    from gguf.gguf_reader import GGUFReader

    target = os.path.abspath(path)

    def reader(p: Any, mode: str = "r") -> Any:
        if mode != "r" or os.path.abspath(p) != target:
            return GGUFReader(p, mode)
        st = os.stat(target)
        key = (target, st.st_size, st.st_mtime_ns)
        if key not in _PARSED:
            _PARSED[key] = GGUFReader(target, "r")
        return _PARSED[key]

    mp.setattr(gguf, "GGUFReader", reader)


def write_low_bit_gguf(path: str, case: str, tokenizer_from: str) -> set:
    """A tiny GGUF of LOW_BIT_CASES[case] (the tokenizer, and so the vocabulary, copied from the GGUF file
    `tokenizer_from`, parsed once per process: reuse_parsed_reader); returns the plane kinds it holds."""
    from pathlib import Path

    import pytest
    from interp_util import load_script
    from voltllm.bench import shapes

    cls, extra, mix, kinds = LOW_BIT_CASES[case]
    script = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "make_random_gguf.py")
    with pytest.MonkeyPatch.context() as mp:
        reuse_parsed_reader(mp, tokenizer_from)
        mp.setitem(shapes.SHAPES, "tiny-low-bit", (cls, {**_LOW_BIT_COMMON, **extra}))
        mp.setattr(script, "SHAPES", shapes.SHAPES)
        script.write("tiny-low-bit", mix, tokenizer_from, path)
    return kinds


# --- Qwen2-VL / Qwen2.5-VL as llama.cpp ships them: a qwen2vl language model and an mmproj file ----------------------
# Learnt from convert_hf_to_gguf.py's Qwen2VLModel (the text model, arch qwen2vl), Qwen2VLVisionModel and MmprojModel
# (the projector: general.architecture clip, clip.vision.* metadata; the Conv3d patch embedding split into its two
# temporal halves, each block's qkv into q / k / v).
QWEN_PRE["qwen2vl"] = "qwen2"


def fp16_exact_checkpoint(hf_dir: str) -> None:
    """Round every tensor of the checkpoint in `hf_dir` (in place) to a value F16 holds, so that F16 GGUF files of it
    hold its weights exactly."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(hf_dir, "model.safetensors")
    tensors = {k: v.half().float() for k, v in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})


def _vl_text_writer(lm_path: str, arch: str, hf_dir: str, text: dict, file_type: Any) -> Any:
    """A GGUFWriter for a vision-language checkpoint's language model, its tokenizer and common header written (the
    caller adds its architecture's keys, then the tensors)."""
    import gguf

    w = gguf.GGUFWriter(str(lm_path), arch)
    _add_tokenizer(w, hf_dir, text["vocab_size"], arch)
    w.add_block_count(text["num_hidden_layers"])
    w.add_context_length(text["max_position_embeddings"])
    w.add_embedding_length(text["hidden_size"])
    w.add_feed_forward_length(text["intermediate_size"])
    w.add_head_count(text["num_attention_heads"])
    w.add_head_count_kv(text["num_key_value_heads"])
    w.add_rope_dimension_sections((list(text["rope_parameters"]["mrope_section"]) + [0, 0, 0, 0])[:4])
    w.add_rope_freq_base(text["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(text["rms_norm_eps"])
    w.add_file_type(file_type)
    return w


def write_qwen2_vl_ggufs(hf_dir: str, lm_path: str, mmproj_path: str, outtype: str = "F16",
                         window_size: bool = True) -> None:
    """Convert the tiny Qwen2.5-VL / Qwen2-VL checkpoint in `hf_dir` into llama.cpp's two files: the language model at
    `lm_path` (qwen2vl) and its projector at `mmproj_path` (--mmproj), matrices in `outtype` (F32 / F16), norms and
    biases in F32. window_size: also write clip.vision.window_size (the converter does not: clip.cpp then assumes
    112 pixels, the released models' window; the tiny tower's is 16)."""
    import gguf
    from safetensors.torch import load_file

    h = _hparams(hf_dir)
    text, vision, family = h["text_config"], h["vision_config"], h["model_type"]
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16}[outtype]

    w = _vl_text_writer(lm_path, "qwen2vl", hf_dir, text, file_type)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, text["num_hidden_layers"])
    for name, t in state.items():
        if name.startswith("visual."):
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ValueError(f"no GGUF name for {name}")
        _add_tensor(w, gname, t, outtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with open(os.path.join(hf_dir, "preprocessor_config.json")) as f:
        pre = json.load(f)
    qwen2 = family == "qwen2_vl"
    m = gguf.GGUFWriter(str(mmproj_path), "clip")
    m.add_type(gguf.GGUFType.MMPROJ)
    m.add_file_type(file_type)
    m.add_clip_has_vision_encoder(True)
    m.add_vision_projection_dim(text["hidden_size"])
    m.add_vision_image_size(vision.get("image_size", 560))
    m.add_vision_patch_size(vision["patch_size"])
    m.add_vision_embedding_length(vision["embed_dim"] if qwen2 else vision["hidden_size"])
    # (Qwen2-VL: the converter writes its vision_config.hidden_size, the output width, as the feed-forward length)
    m.add_vision_feed_forward_length(vision["hidden_size"] if qwen2 else vision["intermediate_size"])
    m.add_vision_block_count(vision["depth"])
    m.add_vision_head_count(vision["num_heads"])
    m.add_vision_image_mean(pre["image_mean"])
    m.add_vision_image_std(pre["image_std"])
    if qwen2:
        m.add_clip_projector_type(gguf.VisionProjectorType.QWEN2VL)
    else:
        m.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        m.add_vision_use_silu(True)
        full = vision["fullatt_block_indexes"]
        m.add_vision_n_wa_pattern(full[0] + 1)
        if window_size:
            m.add_uint32(gguf.Keys.ClipVision.WINDOW_SIZE, vision["window_size"])
    m.add_vision_attention_layernorm_eps(text["rms_norm_eps"])
    # (mm.{bid} comes from the same block-indexed table: a tiny tower of depth 2 must still reach mm.2)
    vnames = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision["depth"], 3))
    for name, t in state.items():
        if not name.startswith("visual."):
            continue
        if name == "visual.patch_embed.proj.weight":  # Conv3d [out, C, 2, P, P] -> two Conv2d kernels
            _add_tensor(m, "v.patch_embd.weight", t[:, :, 0], outtype)
            _add_tensor(m, "v.patch_embd.weight.1", t[:, :, 1], outtype)
            continue
        parts = [(name, t)]
        if ".attn.qkv." in name:
            c = t.shape[0] // 3
            parts = [(name.replace("qkv", x), t[i * c:(i + 1) * c]) for i, x in enumerate("qkv")]
        for hf_name, data in parts:
            gname = vnames.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise ValueError(f"no GGUF name for {hf_name}")
            _add_tensor(m, gname, data, outtype)
    m.write_header_to_file()
    m.write_kv_data_to_file()
    m.write_tensors_to_file()
    m.close()


# --- Qwen3-VL / Qwen3.5 as llama.cpp ships them: a qwen3vl / qwen3vlmoe / qwen35 / qwen35moe language model and an
# mmproj file. Learnt from convert_hf_to_gguf.py's Qwen3VLTextModel / Qwen3VLMoeTextModel (a Qwen3 / Qwen3-MoE plus
# n_deepstack_layers; the MoE's released [E, in, out] experts split and transposed into ffn_*_exps), Qwen3_5TextModel
# (the hybrids above) and Qwen3VLVisionModel, which writes Qwen3-VL's and Qwen3.5's projectors alike (projector type
# qwen3vl_merger; the Conv3d split in two, its bias kept; qkv kept whole; deepstack mergers named by the block they
# follow, flagged in clip.vision.is_deepstack_layers).
QWEN_PRE.update(qwen3vl="qwen2", qwen3vlmoe="qwen2")
QWEN3_VL_GGUF_ARCH = {"qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe", "qwen3_5": "qwen35",
                      "qwen3_5_moe": "qwen35moe"}
_DEEPSTACK_PARTS = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
_MERGER_PARTS = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}


def write_qwen3_vl_ggufs(hf_dir: str, lm_path: str, mmproj_path: str, outtype: str = "F16",
                         deepstack_order: Any = None) -> None:
    """Convert the tiny Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 / Qwen3.5-MoE checkpoint in `hf_dir` (make_tiny_qwen3_vl /
    make_tiny_qwen3_5_vl) into llama.cpp's two files: the language model at `lm_path` and its projector at
    `mmproj_path`. deepstack_order: a permutation of the deepstack levels to write them in (a broken converter, for
    the test that the comparison sees the level order)."""
    h = _hparams(hf_dir)
    kind = h["model_type"]
    arch = QWEN3_VL_GGUF_ARCH[kind]
    if arch in ("qwen35", "qwen35moe"):
        write_hybrid_gguf(lm_path, _text_only_copy(hf_dir, h), outtype)
    else:
        _write_qwen3_vl_lm(hf_dir, h, arch, lm_path, outtype)
    _write_qwen3_vl_mmproj(hf_dir, h, mmproj_path, outtype, deepstack_order)


def _text_only_copy(hf_dir: str, h: dict) -> str:
    """The VL checkpoint's text model as the hybrid's text-only checkpoint (what Qwen3_5TextModel converts: the
    language model's tensors, named as Qwen3_5ForCausalLM's) in hf_dir/text."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = os.path.join(hf_dir, "text")
    os.makedirs(out, exist_ok=True)
    text = dict(h["text_config"])
    text["architectures"] = [{"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[h["model_type"]]]
    text["tie_word_embeddings"] = h.get("tie_word_embeddings", False)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(text, f)
    for name in os.listdir(hf_dir):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(hf_dir, name), out)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    save_file({n.replace("model.language_model.", "model.", 1): t for n, t in state.items()
               if not n.startswith(("model.visual.", "mtp."))}, os.path.join(out, "model.safetensors"))
    return out


def _write_qwen3_vl_lm(hf_dir: str, h: dict, arch: str, lm_path: str, outtype: str) -> None:
    import gguf
    from safetensors.torch import load_file

    text, vision = h["text_config"], h["vision_config"]
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16}[outtype]
    w = _vl_text_writer(lm_path, arch, hf_dir, text, file_type)
    w.add_key_length(text["head_dim"])
    w.add_value_length(text["head_dim"])
    if arch == "qwen3vlmoe":
        w.add_expert_count(text.get("num_experts", text.get("num_local_experts")))
        w.add_expert_used_count(text["num_experts_per_tok"])
        w.add_expert_feed_forward_length(text["moe_intermediate_size"])
    w.add_num_deepstack_layers(len(vision.get("deepstack_visual_indexes") or ()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], text["num_hidden_layers"])
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name.startswith("model.visual."):
            continue
        name = name.replace("model.language_model.", "model.", 1)
        parts = [(name, t)]
        if name.endswith("mlp.experts.gate_up_proj"):  # released [E, H, 2I]: gate's columns, then up's
            half = t.shape[-1] // 2
            base = name.rsplit(".", 1)[0]
            parts = [(f"{base}.gate_proj.weight", t[..., :half].transpose(1, 2)),
                     (f"{base}.up_proj.weight", t[..., half:].transpose(1, 2))]
        elif name.endswith("mlp.experts.down_proj"):  # released [E, I, H]
            parts = [(f"{name}.weight", t.transpose(1, 2))]
        for hf_name, data in parts:
            gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise ValueError(f"no GGUF name for {hf_name}")
            _add_tensor(w, gname, data.contiguous(), outtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_qwen3_vl_mmproj(hf_dir: str, h: dict, mmproj_path: str, outtype: str, deepstack_order: Any) -> None:
    import gguf
    from safetensors.torch import load_file

    text, vision = h["text_config"], h["vision_config"]
    deepstack = list(vision.get("deepstack_visual_indexes") or ())
    with open(os.path.join(hf_dir, "preprocessor_config.json")) as f:
        pre = json.load(f)
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16}[outtype]
    m = gguf.GGUFWriter(str(mmproj_path), "clip")
    m.add_type(gguf.GGUFType.MMPROJ)
    m.add_file_type(file_type)
    m.add_clip_has_vision_encoder(True)
    m.add_vision_projection_dim(text["hidden_size"])
    m.add_vision_image_size(int(vision["num_position_embeddings"] ** 0.5 * vision["patch_size"]))
    m.add_vision_patch_size(vision["patch_size"])
    m.add_vision_embedding_length(vision["hidden_size"])
    m.add_vision_feed_forward_length(vision["intermediate_size"])
    m.add_vision_block_count(vision["depth"])
    m.add_vision_head_count(vision["num_heads"])
    m.add_vision_image_mean(pre["image_mean"])
    m.add_vision_image_std(pre["image_std"])
    m.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    m.add_vision_use_gelu(True)
    m.add_vision_spatial_merge_size(vision["spatial_merge_size"])
    m.add_vision_attention_layernorm_eps(text["rms_norm_eps"])
    m.add_vision_is_deepstack_layers([i in deepstack for i in range(vision["depth"])])
    vnames = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["depth"])
    order = list(deepstack_order) if deepstack_order is not None else list(range(len(deepstack)))
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if not name.startswith("model.visual."):
            continue
        name = name.replace("model.visual.", "visual.", 1)
        rest, _, suffix = name.split(".", 1)[1].rpartition(".")
        if name == "visual.patch_embed.proj.weight":  # Conv3d [out, C, 2, P, P] -> two Conv2d kernels
            _add_tensor(m, "v.patch_embd.weight", t[:, :, 0], outtype)
            _add_tensor(m, "v.patch_embd.weight.1", t[:, :, 1], outtype)
        elif name == "visual.patch_embed.proj.bias":
            _add_tensor(m, "v.patch_embd.bias", t, outtype)
        elif rest.startswith("deepstack_merger_list."):  # level k -> the block it follows
            _, k, part = rest.split(".")
            _add_tensor(m, f"v.deepstack.{deepstack[order[int(k)]]}.{_DEEPSTACK_PARTS[part]}.{suffix}", t, outtype)
        elif rest.startswith("merger."):
            _add_tensor(m, f"{_MERGER_PARTS[rest.split('.')[1]]}.{suffix}", t, outtype)
        else:
            gname = vnames.get_name(name, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise ValueError(f"no GGUF name for {name}")
            _add_tensor(m, gname, t, outtype)
    m.write_header_to_file()
    m.write_kv_data_to_file()
    m.write_tensors_to_file()
    m.close()


# --- a tiny qwen2 file of mixed quantized kinds (tensor-parallel and --hf-config-path tests) ---------------------
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}
# a mix of kinds (merged qkv / gate_up of mixed kinds), every row-parallel input 64-aligned per rank; the tied
# embedding kept quantized (Q8_0) and sharded by vocabulary rows over an odd vocabulary (a zero-padded tail)
_GGUF_TYPES = {"embed_tokens": "Q8_0", "q_proj": "Q8_0", "k_proj": "Q4_0", "v_proj": "Q5_0", "o_proj": "Q4_1",
               "gate_proj": "Q5_1", "up_proj": "Q8_0", "down_proj": "Q8_0"}


def write_tiny_qwen2_gguf(path: str) -> str:
    """A tiny qwen2 GGUF file of mixed quantized kinds (_GGUF_TYPES), its embedding tied; no tokenizer (engines run
    it with skip_tokenizer_init). Its config: tiny_qwen2_gguf_config()."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_qwen2_gguf_config()
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(cfg).state_dict()
    w = writer_with_header(path, "qwen2", cfg)
    for name, t in state.items():
        if name == "lm_head.weight":
            continue
        module, suffix = name.rsplit(".", 1)
        if module == "model.embed_tokens":
            gname = "token_embd"
        elif module == "model.norm":
            gname = "output_norm"
        else:
            _, _, layer, rest = module.split(".", 3)
            gname = f"blk.{layer}.{_GGUF_NAMES[rest]}"
        array = t.float().numpy()
        qtype = _GGUF_TYPES.get(module.rpartition(".")[2]) if suffix == "weight" else None
        if qtype is not None:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(f"{gname}.{suffix}", gguf.quants.quantize(array, q), raw_dtype=q)
        else:
            w.add_tensor(f"{gname}.{suffix}", array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_qwen2_gguf_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
