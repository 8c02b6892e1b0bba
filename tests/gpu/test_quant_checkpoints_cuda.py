"""AWQ / GPTQ (4-bit), GPTQ 8-bit, FP8 and bitsandbytes 4-bit / 8-bit weights kept quantized on the GPU: the
dequant-GEMM and the dequant kernel with the int4 kinds (zero points; GPTQ's fixed zero 8), the int8 kinds (zero
points; the fixed zero 128, also bitsandbytes' 8-bit rows), the FP8 kind (software E4M3 decode) and bitsandbytes' NF4 /
FP4 kinds (table lookup, fp16 absmax) against the checkpoint's own dequantization at real shapes, fp16 and bf16,
outputs poisoned first; and tiny AWQ / GPTQ / FP8 / bitsandbytes models kept quantized against the same checkpoint
dequantized at load (fp32: the same logits; fp16 under --compat sm70: it runs and keeps its bookkeeping), and
--quantization fp8 / bitsandbytes at load."""
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


@pytest.mark.parametrize("quant_type,blocksize,double_quant,wdtype", [("nf4", 64, True, torch.float16),
                                                                    ("nf4", 128, False, torch.bfloat16),
                                                                    ("fp4", 64, False, torch.float16),
                                                                    ("fp4", 128, True, torch.bfloat16)])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288)])
def test_bnb_kernels_match_the_codec(quant_type, blocksize, double_quant, wdtype, n, k):
    """bitsandbytes 4-bit layers (bnb_codec) kept quantized: the dequantize kernel equals the planes' reference bit
    for bit and the codec's dequantization up to the absmax's fp16 rounding (none without double quantization: the
    absmax is an fp16 / bf16 weight); the dequant-GEMM (1-16 rows) and the tiled kernel (5-64 rows) multiply like it."""
    from voltllm.kernels.quant_dot import quant_dot
    from voltllm.model.layers.gguf_planes import dequantize_planes, map_planes
    from voltllm.model.loader.bnb_checkpoint import Bnb4bitWeight
    from voltllm.model.loader.bnb_codec import dequantize_4bit, quantize_4bit

    seed = random.SystemRandom().randrange(1 << 30)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02).to(wdtype)
    packed, state = quantize_4bit(w, quant_type, blocksize, double_quant=double_quant)
    p = Bnb4bitWeight(packed, state).to_weight(torch.device("cuda"), torch.float16)
    assert p.kind.bnb == quant_type and p.kind.super == blocksize
    state.dtype = torch.float32  # the codec's product before its rounding to the stored dtype
    ref_w = dequantize_4bit(packed, state).cuda()
    got = dequantize(p, torch.float32, out=torch.full((n, k), float("nan"), device="cuda"))
    host = map_planes(p, lambda t: t.cpu(), n)
    assert torch.equal(got.cpu(), dequantize_planes(host)), f"seed {seed}"
    if double_quant:
        assert float(((got - ref_w).abs() / ref_w.abs())[ref_w != 0].max()) <= 2 ** -11, f"seed {seed}"
    else:
        assert torch.equal(got, ref_w), f"seed {seed}"
    for dtype in (torch.float16, torch.bfloat16) if (n, k) == (4096, 4096) else (torch.float16,):
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        for m in (1, 3, 4, 7, 16, 33, 64):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            (quant_matmul if m <= 16 else quant_dot)(x, p, out=out)
            if 5 <= m <= 16:
                dot = quant_dot(x, p, out=torch.full((m, n), float("nan"), dtype=dtype, device="cuda"))
                assert _rel(dot, x.float() @ got.T) < tol and not dot.isnan().any(), f"dot m={m} seed {seed}"
            err = _rel(out, x.float() @ got.T)
            assert err < tol and not out.isnan().any(), f"{quant_type} b{blocksize} {n}x{k} m={m} {dtype}: {err:.2e} " \
                                                        f"seed {seed}"


@pytest.mark.parametrize("wdtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288)])
def test_bnb_int8_kernels_match_the_codec(wdtype, n, k):
    """bitsandbytes 8-bit rows (bnb_codec.quantize_int8) kept quantized as INT8_G64 planes: the dequantize kernel
    equals the planes' reference bit for bit and bitsandbytes' q * SCB / 127 up to the fp16 rounding of SCB / 127
    (2^-11 relative); the dequant-GEMM (1-16 rows) and the tiled kernel (5-64 rows) multiply like it, and like the
    fp16 / bf16 weight the dequantized load multiplies by (cuBLAS)."""
    from voltllm.kernels.quant_dot import quant_dot
    from voltllm.model.layers.gguf_planes import Planes, dequantize_planes, map_planes
    from voltllm.model.loader.bnb_checkpoint import BNB8_KIND, Bnb8bitWeight
    from voltllm.model.loader.bnb_codec import dequantize_int8, quantize_int8

    seed = random.SystemRandom().randrange(1 << 30)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02).to(wdtype)
    codes, scb = quantize_int8(w)
    p = Bnb8bitWeight(codes, scb).to_weight(torch.device("cuda"), torch.float16)
    assert isinstance(p, Planes) and p.kind == BNB8_KIND and p.nbytes * 8 / (n * k) == 8.25
    ref_w = dequantize_int8(codes, scb).cuda()
    got = dequantize(p, torch.float32, out=torch.full((n, k), float("nan"), device="cuda"))
    host = map_planes(p, lambda t: t.cpu(), n)
    assert torch.equal(got.cpu(), dequantize_planes(host)), f"seed {seed}"
    nz = ref_w != 0
    assert float(((got - ref_w).abs()[nz] / ref_w.abs()[nz]).max()) <= 2 ** -11 * (1 + 2 ** -10), f"seed {seed}"
    for dtype in (torch.float16, torch.bfloat16) if (n, k) == (4096, 4096) else (torch.float16,):
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        dense = ref_w.to(dtype)  # the dequantized load's weight
        for m in (1, 3, 4, 7, 16, 33, 64):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            (quant_matmul if m <= 16 else quant_dot)(x, p, out=out)
            if 5 <= m <= 16:
                dot = quant_dot(x, p, out=torch.full((m, n), float("nan"), dtype=dtype, device="cuda"))
                assert _rel(dot, x.float() @ got.T) < tol and not dot.isnan().any(), f"dot m={m} seed {seed}"
            err = _rel(out, x.float() @ got.T)
            assert err < tol and not out.isnan().any(), f"int8 {n}x{k} m={m} {dtype}: {err:.2e} seed {seed}"
            err = _rel(out, x @ dense.T)
            assert err < tol, f"int8 {n}x{k} m={m} {dtype} against the dequantized load: {err:.2e} seed {seed}"

@pytest.mark.parametrize("variant", ["nf4-double", "fp4", "at-load", "moe-nf4-double", "int8", "moe-int8"])
def test_bnb_tiny_model_kept_quantized(monkeypatch, tmp_path, variant):
    """A bitsandbytes checkpoint (4-bit, 8-bit, or --quantization bitsandbytes at load) kept quantized on the GPU
    (fp32; prompt steps dequantize + cuBLAS, 1-4-row decode the dequant-GEMM, 6-row batches the tiled kernel, CUDA
    graphs; MoE experts per pair / grouped) gives the tokens and logprobs of the dense checkpoint holding the planes'
    values; 8-bit rows also the prompt logprobs of the checkpoint dequantized at load, up to the fp16 rounding of
    SCB / 127; then fp16 under --compat sm70 runs with it."""
    import voltllm.config
    from bnb_checkpoints import planes_reference, quantize_bnb_checkpoint
    from tiny_models import full_prompt_logprobs

    from voltllm import LLM, SamplingParams
    from voltllm.model.layers.gguf_planes import Planes

    kind = "qwen3_moe" if variant.startswith("moe") else "qwen3"
    path = make_model(str(tmp_path / "bnb"), kind, hidden_size=128, intermediate_size=256, head_dim=32,
                      moe_intermediate_size=128, std=0.08)
    flag = "bitsandbytes" if variant == "at-load" else None
    int8 = variant.endswith("int8")
    if flag is None:
        quantize_bnb_checkpoint(path, str(tmp_path / "deq"), bits=8 if int8 else 4, double_quant=variant.endswith(
            "double"), quant_type="fp4" if variant == "fp4" else "nf4")
    planes_reference(path, str(tmp_path / "ref"), flag)
    prompts = [f"The quick brown fox {i} " * (1 + i) for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=1)
    kw = dict(device="cuda", dtype="float32", max_model_len=512, gpu_memory_utilization=0.2)
    outs, prompt_lps = {}, {}
    runs = [("kept", path, 1, flag), ("ref", str(tmp_path / "ref"), -1, None)]
    if int8:  # (the dequantized load: what an 8-bit checkpoint ran as before it was kept quantized)
        runs.append(("deq", path, -1, None))
    for name, model, keep, quant in runs:
        monkeypatch.setattr(voltllm.config, "KEEP_QUANTIZED", keep)
        llm = LLM(model, quantization=quant, **kw)
        assert llm.engine.runner.keep_quantized == (name == "kept")
        if name == "kept" and int8:
            o_proj = llm.engine.runner.model.layers[0].self_attn.o_proj.gguf_segments[0].weight
            assert isinstance(o_proj, Planes) and o_proj.kind.name == "INT8_G64"
        outs[name] = llm.generate(prompts, sp) + llm.generate(prompts[:1], sp)
        prompt_lps[name] = full_prompt_logprobs(llm, prompts[:3])
        llm.engine.check_integrity()
        del llm
    if int8:
        torch.testing.assert_close(prompt_lps["kept"], prompt_lps["deq"], rtol=0, atol=5e-3)
    for a, b in zip(outs["kept"], outs["ref"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            tok = next(iter(lb))
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-3
    monkeypatch.setattr(voltllm.config, "KEEP_QUANTIZED", -1)
    llm = LLM(path, device="cuda", dtype="float16", compat="sm70", quantization="bitsandbytes", max_model_len=512,
              gpu_memory_utilization=0.2)
    assert llm.engine.runner.keep_quantized
    out = llm.generate(["Hello world"] * 3, SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    llm.engine.check_integrity()
