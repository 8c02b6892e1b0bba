"""A Hugging Face checkpoint of random quantized weights (4-bit AWQ or GPTQ, 8-bit GPTQ (--method gptq --bits 8, the
layout of Qwen's *-GPTQ-Int8), FP8 E4M3 with 128 x 128 block scales,
NVFP4 as NVIDIA ModelOpt writes it, or fp16 for `--quantization fp8` at load) at a named dense or hybrid shape, for
end-to-end runs of quantized checkpoints on the GPU machine (the real Qwen AWQ / GPTQ / FP8 / NVFP4 repos are too large
to carry there).

    PYTHONPATH=$PWD python3 benchmarks/make_random_quantized.py --shape qwen3-8b-shape --method awq --group 128 \\
        /root/m/qwen3-8b-awq

The tokenizer, if any, is converted from --tokenizer-from (a GGUF file or a Hugging Face directory); the
vocabulary is the shape's or the tokenizer's, whichever is larger (`voltllm bench` needs no tokenizer: it speaks
token ids). Every projection gets random packed words (all codes and zero points; 8-bit zero fields 0..254, as a
GPTQ v1 field of 255 would read as a zero of 256, which the planes do not hold) and fp16 group scales of about
`scale`, or random E4M3 codes (all but the NaNs) and fp32 block scales, or (nvfp4) random E2M1 codes, E4M3 group
scales and an fp32 global scale per tensor (`--quantization modelopt_fp4`); embeddings, the LM head and norms are fp16
as the quantizers leave them. Hybrid shapes (qwen3.5-27b-shape, qwen3.5-35b-a3b-shape, qwen3-next-80b-a3b-shape) pack
the attention, Gated DeltaNet (in_proj_qkvz or in_proj_qkv / in_proj_z, out_proj), dense-MLP, routed and shared
expert projections; the GDN b / a projections, routers, shared-expert gates, conv1d, decays and norms stay fp16 / fp32.
The values mean nothing; the bytes, layouts and quantization_config are a real checkpoint's.
"""
import argparse
import json
import os
import sys
from typing import Optional

import torch

from voltllm.bench.shapes import SHAPES, make_config
from voltllm.model.models.llama import is_moe_layer

DENSE = ("Qwen3Config", "LlamaConfig", "Qwen3MoeConfig")  # the llama-family model's architectures
HYBRID = ("Qwen3_5TextConfig", "Qwen3NextConfig", "Qwen3_5MoeTextConfig")  # Gated DeltaNet + gated attention
SHARD_BYTES = 2 << 30


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def packed_layer(method: str, rows: int, cols: int, group: int, scale: float, gen: torch.Generator,
                 bits: int = 4) -> dict:
    """The tensors of one [rows, cols] projection in the method's layout: qweight / qzeros / scales (/ g_idx; GPTQ
    packs 32 / bits codes per word);
    FP8: weight and weight_scale_inv; NVFP4 (ModelOpt's names): weight, weight_scale, weight_scale_2, input_scale;
    fp16: weight."""
    if method == "fp16":
        return {"weight": (torch.randn(rows, cols, generator=gen) * scale * 4).half()}
    if method == "fp8":
        codes = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0x7E
        blocks = (-(-rows // 128), -(-cols // 128))
        return {"weight": codes.view(torch.float8_e4m3fn),
                "weight_scale_inv": torch.rand(*blocks, generator=gen) * scale / 100 + scale / 200}
    if method == "nvfp4":  # E4M3 group scales 0.25 .. 448 (codes 0x28 .. 0x7E, no NaN) times scale / 448:
        # |w| <= 6 scale
        codes = torch.randint(0x28, 0x7F, (rows, cols // 16), dtype=torch.uint8, generator=gen)
        return {"weight": torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen),
                "weight_scale": codes.view(torch.float8_e4m3fn), "weight_scale_2": torch.tensor(scale / 448),
                "input_scale": torch.tensor(0.01)}
    def words(*shape):
        return torch.randint(-2**31, 2**31, shape, dtype=torch.int32, generator=gen)

    groups = cols // group
    scales = (torch.rand(groups, rows, generator=gen) * scale + scale / 2).half()
    if method == "awq":
        return {"qweight": words(cols, rows // 8), "qzeros": words(groups, rows // 8), "scales": scales}
    per = 32 // bits
    if bits == 8:  # zero fields 0..254 (bytes of little-endian words)
        qzeros = torch.randint(0, 255, (groups, rows), dtype=torch.uint8, generator=gen).view(torch.int32)
    else:
        qzeros = words(groups, rows // per)
    return {"qweight": words(cols // per, rows), "qzeros": qzeros, "scales": scales,
            "g_idx": (torch.arange(cols) // group).to(torch.int32)}


def write(shape: str, method: str, group: int, tokenizer_from: Optional[str], out: str, seed: int = 0,
          scale: float = 0.002, bits: int = 4) -> int:
    """Write the checkpoint directory; returns the bytes of its tensors. bits: GPTQ's 4 or 8."""
    from safetensors.torch import save_file

    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise SystemExit(f"--bits {bits}: 4 for every method, 8 for gptq")

    cls, _ = SHAPES[shape]
    if cls not in DENSE + HYBRID:
        raise SystemExit(f"{shape}: only llama / qwen3 / qwen3_moe and hybrid (qwen3_5 / qwen3_next / qwen3_5_moe) "
                         "shapes")
    c = make_config(shape)
    tok = load_tokenizer(tokenizer_from) if tokenizer_from else None
    if tok is not None:
        c.vocab_size = max(c.vocab_size, len(tok))
    h, inter = c.hidden_size, getattr(c, "intermediate_size", None)  # (None: MoE in every layer)
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    moe_inter = int(getattr(c, "moe_intermediate_size", 0) or 0)
    hybrid = cls in HYBRID
    shared_inter = int(getattr(c, "shared_expert_intermediate_size", 0) or 0) if hybrid else 0
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim if hybrid else 0
    if method == "nvfp4":
        group = 16
    widths = {k for k in (h, q, inter, moe_inter, shared_inter, value_dim) if k}
    for k in widths:
        if k % group:
            raise SystemExit(f"{shape}: {k} input features are not a multiple of the group size {group}")
    os.makedirs(out, exist_ok=True)
    if tok is not None:
        tok.save_pretrained(out)
    c.save_pretrained(out)
    if method == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    elif method == "nvfp4":
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}
    else:
        qc = {"quant_method": method, "bits": bits, "group_size": group}
        qc.update({"zero_point": True, "version": "gemm"} if method == "awq"
                  else {"sym": False, "desc_act": False, "checkpoint_format": "gptq"})
    if method != "fp16":
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = qc
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)

    gen = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    written = [0, 0, 0]  # shards, bytes, bytes of the open shard (a running count: MoE shapes add ~10^5 tensors)

    def flush() -> None:
        if shard:
            save_file(shard, os.path.join(out, f"model-{written[0]:05d}.safetensors"), metadata={"format": "pt"})
            written[0] += 1
            written[2] = 0
            shard.clear()

    def add(name: str, t: torch.Tensor) -> None:
        shard[name] = t
        written[1] += t.numel() * t.element_size()
        written[2] += t.numel() * t.element_size()
        if written[2] > SHARD_BYTES:
            flush()

    norm = torch.zeros if hybrid else torch.ones  # unit norms (the hybrids' RMSNorms scale by 1 + w)
    add("model.embed_tokens.weight", (torch.randn(c.vocab_size, h, generator=gen) * 0.02).half())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        projections = [("self_attn.q_proj", q, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                       ("self_attn.o_proj", h, q)]
        if hybrid:
            projections = hybrid_layer(c, i, p, add, gen)
        if hybrid and is_moe_layer(c, i):
            # routed experts as below, plus the shared expert (packed) and its gate (fp16, as quantizers leave it)
            add(f"{p}.mlp.gate.weight", (torch.randn(c.num_experts, h, generator=gen) * 0.02).half())
            add(f"{p}.mlp.shared_expert_gate.weight", (torch.randn(1, h, generator=gen) * 0.02).half())
            projections += [(f"mlp.experts.{e}.{n}", rows, cols) for e in range(c.num_experts) for n, rows, cols in
                            (("gate_proj", moe_inter, h), ("up_proj", moe_inter, h), ("down_proj", h, moe_inter))]
            projections += [("mlp.shared_expert.gate_proj", shared_inter, h), ("mlp.shared_expert.up_proj",
                             shared_inter, h), ("mlp.shared_expert.down_proj", h, shared_inter)]
        elif is_moe_layer(c, i):  # per-expert projections, as the quantizers write them; the router in fp16
            add(f"{p}.mlp.gate.weight", (torch.randn(c.num_experts, h, generator=gen) * 0.02).half())
            projections += [(f"mlp.experts.{e}.{n}", rows, cols) for e in range(c.num_experts) for n, rows, cols in
                            (("gate_proj", moe_inter, h), ("up_proj", moe_inter, h), ("down_proj", h, moe_inter))]
        else:
            projections += [("mlp.gate_proj", inter, h), ("mlp.up_proj", inter, h), ("mlp.down_proj", h, inter)]
        for name, rows, cols in projections:
            for part, t in packed_layer(method, rows, cols, group, scale, gen, bits).items():
                add(f"{p}.{name}.{part}", t)
        add(f"{p}.input_layernorm.weight", norm(h, dtype=torch.float16))
        add(f"{p}.post_attention_layernorm.weight", norm(h, dtype=torch.float16))
        if c.model_type in ("qwen3", "qwen3_moe") or hybrid and c.layer_types[i] == "full_attention":
            add(f"{p}.self_attn.q_norm.weight", norm(head_dim, dtype=torch.float16))
            add(f"{p}.self_attn.k_norm.weight", norm(head_dim, dtype=torch.float16))
    add("model.norm.weight", norm(h, dtype=torch.float16))
    if not getattr(c, "tie_word_embeddings", False):
        add("lm_head.weight", (torch.randn(c.vocab_size, h, generator=gen) * 0.02).half())
    flush()
    return written[1]


def hybrid_layer(c, i: int, p: str, add, gen: torch.Generator) -> list[tuple[str, int, int]]:
    """A hybrid layer's mixer: gated attention (q_proj gives [q | gate] per head: twice the rows) or Gated DeltaNet
    (its conv1d, decays and norm in fp16 / fp32 here); returns the projections to pack. The GDN b / a projections
    stay fp16 (a few dozen rows: the quantizers commonly leave them out), so in_proj mixes planes and a dense part."""
    h = c.hidden_size
    if c.layer_types[i] == "full_attention":
        head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
        q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
        return [("self_attn.q_proj", 2 * q, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                ("self_attn.o_proj", h, q)]
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    key_dim, value_dim = nk * c.linear_key_head_dim, nv * c.linear_value_head_dim
    g = f"{p}.linear_attn"
    add(f"{g}.conv1d.weight", (torch.randn(2 * key_dim + value_dim, 1, c.linear_conv_kernel_dim, generator=gen)
                               * 0.2).half())
    add(f"{g}.A_log", torch.empty(nv).uniform_(0.02, 0.3, generator=gen).log())
    add(f"{g}.dt_bias", torch.ones(nv))
    add(f"{g}.norm.weight", torch.ones(c.linear_value_head_dim))
    if c.model_type == "qwen3_next":
        add(f"{g}.in_proj_ba.weight", (torch.randn(2 * nv, h, generator=gen) * 0.02).half())
        return [("linear_attn.in_proj_qkvz", 2 * key_dim + 2 * value_dim, h), ("linear_attn.out_proj", h, value_dim)]
    add(f"{g}.in_proj_b.weight", (torch.randn(nv, h, generator=gen) * 0.02).half())
    add(f"{g}.in_proj_a.weight", (torch.randn(nv, h, generator=gen) * 0.02).half())
    return [("linear_attn.in_proj_qkv", 2 * key_dim + value_dim, h), ("linear_attn.in_proj_z", value_dim, h),
            ("linear_attn.out_proj", h, value_dim)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3-8b-shape",
                    choices=[s for s, (cls, _) in SHAPES.items() if cls in DENSE + HYBRID])
    ap.add_argument("--method", default="awq", choices=["awq", "gptq", "fp8", "nvfp4", "fp16"])
    ap.add_argument("--group", type=int, default=128, help="AWQ / GPTQ group size (NVFP4: always 16)")
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8], help="GPTQ weight bits (AWQ: 4)")
    ap.add_argument("--tokenizer-from", help="a GGUF file or Hugging Face directory (default: none)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    nbytes = write(args.shape, args.method, args.group, args.tokenizer_from, args.out, args.seed, bits=args.bits)
    print(f"wrote {args.out}: {nbytes / 2**30:.2f} GiB of tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
