"""The norm-folded decode layers' weight side (voltllm.model.norm_fold) on the CPU: the fold keeps every layer's
function (unfused forward on folded weights), is idempotent, and a reload brings the checkpoint's unfolded weights
back, which refold_after_reload folds again exactly when the model has a plan."""
from __future__ import annotations

import types

import torch
import transformers

from voltllm.model.models.llama import LlamaForCausalLM
from voltllm.model.norm_fold import fold_norm_weights, ineligible
from voltllm.worker.norm_fold_tuning import refold_after_reload


def _model(seed: int = 0) -> tuple[LlamaForCausalLM, dict]:
    cfg = transformers.Qwen3Config(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, intermediate_size=48)
    model = LlamaForCausalLM(cfg, torch.float32, 64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.2 * torch.randn(p.shape, generator=gen))
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def _layer_outputs(model, x):
    """Each decoder layer's norm -> projection products (the parts the fold touches), unfused."""
    outs = []
    for layer in model.layers:
        outs.append(layer.self_attn.qkv_proj(layer.input_layernorm(x)))
        outs.append(layer.mlp.gate_up_proj(layer.post_attention_layernorm(x)))
    return outs


def test_fold_keeps_the_function_and_is_idempotent():
    model, _ = _model()
    x = torch.randn(5, 32)
    before = _layer_outputs(model, x)
    fold_norm_weights(model)
    for layer in model.layers:
        assert torch.equal(layer.input_layernorm.weight, torch.ones(32))
        assert torch.equal(layer.post_attention_layernorm.weight, torch.ones(32))
    after = _layer_outputs(model, x)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    once = [p.clone() for p in model.parameters()]
    fold_norm_weights(model)
    assert all(torch.equal(a, b) for a, b in zip(once, model.parameters()))


def test_reload_then_refold_only_with_a_plan():
    model, original = _model(1)
    fold_norm_weights(model)
    folded = {n: p.detach().clone() for n, p in model.named_parameters()}

    def reload():  # what a checkpoint reload does: the unfolded values back into the same tensors
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n])

    reload()
    refold_after_reload(model)  # no plan: the weights stay as loaded
    assert all(torch.equal(p, original[n]) for n, p in model.named_parameters())
    model.norm_fold = types.SimpleNamespace(configs={64: {}})
    reload()
    refold_after_reload(model)
    assert all(torch.equal(p, folded[n]) for n, p in model.named_parameters())


def test_ineligible_reasons_on_the_cpu(monkeypatch):
    import voltllm.model.norm_fold as nf

    model, _ = _model()
    assert "fp16" in ineligible(model)  # fp32 model: the epilogues round the residual for fp16 / bf16 GEMMs
    model.dtype = torch.bfloat16
    assert ineligible(model).startswith("weights not on a TMA GPU")
    monkeypatch.setattr(nf, "FOLD_BF16", False)
    assert ineligible(model) == "torch.bfloat16 (fp16 models only)"
    model.dtype = torch.float16
    assert ineligible(model).startswith("weights not on a TMA GPU")
