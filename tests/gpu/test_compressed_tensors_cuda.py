"""compressed-tensors int4 / int8 / FP8 weights kept quantized on the GPU (not run yet: no GPU was lent when this was
written): the dequant kernel and the dequant-GEMM on layers packed by the compressed-tensors library at real shapes,
against the library's own decompression (outputs poisoned first); tiny llama / qwen3 / qwen3_moe checkpoints the
library compressed, kept quantized against the same checkpoint dequantized at load (fp32: the same tokens and
logprobs), and the --compat sm70 route in fp16."""
from __future__ import annotations

import random

import pytest
import torch
from ct_checkpoints import compress_layer, decompress_layer, quantize_files, quantize_model, read_layer, scheme
from quant_checkpoints import assert_kept_matches_dequantized
from tiny_models import make_model

from voltllm.kernels.quant_gemv import dequantize, quant_matmul

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _packed(name: str, w: torch.Tensor):
    """The layer as the library compresses it, read back by voltllm's loader (kept quantized), and the library's
    decompression of it."""
    stored = compress_layer(w, scheme(name))
    return read_layer(name, stored), decompress_layer(stored, scheme(name))


@pytest.mark.parametrize("name,kind", [("w4a16-asym-g32", "INT4_G32_ZP"), ("w4a16-g128", "INT4_G128"),
                                       ("w8a16-g64", "Q8_0"), ("int8-w8a8", "Q8_0"), ("fp8-dynamic", "FP8_E4M3"),
                                       ("w8a16-asym-g32", "INT8_G32_ZP"), ("int8-w8a8-asym", "INT8_G64_ZP")])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288)])
def test_kernels_match_the_library(name, kind, n, k):
    seed = random.SystemRandom().randrange(1 << 30)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    packed, ref = _packed(name, w)
    p = packed.to_weight(torch.device("cuda"), torch.float16)
    assert p.kind.name == kind
    ref_w = ref.float().cuda()
    got = dequantize(p, torch.float32, out=torch.full((n, k), float("nan"), device="cuda"))
    assert torch.equal(got, ref_w), f"seed {seed}"
    for dtype in (torch.float16, torch.bfloat16) if (n, k) == (4096, 4096) else (torch.float16,):
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        for m in (1, 3, 4, 7, 16, 64):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            quant_matmul(x, p, out=out)
            err = _rel(out, x.float() @ ref_w.T)
            assert err < tol and not out.isnan().any(), f"{name} {n}x{k} m={m} {dtype}: {err:.2e} seed {seed}"


@pytest.fixture(scope="module", params=[("qwen3", "w4a16-asym-g32"), ("llama", "w4a16-g128"), ("qwen3", "w8a16-g64"),
                                        ("qwen3", "fp8-dynamic"), ("llama", "fp8-block"), ("qwen3", "int8-w8a8"),
                                        ("llama", "int8-w8a8-asym")],
                ids=lambda p: "-".join(p))
def tiny_ct(request, tmp_path_factory):
    arch, name = request.param
    path = make_model(str(tmp_path_factory.mktemp(f"{arch}-{name}")), arch, hidden_size=128, intermediate_size=256,
                      head_dim=32, std=0.08)
    quantize_model(path, name)
    return path


def test_tiny_model_kept_quantized_matches_dequantized(monkeypatch, tiny_ct):
    """Prompt steps (dequantize + cuBLAS), 1-4-row decode (the dequant-GEMM) and 6-row decode batches, with CUDA
    graphs, give the logits of the dequantized model."""
    from voltllm.model.layers.gguf_planes import Planes

    def check(llm, keep):
        assert llm.engine.runner.keep_quantized == keep
        segments = getattr(llm.engine.runner.model.layers[0].self_attn.qkv_proj, "gguf_segments", [])
        assert (len(segments) == 1 and isinstance(segments[0].weight, Planes)) == keep

    assert_kept_matches_dequantized(monkeypatch, tiny_ct, check)


def test_tiny_model_compat_route(tiny_ct):
    from voltllm import LLM, SamplingParams

    llm = LLM(tiny_ct, device="cuda", dtype="float16", compat="sm70", quantization="compressed-tensors",
              max_model_len=512, gpu_memory_utilization=0.2)
    assert llm.engine.runner.keep_quantized
    out = llm.generate(["Hello world"] * 3, SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    llm.engine.check_integrity()


@pytest.mark.parametrize("name", ["w4a16-g128", "fp8-dynamic", "w8a16-asym-g32"])
def test_moe_experts_kept_quantized(monkeypatch, tmp_path, name):
    """qwen3_moe whose experts the library compressed (model-free, the router ignored), kept quantized as MoE planes
    (per-pair dequant-GEMM launches in decode, CUDA graphs included) against the checkpoint dequantized at load."""
    path = make_model(str(tmp_path / "moe"), "qwen3_moe", hidden_size=128, intermediate_size=256, head_dim=32,
                      moe_intermediate_size=128, std=0.08)
    quantize_files(path, name, ignore=("lm_head", "re:.*mlp.gate$"))

    def check(llm, keep):
        assert (llm.engine.runner.model.layers[0].mlp.qexperts is not None) == keep

    assert_kept_matches_dequantized(monkeypatch, path, check)
