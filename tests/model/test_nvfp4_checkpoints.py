"""NVFP4 checkpoints end to end on the CPU: tiny qwen3 / llama models quantized and packed the way NVIDIA ModelOpt
(config.json or hf_quant_config.json) and compressed-tensors write them (tests/quant_checkpoints.py), one projection
left dense as the quantizers' ignore lists do. Dequantized at load, the engine's full-vocabulary prompt logprobs equal
transformers' holding the same dequantized weights; kept quantized, every quantized projection holds NVFP4 planes (a
merged qkv of three different global scales in one segment) and multiplies like the dequantized model; a qwen3_moe
keeps its NVFP4 experts as MoE planes."""
import shutil

import pytest
import torch
from quant_checkpoints import assert_multiplies_alike, kept_and_dense, kept_linears, quantize_checkpoint
from tiny_models import assert_prompt_logprobs_match, make_model

from voltllm import LLM

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]
DENSE = "layers.1.self_attn.o_proj"  # left unquantized, listed as ignored
VARIANTS = {"qwen3-modelopt": ("qwen3", "modelopt_fp4", False), "qwen3-ct": ("qwen3", "compressed-tensors", False),
            "llama-modelopt-file": ("llama", "modelopt_fp4", True), "llama-ct": ("llama", "compressed-tensors", False)}


def _reference(path: str, deq: dict):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name, w in deq.items():
            params[name].copy_(w)
    return ref


@pytest.fixture(scope="module", params=list(VARIANTS))
def quantized(request, tmp_path_factory):
    arch, method, quant_file = VARIANTS[request.param]
    # inputs of 128 and 256 features: whole 64-element groups, as the planes need
    path = make_model(str(tmp_path_factory.mktemp(request.param)), arch, hidden_size=128, intermediate_size=256,
                      head_dim=32, std=0.08)
    ref_path = str(tmp_path_factory.mktemp(request.param + "-ref"))
    shutil.copytree(path, ref_path, dirs_exist_ok=True)
    deq = quantize_checkpoint(path, method, dense=(DENSE,), quant_file=quant_file)
    assert f"model.{DENSE}.weight" not in deq
    return method, path, _reference(ref_path, deq)


def test_prompt_logprobs_match_transformers_on_dequantized_weights(quantized):
    method, path, ref = quantized
    llm = LLM(path, block_size=4, max_num_seqs=4)
    assert llm.engine.config.model.quantization == method
    assert_prompt_logprobs_match(llm, ref, PROMPTS)


def test_kept_quantized_layers_multiply_like_dequantized(quantized):
    from voltllm.model.layers.gguf_planes import Planes

    _, path, _ = quantized
    pairs = kept_linears(path)
    for name, mod, dense in pairs:
        segs = mod.gguf_segments
        assert len(segs) == 1
        w = segs[0].weight
        if name == DENSE:
            assert isinstance(w, torch.Tensor)
        else:
            assert isinstance(w, Planes) and w.kind.name == "NVFP4"
            if name.endswith("qkv_proj"):  # q, k and v quantized with their own global scales
                assert len(set(w.d[:, 0].tolist())) == 3
        assert_multiplies_alike(mod, dense)
    assert len(pairs) == 3 * 4  # qkv, o, gate_up, down per layer


@pytest.mark.parametrize("method", ["modelopt_fp4", "compressed-tensors"])
def test_moe_checkpoint(tmp_path, method):
    """qwen3_moe with NVFP4 attention and expert projections (the router left dense): dequantized at load, the
    engine's logprobs equal transformers' (loaded from a copy holding the dequantized weights); kept quantized, the
    experts are NVFP4 MoE planes whose blocks give the dequantized model's outputs."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from voltllm.model.layers.gguf_planes import NVFP4_KIND, Planes

    path = make_model(str(tmp_path / "moe"), "qwen3_moe", hidden_size=128, intermediate_size=256, head_dim=32,
                      moe_intermediate_size=64, std=0.08)
    ref_path = str(tmp_path / "ref")
    shutil.copytree(path, ref_path)
    deq = quantize_checkpoint(path, method)
    assert any(".experts." in name for name in deq)
    tensors = load_file(f"{ref_path}/model.safetensors")
    tensors.update(deq)
    save_file(tensors, f"{ref_path}/model.safetensors", metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    assert_prompt_logprobs_match(LLM(path, block_size=4), ref, PROMPTS)
    kept, dense = kept_and_dense(path)
    assert isinstance(kept.layers[0].self_attn.qkv_proj.gguf_segments[0].weight, Planes)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    for i in (0, 2):  # layer 1 is dense (mlp_only_layers)
        moe = kept.layers[i].mlp
        assert moe.qexperts is not None and moe.qexperts.ready and moe.w13 is None
        assert moe.qexperts.w13.kind == NVFP4_KIND and moe.qexperts.w2.kind == NVFP4_KIND
        torch.testing.assert_close(moe(x), dense.layers[i].mlp(x), rtol=1e-5, atol=1e-5)
