"""Hybrid GGUF files (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; Q8_0, written as llama.cpp's converter writes them:
tests/gguf_files.write_hybrid_gguf) kept quantized on the GPU against the same file dequantized at load, fp32, through
the engine with the hybrid Triton paths and CUDA graphs: the Gated DeltaNet projections (value heads untiled as whole
quantized rows, out_proj's columns as whole blocks) and the routed experts held as planes; the same greedy tokens and
logprobs (tests/quant_checkpoints.assert_kept_matches_dequantized)."""
from __future__ import annotations

import pytest
from gguf_files import exact_hybrid_checkpoint, write_hybrid_gguf
from quant_checkpoints import assert_kept_matches_dequantized

pytestmark = pytest.mark.gpu

# hidden 128, 8 value heads of 32 (4 per key head): every projection's input a multiple of 64 (the planes' groups),
# out_proj's heads whole Q8_0 blocks; experts of 128
SHAPE = dict(hidden_size=128, linear_num_value_heads=8, linear_value_head_dim=32, intermediate_size=256)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)
CASES = {"qwen3_5": SHAPE, "qwen3_5_moe": dict(SHAPE, **MOE), "qwen3_next": dict(SHAPE, **MOE)}


@pytest.fixture(scope="module", params=list(CASES))
def gguf_file(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    hf = exact_hybrid_checkpoint(str(root / "hf"), kind, **CASES[kind])
    if hf is None:
        pytest.skip(f"this transformers has no {kind}")
    path = str(root / "tiny-Q8_0.gguf")
    write_hybrid_gguf(path, hf, "Q8_0")
    return kind, path


def test_kept_matches_dequantized(monkeypatch, gguf_file, tmp_path):
    from voltllm.model.layers.gguf_planes import Planes

    kind, path = gguf_file
    monkeypatch.setenv("VOLTLLM_CACHE_DIR", str(tmp_path))  # (the converted GGUF tokenizer's cache)

    def check(llm, keep):
        runner = llm.engine.runner
        assert runner.keep_quantized == keep and runner.is_hybrid
        gdn = runner.model.layers[0].linear_attn
        for proj in (gdn.in_proj, gdn.out_proj):
            assert isinstance(proj.gguf_segments[0].weight, Planes) if keep else proj.weight is not None
        if kind != "qwen3_5":
            assert (runner.model.layers[0].mlp.qexperts is not None) == keep

    assert_kept_matches_dequantized(monkeypatch, path, check)
