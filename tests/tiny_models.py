"""Tiny random models saved with transformers at test time (no network), with a small BPE tokenizer."""
from __future__ import annotations

import os
from typing import Any

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "What is the capital of France? The capital of France is Paris.",
    "Hello world! Voltllm serves language models on old GPUs, fast. Ünïcödé: héllo wörld, 東京, 🙂",
    "def add(a, b):\n    return a + b\n",
    "0123456789 " * 4,
]


def make_tokenizer(path: str, vocab_size: int = 400, added_tokens: tuple = ()) -> Any:
    """added_tokens: whole tokens added after training, kept in the text (Qwen3's "<think>" / "</think>" are)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_CORPUS, vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>",
                                  bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if added_tokens:
        tok.add_tokens(list(added_tokens), special_tokens=False)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return tok


def make_model(path: str, kind: str = "llama", seed: int = 0, std: float = 0.15, added_tokens: tuple = (),
               **overrides: Any) -> str:
    """Save a tiny random model of `kind` (llama | qwen2 | qwen3 | qwen3_moe: 8 experts, top 2, layer 1 dense) with
    a tokenizer under path (added_tokens: make_tokenizer's)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[kind]
    tok = make_tokenizer(path, added_tokens=added_tokens)
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
              tie_word_embeddings=kind not in ("qwen3", "qwen3_moe"), bos_token_id=tok.bos_token_id,
              eos_token_id=tok.eos_token_id, rms_norm_eps=1e-6)
    if kind == "qwen3_moe":
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[1])
    kw.update(overrides)
    cfg = cls(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def assert_prompt_logprobs_match(llm: Any, ref: Any, prompts: list, atol: float = 1e-4) -> None:
    """The engine's prompt logprobs over the whole vocabulary at every prompt position, batched, against the
    transformers model `ref`'s log-softmax on the same ids."""
    from voltllm import SamplingParams

    tok = llm.get_tokenizer()
    vocab = ref.config.vocab_size
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=vocab))
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref_lp = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ids)
        for pos in range(1, len(ids)):
            ours = torch.full((vocab,), float("nan"))
            for tid, lp in out.prompt_logprobs[pos].items():
                ours[tid] = lp.logprob
            assert torch.allclose(ours, ref_lp[pos - 1], atol=atol, rtol=atol), f"{prompt!r} position {pos}"


def full_prompt_logprobs(llm: Any, prompts: list) -> torch.Tensor:
    """The engine's prompt logprobs over the whole vocabulary, one float64 row per prompt position after the first
    (all prompts, batched), for comparing two engines on the same model."""
    from voltllm import SamplingParams

    vocab = llm.config.model.hf_config.vocab_size
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=vocab))
    rows = []
    for out in outs:
        for pos in out.prompt_logprobs[1:]:
            row = torch.full((vocab,), float("nan"), dtype=torch.float64)
            for tid, lp in pos.items():
                row[tid] = lp.logprob
            rows.append(row)
    return torch.stack(rows)


# --- tiny hybrid (Gated DeltaNet + attention) checkpoints -----------------------------------------------
HYBRID_VOCAB = 192
HYBRID_COMMON = dict(vocab_size=HYBRID_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=96,
                     max_position_embeddings=4096, initializer_range=0.08, rms_norm_eps=1e-6)
HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def small_moe(kind: str) -> dict:
    """HYBRID_MOE for the MoE kinds, else nothing: make_tiny_hybrid without it keeps transformers' default expert counts
    (qwen3_next: 512 experts of 512, ~0.8 GB in fp32 per copy of the model), which CPU tests need not pay."""
    return dict(HYBRID_MOE) if kind in ("qwen3_next", "qwen3_5_moe") else {}
_HYBRID_CONFIGS = {"qwen3_5": "Qwen3_5TextConfig", "qwen3_next": "Qwen3NextConfig",
                   "qwen3_5_moe": "Qwen3_5MoeTextConfig"}


def make_tiny_hybrid(path: str, kind: str, seed: int, gen_seed: int, conv_std: float | None = None,
                     **overrides: Any) -> str | None:
    """Save a tiny random qwen3_5 / qwen3_next / qwen3_5_moe checkpoint (HYBRID_COMMON + overrides) under path,
    with slow-ish GDN decays (so the state matters across a whole sequence) and perturbed norms; conv_std
    rescales the conv1d weights. None when this transformers lacks the architecture."""
    import transformers

    cls = getattr(transformers, _HYBRID_CONFIGS[kind], None)
    if cls is None:
        return None
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**HYBRID_COMMON, **overrides}))
    gen = torch.Generator().manual_seed(gen_seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.3, generator=gen).log())
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            elif conv_std is not None and "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * conv_std)
    model.save_pretrained(path)
    return str(path)



# --- tiny Qwen4-Exp (qwen4_exp_text) checkpoints: hyper-connections, GDN + gated attention, MoE every layer -----
QWEN4_EXP_EOS = 5
QWEN4_EXP_COMMON = dict(
    vocab_size=HYBRID_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    max_position_embeddings=4096, rms_norm_eps=1e-6, hc_count=2, hc_lowrank=16, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, eos_token_id=QWEN4_EXP_EOS,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [4, 2, 2], "mrope_interleaved": True})
# the QSA indexer (transformers always builds it): a budget past every context is plain causal attention
QWEN4_EXP_INDEXER = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=4096,
                         indexer_compress_ratio=4)
# PLE on layers 1 and 3 (1-indexed; linear-attention layers), n-gram tables of 4 heads of 16 channels in 4 shards
QWEN4_EXP_PLE = dict(ple_layer_ids=[1, 3], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=101,
                     make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, ple_conv_kernel_size=3)


def make_tiny_qwen4_exp(path: str, seed: int, **overrides: Any) -> str | None:
    """Save a tiny random qwen4_exp_text checkpoint (QWEN4_EXP_COMMON + overrides) under path, with slow-ish GDN
    decays, perturbed norms, larger conv and n-gram table weights (so every part moves the logits). None when this
    transformers lacks Qwen4-Exp."""
    import transformers

    cls = getattr(transformers, "Qwen4ExpTextConfig", None)
    if cls is None:
        return None
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**QWEN4_EXP_COMMON, **overrides}))
    randomize_qwen4_exp(model, seed + 1)
    model.save_pretrained(path)
    return str(path)


def randomize_qwen4_exp(model: torch.nn.Module, seed: int) -> None:
    """Qwen4-Exp's parameters that transformers initialises to constants made random (GDN decay, norms, the
    dilated convs, the n-gram tables), so a missing piece changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.6, generator=gen).log())
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
            elif "ngram_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=gen))


def tiny_gdn_layer(device: str) -> Any:
    """One GatedDeltaNet layer (2 key / 4 value heads of 16, conv kernel 4, hidden 32), fp32, seeded random
    weights (std 0.3): the layer-level kernel checks run it with their Triton path on and off."""
    from types import SimpleNamespace

    from voltllm.model.layers.gdn import GatedDeltaNet

    cfg = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_conv_kernel_dim=4, hidden_size=32, rms_norm_eps=1e-6,
                          hidden_act="silu")
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, 0, torch.float32).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer
