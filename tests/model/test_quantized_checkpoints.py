"""Quantized checkpoints end to end on the CPU: a tiny qwen3 quantized and packed as AutoAWQ / GPTQ (4- and 8-bit)
write it, or
as an FP8 checkpoint (block-wise or per-channel scales; tests/quant_checkpoints.py), runs in the engine with the
logits of transformers holding the same dequantized weights; the kept-quantized layers (int4 / int8 / FP8 planes)
multiply like the dequantized ones; `--quantization fp8` quantizes an unquantized checkpoint at load."""
import pytest
import torch
from quant_checkpoints import (LINEARS, assert_multiplies_alike, kept_and_dense, kept_linears, quantize_checkpoint,
                              quantize_fp8)
from tiny_models import assert_prompt_logprobs_match, make_model

from voltllm import LLM

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]
VARIANTS = {"awq": dict(method="awq"), "gptq-sym": dict(method="gptq", symmetric=True),
            "gptq-act-order": dict(method="gptq", act_order=True), "fp8-block": dict(method="fp8"),
            "fp8-channel": dict(method="fp8", block=None),
            # 8-bit GPTQ (Qwen's *-GPTQ-Int8): asymmetric, symmetric (groups of 64), act-order
            "gptq8": dict(method="gptq", bits=8), "gptq8-sym": dict(method="gptq", bits=8, symmetric=True, group=64),
            "gptq8-act-order": dict(method="gptq", bits=8, act_order=True)}
KINDS = {"awq": "INT4_G32_ZP", "gptq-sym": "INT4_G32", "fp8-block": "FP8_E4M3", "fp8-channel": "FP8_E4M3",
         "gptq8": "INT8_G32_ZP", "gptq8-sym": "INT8_G64"}
# --quantization per variant (vLLM's names: gptq_marlin reads the same GPTQ checkpoints, 4- and 8-bit)
FLAGS = {"gptq8-sym": "gptq_marlin", "gptq8": "gptq"}


@pytest.fixture(scope="module", params=list(VARIANTS))
def quantized(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    # inputs of 128 and 256 features: whole 64-element groups, as the planes need
    path = make_model(str(tmp_path_factory.mktemp(request.param)), "qwen3", hidden_size=128, intermediate_size=256,
                      head_dim=32, std=0.08)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    deq = quantize_checkpoint(path, **VARIANTS[request.param])
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name, w in deq.items():
            params[name].copy_(w)
    return request.param, path, ref


def test_logits_match_transformers_on_dequantized_weights(quantized):
    variant, path, ref = quantized
    llm = LLM(path, block_size=4, max_num_seqs=4, quantization=FLAGS.get(variant))
    assert llm.engine.config.model.quantization == VARIANTS[variant]["method"]
    assert_prompt_logprobs_match(llm, ref, PROMPTS)


def test_kept_quantized_layers_multiply_like_dequantized(quantized):
    from voltllm.model.layers.gguf_planes import Planes

    variant, path, _ = quantized
    pairs = kept_linears(path)
    for name, mod, dense in pairs:
        segs = mod.gguf_segments
        planes = [s.weight for s in segs if isinstance(s.weight, Planes)]
        if variant.endswith("act-order"):
            assert not planes  # act-order groups: dequantized at load
        else:
            assert len(segs) == 1 and planes and planes[0].kind.name == KINDS[variant]
        assert_multiplies_alike(mod, dense)
    assert len(pairs) == 3 * 4  # qkv, o, gate_up, down per layer


def test_fp8_quantized_at_load(tmp_path):
    """--quantization fp8 on an unquantized checkpoint: the projections get E4M3 codes with one scale per row and
    128 inputs (amax / 448); the engine's logits are those of transformers holding such weights."""
    from transformers import AutoModelForCausalLM

    path = make_model(str(tmp_path / "fp8-at-load"), "qwen3", hidden_size=128, intermediate_size=256, head_dim=32,
                      std=0.08)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.rpartition(".")[0].rpartition(".")[2] in LINEARS:
                p.copy_(quantize_fp8(p.float(), (1, 128))[2])
    llm = LLM(path, quantization="fp8", block_size=4)
    assert llm.engine.config.model.quantization == "fp8"
    assert_prompt_logprobs_match(llm, ref, PROMPTS)


@pytest.mark.parametrize("method,moe_inter", [("awq", 64), ("gptq8", 64), ("fp8", 128), ("fp8", 64)])
def test_moe_checkpoint(tmp_path, method, moe_inter):
    """qwen3_moe with quantized attention and expert projections. Dequantized at load (the CPU engine): logits
    equal transformers holding the dequantized weights (loaded from a copy of the checkpoint with those weights, so
    its stacked experts are built by transformers itself). Kept quantized: the experts as planes, or dense where
    the planes cannot hold them (FP8 experts of 64 inputs: not whole 128-input scales)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = make_model(str(tmp_path / "moe"), "qwen3_moe", hidden_size=128, intermediate_size=256, head_dim=32,
                      moe_intermediate_size=moe_inter, std=0.08)
    ref_path = str(tmp_path / "ref")
    shutil.copytree(path, ref_path)
    deq = quantize_checkpoint(path, "gptq", bits=8) if method == "gptq8" else quantize_checkpoint(path, method)
    assert any(".experts." in name for name in deq)
    tensors = load_file(f"{ref_path}/model.safetensors")
    tensors.update(deq)
    save_file(tensors, f"{ref_path}/model.safetensors", metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    assert_prompt_logprobs_match(LLM(path, block_size=4), ref, PROMPTS)
    # kept quantized (as on a GPU): the attention projections and the experts hold planes (quant_moe.QuantExperts,
    # no dense expert weights); the MoE blocks give the dequantized model's outputs
    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.quantized_linear import describe_quantized

    kept, dense = kept_and_dense(path)
    assert isinstance(kept.layers[0].self_attn.qkv_proj.gguf_segments[0].weight, Planes)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    planes = not (method == "fp8" and moe_inter % 128)
    for i in (0, 2):  # layer 1 is dense (mlp_only_layers)
        moe = kept.layers[i].mlp
        assert (moe.qexperts is not None and moe.qexperts.ready and moe.w13 is None) if planes else \
            (moe.qexperts is None and moe.w13 is not None)
        torch.testing.assert_close(moe(x), dense.layers[i].mlp(x), rtol=1e-5, atol=1e-5)
    assert ("MoE experts" in describe_quantized(kept)) == planes
