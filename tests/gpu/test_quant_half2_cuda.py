"""The packed-fp16 4-bit GEMV (kernels/quant_half2.py) on the GPU: against the dequantized weight in fp32 for int4
(zero points / fixed zero), Q4_0 and NVFP4 checkpoints' planes, 1-7 rows, odd N, bias, column-slice outputs,
NaN-poisoned outputs; the few-row dispatch's fallbacks; the start-up tuner choosing among both forms."""
from __future__ import annotations

import random

import pytest
import torch
from quant_checkpoints import nvfp4_layer

from voltllm.kernels.quant_gemv import dequantize
from voltllm.kernels.quant_half2 import (DOT, HALF2, HALF2_ROWS, MMA, few_row_matmul, fits, half2_matmul,
                                         half2_rows_matmul, operands_ok)
from voltllm.model.layers.gguf_planes import (Unpacked, int4_kind, int8_kind, map_planes, planes_from_blocks,
                                              random_blocks, to_planes)
from voltllm.model.loader.nvfp4_checkpoint import NVFP4Scheme, NVFP4Weight

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _planes(kind: str, n: int, k: int, g: torch.Generator):
    if kind == "Q4_0":
        return planes_from_blocks(random_blocks(kind, n, k, g), kind, k, torch.device("cuda"))
    if kind == "NVFP4":  # through the checkpoint loader, from a ModelOpt-style quantization of random weights
        tensors, _ = nvfp4_layer(torch.randn(n, k, generator=g) * 0.02, "modelopt_fp4")
        scheme = NVFP4Scheme("modelopt")
        w = NVFP4Weight.from_checkpoint(tensors[scheme.weight_part], tensors["weight_scale"],
                                        tensors[scheme.global_part], scheme.global_divides)
        return w.to_weight(torch.device("cuda"), torch.float16)
    group, zp = {"AWQ_G128": (128, True), "GPTQ_G32": (32, False), "AWQ_G64": (64, True)}[kind]
    u = Unpacked(codes=torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                 d=(torch.rand(n, k // group, generator=g) * 0.01 + 0.001).half(), m=None, sc=None,
                 mn=torch.randint(0, 16, (n, k // group), dtype=torch.int8, generator=g) if zp else None)
    p = to_planes(u, int4_kind(group, zp))
    return map_planes(p, lambda t: t.to("cuda"), p.n)


@pytest.mark.parametrize("kind", ["AWQ_G128", "GPTQ_G32", "AWQ_G64", "Q4_0", "NVFP4"])
@pytest.mark.parametrize("n,k", [(1000, 1536), (4096, 4096), (513, 12288)])
def test_matches_dequantized(kind, n, k):
    seed = random.SystemRandom().randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    p = _planes(kind, n, k, g)
    assert fits(p)
    w = dequantize(p, torch.float32)
    bias = torch.randn(n, dtype=torch.float16, device="cuda")
    for m in (1, 2, 3, 4, 5, 7):
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        assert operands_ok(x, p, None)
        for form, config in ((half2_matmul, (2, 64, 4)), (half2_matmul, (1, 32, 1)), (half2_matmul, (4, 16, 2)),
                             (half2_rows_matmul, (1, 64, 2)), (half2_rows_matmul, (2, 64, 2)),
                             (half2_rows_matmul, (2, 128, 4)), (half2_rows_matmul, (2, 32, 1, 3))):
            wide = torch.full((m, n + 40), float("nan"), dtype=torch.float16, device="cuda")
            out = wide[:, 24:24 + n]  # a column slice of a wider output, poisoned
            form(x, p, bias if m % 2 else None, out=out, config=config)
            ref = x.float() @ w.T + (bias.float() if m % 2 else 0)
            err = _rel(out, ref)
            assert err < 2e-3 and not out.isnan().any(), \
                f"{kind} {n}x{k} m={m} {form.__name__} {config}: {err:.2e} seed {seed}"
            assert wide[:, :24].isnan().all() and wide[:, 24 + n:].isnan().all()  # nothing written outside


def test_dispatch_and_fits():
    g = torch.Generator().manual_seed(0)
    p = _planes("AWQ_G128", 256, 1024, g)
    w = dequantize(p, torch.float32)
    x = torch.randn(3, 2048, dtype=torch.float16, device="cuda")[:, ::2]  # not contiguous: the fp32 form runs
    assert not operands_ok(x, p, None)
    ref = x.float() @ w.T
    assert _rel(few_row_matmul(x, p, config=(HALF2, 2, 32, 2)), ref) < 2e-3
    assert _rel(few_row_matmul(x, p, config=(HALF2_ROWS, 2, 64, 2)), ref) < 2e-3
    assert _rel(few_row_matmul(x.contiguous(), p, config=(HALF2_ROWS, 2, 64, 2)), ref) < 2e-3
    xb = torch.randn(2, 1024, dtype=torch.bfloat16, device="cuda")  # bf16: no f16x2 form
    assert not operands_ok(xb, p, None)
    assert _rel(few_row_matmul(xb, p, config=(HALF2, 2, 32, 2)), xb.float() @ w.T) < 1e-2
    assert _rel(few_row_matmul(x.contiguous(), p, config=None), ref) < 2e-3
    assert _rel(few_row_matmul(x.contiguous(), p, config=(MMA, 8, 4)), ref) < 2e-3
    assert _rel(few_row_matmul(x, p, config=(MMA, 8, 4)), ref) < 2e-3  # strided: the fp32 form instead
    assert _rel(few_row_matmul(xb, p, config=(MMA, 8, 4)), xb.float() @ w.T) < 1e-2
    assert _rel(few_row_matmul(x.contiguous(), p, config=(DOT,)), ref) < 2e-3
    # 8-bit GPTQ planes (codes with high bits): refused by this form and the tensor-core one, the fp32 form runs
    u = Unpacked(codes=torch.randint(0, 256, (256, 1024), dtype=torch.uint8, generator=g),
                 d=(torch.rand(256, 8, generator=g) * 0.01 + 0.001).half(), m=None, sc=None,
                 mn=torch.randint(-128, 128, (256, 8), dtype=torch.int8, generator=g))
    p8 = map_planes(to_planes(u, int8_kind(128, True)), lambda t: t.to("cuda"), 256)
    ref8 = x.float() @ dequantize(p8, torch.float32).T
    assert not fits(p8) and not operands_ok(x.contiguous(), p8, None)
    for config in ((HALF2, 2, 32, 2), (HALF2_ROWS, 2, 64, 2), (MMA, 8, 4), (DOT,), None):
        assert _rel(few_row_matmul(x.contiguous(), p8, config=config), ref8) < 2e-3
    # NVFP4 whose per-16 scale times global times 2^14 passes fp16's range: not this form
    q = _planes("NVFP4", 64, 256, g)
    assert fits(q)
    big = map_planes(q, lambda t: t, q.n)
    big.d = q.d * 1e4
    assert not fits(big)


def test_tuner_chooses_among_both_forms():
    """worker/quant_tuning.py on an AWQ layer with fp16 activations: its choice for each row class is one of the
    candidates of either form, and the layer then computes its reference product; with tensor cores allowed (sm_80+)
    the tensor-core form joins from 4 rows on and wins the 5-8 and 9-16-row classes."""
    from voltllm.model.layers.linear import Linear
    from voltllm.model.layers.quantized_linear import QuantizedLinearMethod, _merge
    from voltllm.kernels.quant_mma import supported_device
    from voltllm.worker.quant_tuning import CANDIDATES, HALF2_CANDIDATES, MMA_CANDIDATES, tune_quant_tiles

    g = torch.Generator().manual_seed(1)
    k, n = 4096, 6144
    method = QuantizedLinearMethod()
    with torch.device("cuda"):
        layer = Linear(k, [n], dtype=torch.float16, method=method)
    p = _planes("AWQ_G128", n, k, g)
    layer.gguf_segments = _merge([p], [n])  # as load_shard leaves it
    lines = tune_quant_tiles(torch.nn.ModuleList([layer]), method, torch.float16)
    assert len(lines) == 2, lines  # no tensor cores: the 5-16-row classes stay quant_dot's, untimed
    for key, cfg in method.tiles.items():
        assert cfg in CANDIDATES[key[3]] + HALF2_CANDIDATES[key[3]], (key, cfg)
    w = dequantize(p, torch.float32)
    for m in (1, 4):
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        assert _rel(layer(x), x.float() @ w.T) < 2e-3, (m, method.tiles, lines)
    if not supported_device(torch.device("cuda")):
        return
    method.tiles.clear()
    lines = tune_quant_tiles(torch.nn.ModuleList([layer]), method, torch.float16, tensor_cores=True)
    assert len(lines) == 4, lines
    for key, cfg in method.tiles.items():
        assert cfg in CANDIDATES[key[3]] + HALF2_CANDIDATES[key[3]] + MMA_CANDIDATES[key[3]], (key, cfg)
    # the s104 sweep at this shape: the tensor-core form 2-3x faster than either other at 4 and 8 rows
    assert method.tiles[(p.kind.name, n, k, 8)][0] == MMA, lines
    assert method.tiles[(p.kind.name, n, k, 16)][0] == MMA, lines  # WIDE at 16 rows: 2x quant_dot expected
    for m in (1, 2, 4, 5, 8, 9, 16, 17):
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        assert _rel(layer(x), x.float() @ w.T) < 2e-3, (m, method.tiles, lines)


def test_pdl_chain_in_a_graph():
    """With PDL on (sm_90+), a chain of both tilings' launches captured in a CUDA graph, each reading the previous
    one's output, equals the chain run kernel by kernel: every launch waits for its predecessor's writes."""
    from gpu_timing import replay_with_pdl

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    seed = random.SystemRandom().randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    dims = [1024, 4096, 1536, 4096, 1024]
    chain = [(_planes(kind, n, k, g), form, cfg) for kind, k, n, form, cfg in zip(
        ("AWQ_G128", "NVFP4", "AWQ_G64", "Q4_0"), dims[:-1], dims[1:],
        (half2_rows_matmul, half2_matmul, half2_rows_matmul, half2_matmul),
        ((2, 32, 1), (2, 32, 2), (2, 64, 2), (4, 16, 2)))]
    for m in (1, 4):
        x0 = torch.randn(m, dims[0], dtype=torch.float16, device="cuda") * 0.5
        outs = [torch.empty(m, n, dtype=torch.float16, device="cuda") for n in dims[1:]]

        def run():
            for x, (p, form, cfg), o in zip([x0] + outs[:-1], chain, outs):
                form(x, p, out=o, config=cfg)
        run()
        expected = [o.clone() for o in outs]
        replay_with_pdl(run, outs)
        for i, (o, e) in enumerate(zip(outs, expected)):
            assert torch.equal(o, e), f"m={m} link {i}: {_rel(o, e):.2e} seed {seed}"


@pytest.mark.parametrize("kind", ["AWQ_G128", "GPTQ_G32", "Q4_0", "NVFP4"])
@pytest.mark.parametrize("n,k", [(1000, 1536), (4096, 4096), (513, 12288)])
def test_tensor_core_form_matches_dequantized(kind, n, k):
    """kernels/quant_mma.py (sm_80+): 1-8 activation rows per program as the mma's B columns, more in further
    programs; odd N (rows past it repeat the last, stores masked), bias, a poisoned column slice of a wider output,
    each config (KU / warps / pipelined stages)."""
    from voltllm.kernels.quant_mma import quant_mma_matmul, supported_device

    if not supported_device(torch.device("cuda")):
        pytest.skip("mma.m16n8k16 needs sm_80+")
    seed = random.SystemRandom().randrange(1 << 30)
    p = _planes(kind, n, k, torch.Generator().manual_seed(seed))
    w = dequantize(p, torch.float32)
    bias = torch.randn(n, dtype=torch.float16, device="cuda")
    for m in (1, 2, 3, 5, 8, 9, 13, 16, 17, 33):
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        for config in ((4, 4), (1, 1), (8, 4), (4, 2, 3)):
            wide = torch.full((m, n + 40), float("nan"), dtype=torch.float16, device="cuda")
            out = wide[:, 24:24 + n]
            quant_mma_matmul(x, p, bias if m % 2 else None, out=out, config=config)
            ref = x.float() @ w.T + (bias.float() if m % 2 else 0)
            err = _rel(out, ref)
            assert err < 2e-3 and not out.isnan().any(), f"{kind} {n}x{k} m={m} {config}: {err:.2e} seed {seed}"
            assert wide[:, :24].isnan().all() and wide[:, 24 + n:].isnan().all()
