"""compressed-tensors int4 / int8 / FP8 checkpoints end to end on the CPU: tiny llama / qwen3 / qwen3_moe models
quantized and compressed by the compressed-tensors library itself (tests/ct_checkpoints.py: its model API for the
dense architectures, its model-free compressors for qwen3_moe's per-expert tensors), one projection left dense through
the ignore list. voltllm's dequantized weights equal the library's own decompression; the engine's full-vocabulary
prompt logprobs and greedy tokens equal transformers' holding those weights; kept quantized, every projection holds
the planes its format maps to and multiplies like the dequantized model, and qwen3_moe's experts are MoE planes."""
import shutil

import pytest
import torch

from ct_checkpoints import decompressed_weights, quantize_files, quantize_model, reference_model
from quant_checkpoints import assert_multiplies_alike, kept_and_dense, kept_linears
from tiny_models import assert_prompt_logprobs_match, make_model

from voltllm import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]
DENSE = "model.layers.1.self_attn.o_proj"  # named in the ignore list: stored and kept dense
# (architecture, scheme in ct_checkpoints.SCHEMES, the plane kind its projections are kept as)
VARIANTS = {"qwen3-w4a16-asym-g32": ("qwen3", "w4a16-asym-g32", "INT4_G32_ZP"),
            "llama-w4a16-channel": ("llama", "w4a16-channel", None),  # INT4_G<inputs>: one group per row
            "qwen3-w8a16-g64": ("qwen3", "w8a16-g64", "Q8_0"),
            "qwen3-fp8-dynamic": ("qwen3", "fp8-dynamic", "FP8_E4M3"),
            "llama-fp8-block": ("llama", "fp8-block", "FP8_E4M3"),
            "qwen3-int8-w8a8": ("qwen3", "int8-w8a8", "Q8_0"),
            # int8 with zero points: the int8 planes' zero plane, per the checkpoint's groups (pack-quantized) or
            # one scale per row repeated per 64 inputs (int-quantized, channel)
            "qwen3-w8a16-asym-g32": ("qwen3", "w8a16-asym-g32", "INT8_G32_ZP"),
            "llama-int8-w8a8-asym": ("llama", "int8-w8a8-asym", "INT8_G64_ZP")}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    arch, name, kind = VARIANTS[request.param]
    # inputs of 128 and 256 features: whole 64-input groups (128 for FP8), as the planes need
    path = make_model(str(tmp_path_factory.mktemp(request.param)), arch, hidden_size=128, intermediate_size=256,
                      head_dim=32, std=0.08)
    ref_dir = str(tmp_path_factory.mktemp(request.param + "-ref"))
    shutil.copytree(path, ref_dir, dirs_exist_ok=True)
    quantize_model(path, name, ignore=("lm_head", DENSE))
    return path, kind, reference_model(ref_dir, path)


def _greedy(ref, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(ref(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_dequantized_weights_equal_the_library_decompression(checkpoint):
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model

    path, _, _ = checkpoint
    src = resolve_model(path)
    ours = dict(iter_weights(src, load_hf_config(src)))
    ref = decompressed_weights(path)
    assert sorted(ours) == sorted(ref) and f"{DENSE}.weight" in ours
    for name, w in ref.items():
        assert torch.equal(ours[name], w), name


def test_prompt_logprobs_and_greedy_tokens_match_transformers(checkpoint):
    path, _, ref = checkpoint
    llm = LLM(path, block_size=4, max_num_seqs=4)
    assert llm.engine.config.model.quantization == "compressed-tensors"
    assert_prompt_logprobs_match(llm, ref, PROMPTS)
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == _greedy(ref, tok.encode(prompt), 8), prompt


def test_kept_quantized_layers_multiply_like_dequantized(checkpoint):
    from voltllm.model.layers.gguf_planes import Planes

    path, kind, _ = checkpoint
    pairs = kept_linears(path)
    for name, mod, dense in pairs:
        w = mod.gguf_segments[0].weight
        if f"model.{name}" == DENSE:
            assert isinstance(w, torch.Tensor)
        else:
            assert isinstance(w, Planes) and w.kind.name == (kind or f"INT4_G{mod.in_features}"), name
        assert_multiplies_alike(mod, dense)
    assert len(pairs) == 3 * 4  # qkv, o, gate_up, down per layer


def test_moe_checkpoint(tmp_path):
    """qwen3_moe W4A16 (the library's model-free compressors on the per-expert tensors; the router ignored):
    dequantized at load, the engine's prompt logprobs equal transformers'; kept quantized, the experts are int4 MoE
    planes giving the dequantized layer's outputs."""
    from safetensors import safe_open

    from voltllm.model.layers.gguf_planes import Planes

    path = make_model(str(tmp_path / "moe"), "qwen3_moe", hidden_size=128, intermediate_size=256, head_dim=32,
                      moe_intermediate_size=128, std=0.08)
    ref_dir = str(tmp_path / "ref")
    shutil.copytree(path, ref_dir)
    quantize_files(path, "w4a16-g128", ignore=("lm_head", "re:.*mlp.gate$"))
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight_packed" in names and "model.layers.0.mlp.gate.weight" in names
    ref = reference_model(ref_dir, path)
    assert_prompt_logprobs_match(LLM(path, block_size=4), ref, PROMPTS)
    kept, dense = kept_and_dense(path)
    assert isinstance(kept.layers[0].self_attn.qkv_proj.gguf_segments[0].weight, Planes)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    for i in (0, 2):  # layer 1 is dense (mlp_only_layers)
        moe = kept.layers[i].mlp
        assert moe.qexperts is not None and moe.qexperts.ready and moe.w13 is None
        assert moe.qexperts.w13.kind.name == "INT4_G128" and moe.qexperts.w2.kind.name == "INT4_G128"
        torch.testing.assert_close(moe(x), dense.layers[i].mlp(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,name", [("qwen3_5", "w4a16-asym-g32"), ("qwen3_next", "fp8-dynamic"),
                                       ("qwen3_5_moe", "w8a16-g64"), ("qwen3_5_moe", "w8a16-asym-g32")])
def test_hybrid_checkpoints(tmp_path, kind, name):
    """Tiny hybrids the library compressed (model-free; the routers, the shared expert's gate and the GDN b / a
    projections ignored, as quantizers leave them): the dequantized weights equal the library's decompression, and
    kept quantized every projection (in_proj: planes and dense b / a rows) and MoE block multiplies like the
    dequantized model."""
    from quant_checkpoints import HYBRID_QUANT_MOE, HYBRID_QUANT_SHAPE
    from tiny_models import make_tiny_hybrid

    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.linear import Linear
    from voltllm.model.layers.moe import SparseMoE
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model

    path = str(tmp_path / kind)
    extra = HYBRID_QUANT_MOE if kind != "qwen3_5" else {}
    if make_tiny_hybrid(path, kind, 0, 1, **{**HYBRID_QUANT_SHAPE, **extra}) is None:
        pytest.skip(f"this transformers has no {kind}")
    quantize_files(path, name, ignore=("lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$",
                                       "re:.*in_proj_(a|b|ba)$"))
    src = resolve_model(path)
    ours, ref = dict(iter_weights(src, load_hf_config(src))), decompressed_weights(path)
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[n], ref[n]) for n in ref)
    kept, dense = kept_and_dense(path)
    dense_mods = dict(dense.named_modules())
    gen = torch.Generator().manual_seed(0)
    moes = 0
    for n, mod in kept.named_modules():
        if isinstance(mod, SparseMoE):
            assert mod.qexperts is not None and mod.qexperts.ready, n
            moes += 1
        elif not isinstance(mod, Linear) or n.endswith(("lm_head", "mlp.gate", "shared_expert_gate")):
            continue
        else:
            planes = [isinstance(s.weight, Planes) for s in mod.gguf_segments]
            assert planes == ([True, False] if n.endswith("linear_attn.in_proj") else [True]), n
        x = torch.randn(3, mod.in_features if isinstance(mod, Linear) else 128, generator=gen)
        torch.testing.assert_close(mod(x), dense_mods[n](x), rtol=1e-5, atol=1e-5)
    assert moes == (0 if kind == "qwen3_5" else len(kept.layers))
