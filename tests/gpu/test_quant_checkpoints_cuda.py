"""AWQ / GPTQ (4-bit), GPTQ 8-bit and FP8 weights kept quantized on the GPU: the dequant-GEMM and the dequant kernel
with the int4 kinds (zero points; GPTQ's fixed zero 8), the int8 kinds (zero points; the fixed zero 128) and the FP8
kind (software E4M3 decode) against the checkpoint's own
dequantization at real shapes, fp16 and bf16, outputs poisoned first; and tiny AWQ / GPTQ / FP8 models kept quantized
against the same checkpoint dequantized at load (fp32: the same logits; fp16 under --compat sm70: it runs and keeps
its bookkeeping), and --quantization fp8 at load."""
from __future__ import annotations

import random

import pytest
import torch
from quant_checkpoints import assert_kept_matches_dequantized, pack_awq, pack_gptq, quantize_checkpoint, quantize_fp8, quantize_rtn
from tiny_models import make_model

from voltllm.kernels.quant_gemv import dequantize, quant_matmul
from voltllm.model.loader.fp8_checkpoint import FP8Weight
from voltllm.model.loader.int4_checkpoint import Int4Scheme, Int4Weight

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("method,group,symmetric", [("awq", 128, False), ("gptq", 128, True), ("awq", 32, False),
                                                    ("gptq8", 128, True), ("gptq8", 128, False), ("fp8", 128, True)])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288)])
def test_kernels_match_reference(method, group, symmetric, n, k):
    seed = random.SystemRandom().randrange(1 << 30)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    if method == "fp8":
        codes, scales, deq = quantize_fp8(w, (128, 128))
        packed = FP8Weight.from_checkpoint(codes, scales, (128, 128))
    else:
        codes, scales, zeros, deq = quantize_rtn(w, group, symmetric, bits=8 if method == "gptq8" else 4)
    if method == "awq":
        packed = Int4Weight(Int4Scheme("awq", group, False, 0), **pack_awq(codes, zeros, scales), g_idx=None)
    elif method == "gptq":
        packed = Int4Weight(Int4Scheme("gptq", group, False, 1), **pack_gptq(codes, zeros, scales, torch.arange(k) // group))
    elif method == "gptq8":
        packed = Int4Weight(Int4Scheme("gptq", group, False, 1, bits=8),
                            **pack_gptq(codes, zeros, scales, torch.arange(k) // group, bits=8))
    p = packed.to_weight(torch.device("cuda"), torch.float16)
    assert p.kind.zero_points == (method != "fp8" and not symmetric) and p.kind.fp8 == (method == "fp8")
    assert p.kind.name.startswith("INT8_") == (method == "gptq8")
    ref_w = deq.cuda()
    got = dequantize(p, torch.float32, out=torch.full((n, k), float("nan"), device="cuda"))
    assert torch.equal(got, ref_w), f"seed {seed}"
    for dtype in (torch.float16, torch.bfloat16) if (n, k) == (4096, 4096) else (torch.float16,):
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        for m in (1, 3, 4, 7, 16):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            quant_matmul(x, p, out=out)
            err = _rel(out, x.float() @ ref_w.T)
            assert err < tol and not out.isnan().any(), f"{method} g{group} {n}x{k} m={m} {dtype}: {err:.2e} seed {seed}"


@pytest.fixture(scope="module", params=["awq", "gptq", "gptq8", "fp8"])
def tiny_quantized(request, tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp(request.param)), "qwen3", hidden_size=128, intermediate_size=256,
                      head_dim=32, std=0.08)
    if request.param == "gptq8":  # asymmetric 8-bit (the int8 zero plane)
        quantize_checkpoint(path, "gptq", bits=8)
    else:
        quantize_checkpoint(path, request.param, symmetric=request.param == "gptq")
    return path


def test_tiny_model_kept_quantized_matches_dequantized(monkeypatch, tiny_quantized):
    """Prompt steps (dequantize + cuBLAS), 1-4-row decode (the dequant-GEMM) and 6-row decode batches, with CUDA
    graphs, give the logits of the dequantized model."""
    def check(llm, keep):
        assert llm.engine.runner.keep_quantized == keep

    assert_kept_matches_dequantized(monkeypatch, tiny_quantized, check)


def test_tiny_model_compat_route(tiny_quantized):
    from voltllm import LLM, SamplingParams

    method = "awq_marlin" if "awq" in tiny_quantized else "fp8" if "fp8" in tiny_quantized else "gptq"
    llm = LLM(tiny_quantized, device="cuda", dtype="float16", compat="sm70", quantization=method, max_model_len=512,
              gpu_memory_utilization=0.2)
    assert llm.engine.runner.keep_quantized
    out = llm.generate(["Hello world"] * 3, SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    llm.engine.check_integrity()


def test_fp8_at_load_kept_quantized(monkeypatch, tmp_path):
    """--quantization fp8 on an unquantized checkpoint: the projections are quantized on the GPU and kept quantized;
    fp32 logits equal those of the same quantization dequantized at load (KEEP_QUANTIZED=0: quantized and
    dequantized on the host), and stay near the unquantized model's (s80 measured 0.136 on a first-token logprob
    of this tiny random model in fp16: E4M3 keeps 3 mantissa bits)."""
    import voltllm.config
    from voltllm import LLM, SamplingParams

    path = make_model(str(tmp_path / "fp16"), "qwen3", hidden_size=128, intermediate_size=256, head_dim=32, std=0.08)
    kw = dict(device="cuda", dtype="float32", max_model_len=512, gpu_memory_utilization=0.2)
    sp = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=5)
    prompts = ["Hello world", "The quick brown fox"]
    runs = {}
    for name, keep, quant in (("kept", 1, "fp8"), ("host", 0, "fp8"), ("fp32", -1, None)):
        monkeypatch.setattr(voltllm.config, "KEEP_QUANTIZED", keep)
        llm = LLM(path, quantization=quant, **kw)
        assert llm.engine.runner.keep_quantized == (name == "kept")
        runs[name] = llm.generate(prompts, sp)
        llm.engine.check_integrity()
        del llm
    for a, b, c in zip(runs["kept"], runs["host"], runs["fp32"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            tok = next(iter(lb))
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-3
        tok = c.outputs[0].token_ids[0]
        assert tok in a.outputs[0].logprobs[0]
        assert abs(a.outputs[0].logprobs[0][tok].logprob - c.outputs[0].logprobs[0][tok].logprob) < 0.5


@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_moe_experts_kept_quantized(monkeypatch, tmp_path, method):
    """qwen3_moe with its experts kept quantized (quant_moe: per-pair dequant-GEMM launches in decode, CUDA graphs
    included; per-expert dequantize + cuBLAS for prompts) against the same checkpoint dequantized at load."""
    path = make_model(str(tmp_path / "moe"), "qwen3_moe", hidden_size=128, intermediate_size=256, head_dim=32,
                      moe_intermediate_size=128, std=0.08)
    quantize_checkpoint(path, method)

    def check(llm, keep):
        assert (llm.engine.runner.model.layers[0].mlp.qexperts is not None) == keep

    assert_kept_matches_dequantized(monkeypatch, path, check)
