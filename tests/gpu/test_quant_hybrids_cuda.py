"""Quantized hybrid checkpoints (Qwen3-Next / Qwen3.5 / Qwen3.5-MoE) kept quantized on the GPU: tiny AWQ / FP8 / NVFP4
checkpoints (tests/quant_checkpoints.quantized_hybrid: attention, Gated DeltaNet, dense-MLP, routed and shared expert
projections quantized) against the same checkpoint dequantized at load, fp32, through the engine with every hybrid
Triton path on (GDN decode / chunk / conv kernels, the MoE router launch; the kept layers on QuantizedLinearMethod's
routes by row count; the experts on quant_moe's per-pair / grouped launches) and CUDA graphs: the same greedy tokens
and logprobs; fp16 under --compat sm70 runs and keeps its bookkeeping."""
from __future__ import annotations

import pytest
from quant_checkpoints import HYBRID_QUANT_MOE, assert_kept_matches_dequantized, quantized_hybrid

pytestmark = pytest.mark.gpu

# each engine start captures graphs and tunes tiles: three checkpoints keep the file within one 10-minute call
CASES = {
    # GDN b / a left unquantized, as quantizers commonly do: in_proj writes a plane segment and dense rows side by side
    "qwen3_next-awq-dense-ba": ("qwen3_next", dict(HYBRID_QUANT_MOE, mlp_only_layers=[1]), dict(
        method="awq", dense=tuple(f"layers.{i}.linear_attn.in_proj_ba" for i in range(3)))),
    "qwen3_5-fp8": ("qwen3_5", {}, dict(method="fp8")),
    "qwen3_5_moe-nvfp4": ("qwen3_5_moe", HYBRID_QUANT_MOE, dict(method="modelopt_fp4")),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    kind, extra, quant = CASES[request.param]
    path = quantized_hybrid(str(tmp_path_factory.mktemp(request.param)), kind, quant, tokenizer=True, **extra)
    if path is None:
        pytest.skip(f"this transformers has no {kind}")
    return request.param, path


def test_kept_matches_dequantized(monkeypatch, checkpoint):
    from voltllm.model.layers.gguf_planes import Planes

    name, path = checkpoint

    def check(llm, keep):
        runner = llm.engine.runner
        assert runner.keep_quantized == keep and runner.is_hybrid
        gdn = runner.model.layers[0].linear_attn
        assert isinstance(gdn.in_proj.gguf_segments[0].weight, Planes) if keep else gdn.in_proj.weight is not None
        if keep:
            assert len(gdn.in_proj.gguf_segments) == (2 if name.endswith("dense-ba") else 1)
        if "num_experts" in CASES[name][1]:
            assert (runner.model.layers[0].mlp.qexperts is not None) == keep

    assert_kept_matches_dequantized(monkeypatch, path, check)


def test_compat_route(checkpoint):
    from voltllm import LLM, SamplingParams

    name, path = checkpoint
    if not name.startswith("qwen3_next"):
        pytest.skip("one checkpoint under --compat sm70 (MoE, shared expert, mixed in_proj)")
    flag = CASES[name][2]["method"]
    llm = LLM(path, device="cuda", dtype="float16", compat="sm70", quantization=flag, max_model_len=512,
              gpu_memory_utilization=0.2)
    assert llm.engine.runner.keep_quantized
    out = llm.generate(["Hello world"] * 3 + ["The quick brown fox " * 8],
                       SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    llm.engine.check_integrity()
