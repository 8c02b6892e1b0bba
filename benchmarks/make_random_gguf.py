"""A GGUF file of random quantized weights at a named dense shape, for end-to-end runs of GGUF weights kept quantized
on the GPU machine (the real Qwen GGUFs are too large to carry there: ../shared/MODELS.md).

    PYTHONPATH=$PWD python3 benchmarks/make_random_gguf.py --shape qwen3-8b-shape --mix Q4_K_M \\
        --tokenizer-from /root/m/smollm2.gguf /root/m/qwen3-8b-q4_k_m.gguf

The tokenizer (and so the vocabulary: the LM head and embeddings get its size, not the shape's) is copied from
--tokenizer-from. --mix is one GGUF type for every matrix (Q4_0, Q8_0, Q4_K, Q6_K, Q3_K, IQ4_NL, ...), or one of
llama.cpp's file types, a mix (roughly llama.cpp's rules, MIXES): Q4_K_M (Q4_K, attn_v and ffn_down Q6_K in every
other layer), Q3_K_M (Q3_K; attn_output Q4_K, attn_v / ffn_down Q5_K and Q4_K in alternate layers), Q2_K (Q2_K;
attn_output Q3_K, attn_v / ffn_down Q4_K and Q3_K) and IQ4_XS (IQ4_XS; attn_v / ffn_down Q5_K in every other
layer), each with the LM head Q6_K. As llama.cpp does, a matrix whose rows are not whole 256-element blocks takes
the type's fallback (IQ4_NL for Q2_K / Q3_K / IQ4_XS, Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K). Block scales
are random around 0.02 (voltllm.model.layers.gguf_planes.random_blocks): the values mean nothing, the bytes and
kinds are a real file's.
"""
import argparse
import sys

import numpy as np
import torch

from voltllm.bench.shapes import SHAPES, make_config
from voltllm.model.layers.gguf_planes import KINDS, random_blocks

ARCH = {"Qwen3Config": "qwen3", "LlamaConfig": "llama", "Qwen3MoeConfig": "qwen3moe"}


# llama.cpp file type -> (most matrices, attn_v / ffn_down in even layers, in odd layers, attn_output); the LM head
# is Q6_K in every mix
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K", "Q4_K", "Q4_K"), "Q3_K_M": ("Q3_K", "Q5_K", "Q4_K", "Q4_K"),
         "Q2_K": ("Q2_K", "Q4_K", "Q3_K", "Q3_K"), "IQ4_XS": ("IQ4_XS", "Q5_K", "IQ4_XS", "IQ4_XS")}
# llama.cpp's type for a matrix whose rows are not whole 256-element blocks
FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def kind_of(name: str, layer: int, mix: str) -> str:
    """The GGUF type of one matrix under the mix."""
    if mix not in MIXES:
        return mix
    base, even, odd, attn_output = MIXES[mix]
    if name == "output":
        return "Q6_K"
    if name in ("attn_v", "ffn_down", "ffn_down_exps"):
        return even if layer % 2 == 0 else odd
    return attn_output if name == "attn_output" else base


def fitted(kind: str, cols: int) -> str:
    """The type a matrix of `cols` inputs gets: llama.cpp's fallback where rows are not whole blocks of `kind`."""
    return FALLBACK.get(kind, kind) if cols % KINDS[kind].block else kind


def copy_tokenizer(writer, path: str) -> int:
    """Copy every tokenizer.* field of another GGUF file; returns its vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
    return vocab


def write(shape: str, mix: str, tokenizer_from: str, out: str, seed: int = 0) -> dict:
    """Write the file; returns {GGUF type: bytes} of its matrices."""
    import gguf

    cls, _ = SHAPES[shape]
    if cls not in ARCH:
        raise SystemExit(f"{shape}: only llama / qwen3 / qwen3moe shapes (GGUF architectures voltllm reads)")
    arch, c = ARCH[cls], make_config(shape)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(out, arch)
    vocab = copy_tokenizer(w, tokenizer_from)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 1_000_000.0)))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    experts = int(getattr(c, "num_experts", 0) or 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    gen = torch.Generator().manual_seed(seed)
    sizes: dict[str, int] = {}

    def matrix(name: str, rows: int, cols: int, kind: str, stack: int = 0) -> None:
        """One matrix of random blocks, or `stack` of them as one [stack, rows, cols] tensor (llama.cpp's
        experts)."""
        kind = fitted(kind, cols)
        raw = random_blocks(kind, max(stack, 1) * rows, cols, gen).numpy()
        if stack:
            raw = raw.reshape(stack, rows, -1)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        sizes[kind] = sizes.get(kind, 0) + raw.nbytes

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    h, inter = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    matrix("token_embd.weight", vocab, h, kind_of("token_embd", 0, mix))
    for i in range(c.num_hidden_layers):
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            matrix(f"blk.{i}.{name}.weight", rows, cols, kind_of(name, i, mix))
        if experts:  # every layer sparse (qwen3moe): the router in F32, the experts stacked per projection
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                         (torch.randn(experts, h, generator=gen) * 0.02).numpy().astype(np.float32))
            mi = c.moe_intermediate_size
            for name, rows, cols in (("ffn_gate_exps", mi, h), ("ffn_up_exps", mi, h), ("ffn_down_exps", h, mi)):
                matrix(f"blk.{i}.{name}.weight", rows, cols, kind_of(name, i, mix), stack=experts)
        else:
            for name, rows, cols in (("ffn_gate", inter, h), ("ffn_up", inter, h), ("ffn_down", h, inter)):
                matrix(f"blk.{i}.{name}.weight", rows, cols, kind_of(name, i, mix))
        ones(f"blk.{i}.attn_norm.weight", h)
        ones(f"blk.{i}.ffn_norm.weight", h)
        if arch in ("qwen3", "qwen3moe"):
            ones(f"blk.{i}.attn_q_norm.weight", head_dim)
            ones(f"blk.{i}.attn_k_norm.weight", head_dim)
    ones("output_norm.weight", h)
    if not getattr(c, "tie_word_embeddings", False):
        matrix("output.weight", vocab, h, kind_of("output", 0, mix))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sizes


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3-8b-shape", choices=[s for s, (cls, _) in SHAPES.items() if cls in ARCH])
    ap.add_argument("--mix", default="Q4_K_M", choices=[*MIXES, *(k for k in KINDS if k not in MIXES)])
    ap.add_argument("--tokenizer-from", required=True, help="a GGUF file whose tokenizer to copy")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sizes = write(args.shape, args.mix, args.tokenizer_from, args.out, args.seed)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sorted(sizes.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
