"""The tiled dequant-GEMM (kernels/quant_dot.py) on the GPU: GGUF, AWQ, 8-bit GPTQ, FP8 and bitsandbytes NF4 / FP4
planes at the qwen3-8b
projection shapes against the planes' own dequantization (fp16 / bf16, 5-300 rows, outputs poisoned first, K split or
not), the linear layer's dispatch by row count, and quantized MoE experts (layers/quant_moe.QuantExperts) on all three
paths (per pair, grouped, per expert dequantize + cuBLAS) and inside a CUDA graph against the dense experts."""
from __future__ import annotations

import random

import pytest
import torch

from voltllm.kernels.quant_dot import dot_max_rows, grouped_max_rows, quant_dot
from voltllm.kernels.quant_gemv import dequantize
from voltllm.model.layers.gguf_planes import (FP8_KIND, Unpacked, bnb_kind, int4_kind, int8_kind, map_planes,
                                              planes_from_blocks, random_blocks, to_planes)

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _planes(kind: str, n: int, k: int, g: torch.Generator):
    if kind.startswith("BNB_"):  # bitsandbytes: every table code, a positive fp16 absmax per block
        pk = bnb_kind(kind[4:7].lower(), int(kind.rpartition("_B")[2]))
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        d = (torch.rand(n, k // pk.super, generator=g) * 0.05 + 0.001).half()
        return map_planes(to_planes(Unpacked(codes=codes, d=d, m=None, sc=None, mn=None), pk), lambda t: t.cuda(), n)
    if kind in ("AWQ_G128", "GPTQ8_G128", "FP8"):
        pk = {"AWQ_G128": int4_kind(128, True), "GPTQ8_G128": int8_kind(128, True), "FP8": FP8_KIND}[kind]
        top = {"AWQ_G128": 16, "GPTQ8_G128": 256, "FP8": 255}[kind]
        codes = torch.randint(0, top, (n, k), dtype=torch.uint8, generator=g)
        if pk.fp8:
            codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
        d = torch.rand(n, k // pk.super, generator=g) * 0.01 + 0.001
        zlo, ztop = (-128, 128) if pk.hi_bits else (0, 16)  # the int8 kinds' zero plane: zero - 128
        zeros = torch.randint(zlo, ztop, (n, k // 128), dtype=torch.int8, generator=g) if pk.zero_points else None
        p = to_planes(Unpacked(codes=codes, d=d if pk.fp8 else d.half(), m=None, sc=None, mn=zeros), pk)
        return map_planes(p, lambda t: t.cuda(), n)
    return planes_from_blocks(random_blocks(kind, n, k, g), kind, k, torch.device("cuda"))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q3_K", "Q2_K", "IQ4_XS", "AWQ_G128", "GPTQ8_G128",
                                  "FP8", "BNB_NF4_B64", "BNB_FP4_B128"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_quant_dot_matches_reference(kind, n, k):
    seed = random.SystemRandom().randrange(1 << 30)
    p = _planes(kind, n, k, torch.Generator().manual_seed(seed))
    w = dequantize(p, torch.float32)
    for dtype in (torch.float16, torch.bfloat16) if n == 6144 else (torch.float16,):
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        for m in (5, 16, 33, 64, 100, 300):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            bias = torch.randn(n, dtype=dtype, device="cuda") if m == 33 else None
            wide = torch.full((m, n + 16), float("nan"), dtype=dtype, device="cuda")
            out = quant_dot(x, p, bias, out=wide[:, 8:8 + n], split=1 if m == 16 else None)
            ref = x.float() @ w.T + (0 if bias is None else bias.float())
            err = _rel(out, ref)
            assert err < tol and not out.isnan().any(), f"{kind} {n}x{k} m={m} {dtype}: {err:.2e} seed {seed}"
            assert wide[:, :8].isnan().all() and wide[:, 8 + n:].isnan().all(), "wrote outside its columns"


def test_linear_dispatch_by_rows(monkeypatch):
    """QuantizedLinearMethod: <= 4 rows the few-row kernel (quant_half2.few_row_matmul; no start-up tile here),
    then the tiled kernel up to dot_max_rows, then dequantize + cuBLAS; all three give the same product."""
    import voltllm.kernels.quant_dot as qd
    import voltllm.kernels.quant_half2 as qh
    from voltllm.model.layers.quantized_linear import QuantizedLinearMethod, Segment

    limit = dot_max_rows(torch.cuda.get_device_capability())
    method = QuantizedLinearMethod(limit)
    p = _planes("Q4_K", 512, 1024, torch.Generator().manual_seed(3))
    w = dequantize(p, torch.float32)
    used = []
    monkeypatch.setattr(qh, "few_row_matmul", lambda *a, _f=qh.few_row_matmul, **kw: used.append("fma") or _f(*a, **kw))
    monkeypatch.setattr(qd, "quant_dot", lambda *a, _f=qd.quant_dot, **kw: used.append("dot") or _f(*a, **kw))
    for m, form in ((3, "fma"), (5, "dot"), (limit, "dot"), (limit + 1, None)):
        used.clear()
        x = torch.randn(m, 1024, dtype=torch.float16, device="cuda")
        y = method.segment_product(x, Segment(0, 512, p), None, None)
        assert used == ([form] if form else []), (m, used)
        assert _rel(y, x.float() @ w.T) < 2e-3


def _experts(g, kind: str = "AWQ_G128"):
    from voltllm.model.layers.quant_moe import QuantExperts

    e, inter, h = 16, 256, 512
    qe = QuantExperts(e, inter, h, torch.device("cuda"), torch.float16)
    qe.w13 = _planes(kind, e * 2 * inter, h, g)
    qe.w2 = _planes(kind, e * h, inter, g)
    w13 = dequantize(qe.w13, torch.float32).view(e, 2 * inter, h)
    w2 = dequantize(qe.w2, torch.float32).view(e, h, inter)
    return qe, w13, w2


@pytest.mark.parametrize("kind", ["AWQ_G128", "BNB_NF4_B64"])
def test_quant_moe_paths_match_dense(kind):
    """Per-pair launches (<= 16 tokens), the grouped kernel (more), per-expert dequantize + cuBLAS (past the row
    limit): each against the dense experts, with one expert receiving no token."""
    from voltllm.model.layers.moe import fused_experts_ref

    qe, w13, w2 = _experts(torch.Generator().manual_seed(4), kind)
    top_k = 4
    for t, limit in ((1, None), (16, None), (17, None), (37, None), (300, None), (300, 2)):
        x = torch.randn(t, 512, dtype=torch.float16, device="cuda")
        ids = torch.stack([torch.randperm(15, device="cuda")[:top_k] for _ in range(t)]).to(torch.int32)
        wts = torch.softmax(torch.randn(t, top_k, device="cuda"), -1)
        qe.grouped_max_rows = limit if limit is not None else grouped_max_rows(torch.cuda.get_device_capability())
        got = qe.forward(x, wts, ids)
        ref = fused_experts_ref(x.float(), w13, w2, wts, ids.long())
        assert _rel(got, ref) < 3e-3, (t, limit, _rel(got, ref))


def test_quant_moe_grouped_in_cuda_graph():
    """The grouped path captured in a CUDA graph (24 tokens: past the per-pair limit) replays the eager result for
    new routings."""
    qe, _, _ = _experts(torch.Generator().manual_seed(5))
    t, top_k = 24, 4
    x = torch.randn(t, 512, dtype=torch.float16, device="cuda")
    ids = torch.zeros(t, top_k, dtype=torch.int32, device="cuda")
    wts = torch.zeros(t, top_k, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        qe.forward(x, wts, ids)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qe.forward(x, wts, ids)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(t, 512, device="cuda", generator=gen))
        ids.copy_(torch.stack([torch.randperm(16, device="cuda", generator=gen)[:top_k] for _ in range(t)]))
        wts.copy_(torch.softmax(torch.randn(t, top_k, device="cuda", generator=gen), -1))
        graph.replay()
        assert torch.equal(out, qe.forward(x, wts, ids))
