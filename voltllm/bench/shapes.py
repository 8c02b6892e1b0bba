"""Named model shapes for speed runs: random weights at real shapes (../shared/MODELS.md, section 3).

`materialize(name_or_dir, dest)` returns a directory holding a config.json that the engine loads with
--load-format dummy (random weights, no file I/O for weights) and --skip-tokenizer-init.
"""
from __future__ import annotations

import os
from typing import Any

# name -> (transformers config class name, keyword arguments). Widths are the real checkpoints'.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-8b-shape": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=40960)),
    "qwen3-0.6b-shape": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=40960)),
    # Qwen3-30B-A3B: attention in every layer, 128 experts, 8 routed per token (no shared expert), expert width 768
    "qwen3-30b-a3b-shape": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        max_position_embeddings=40960)),
    # SmolLM2-135M-Instruct (the embedded default model), for speed runs without carrying the GGUF
    "smollm2-135m-shape": ("LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=100000.0)),
    # hybrid: 3 Gated DeltaNet (linear attention) layers : 1 full-attention layer
    "qwen3.5-27b-shape": ("Qwen3_5TextConfig", dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=False, max_position_embeddings=262144)),
    # hybrid + sparse MoE in every layer: Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults are
    # this checkpoint's): 256 experts, 8 routed + 1 shared expert per token, expert width 512
    "qwen3.5-35b-a3b-shape": ("Qwen3_5MoeTextConfig", dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, tie_word_embeddings=False,
        max_position_embeddings=262144)),
    # Qwen3-Next-80B-A3B: 512 experts, 10 routed + 1 shared per token, expert width 512
    "qwen3-next-80b-a3b-shape": ("Qwen3NextConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        max_position_embeddings=262144)),
    # Qwen4-Exp (qwen4_exp_text): transformers' Qwen4ExpTextConfig defaults (hidden 2048, 40 layers 3 GDN : 1 QSA
    # attention, 512 experts top-10 of width 512 + a shared one, hyper-connections 4 x 320) with
    # - QSA: 4 indexer heads of 128, budget 2048 tokens in blocks of 4: the figures of TensorRT-Edge-LLM's QSA indexer
    #   kernel docs (a [B, S, 4, 128] query, S / 4 blocks, 2048 + 3 selected rows); the checkpoint's config was not
    #   found, so they are the best available guess;
    # - PLE on the first three GDN layers (a guess: where the real model puts them is not known here) with a SMALL
    #   n-gram vocabulary (base 20K rows per head: ~80 MiB of host table per layer in bf16), not the real 20M per head,
    #   whose tables (~90 GiB of host memory) would have to be allocated and page-locked for a random-weight run.
    #   The tables stay in host memory (the GPU reads a step's rows in place), so their size changes no GPU figure;
    # - eos_token_id 248044 (Qwen3.5's <|endoftext|>): PLE resets its n-gram windows at it; Qwen3.5's RoPE (a quarter
    #   of the head rotated, theta 1e7: transformers' default rotates all 256 dims, more than the 128-wide index head).
    "qwen4-exp-shape": ("Qwen4ExpTextConfig", dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, hc_count=4, hc_lowrank=320,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        ple_layer_ids=[1, 2, 3], ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000,
        eos_token_id=248044, tie_word_embeddings=False, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True})),
}


def shape_names() -> list[str]:
    return sorted(SHAPES)


def make_config(name: str) -> Any:
    """The transformers config object of a named shape."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: choose one of {', '.join(shape_names())} "
                         "or give a directory holding a config.json")
    import transformers

    cls_name, kwargs = SHAPES[name]
    cls = getattr(transformers, cls_name)
    return cls(**kwargs)


def materialize(name_or_dir: str, dest: str) -> str:
    """Directory with the config.json of a named shape (written under dest), or name_or_dir itself
    when it is already a directory with a config.json."""
    path = os.path.expanduser(name_or_dir)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--random-weights {name_or_dir}: the directory has no config.json")
        return path
    cfg = make_config(name_or_dir)
    out = os.path.join(dest, name_or_dir)
    os.makedirs(out, exist_ok=True)
    cfg.save_pretrained(out)
    return out
