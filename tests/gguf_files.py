"""Writing tiny GGUF files in tests the way llama.cpp's converter lays out their metadata."""
from typing import Any


def writer_with_header(path: str, arch: str, cfg: Any) -> Any:
    """A gguf.GGUFWriter for `arch` with the model metadata of the transformers config `cfg` (the shapes, RoPE,
    norm epsilon, special tokens; the expert counts of qwen3moe)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
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
