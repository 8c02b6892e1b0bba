"""NVFP4 weights kept quantized on the GPU: the dequant kernel bit for bit and the dequant-GEMM (1-16 rows, fp16 and
bf16) with the NVFP4 kind (software E2M1 / E4M3 decode) against the format's definition at real shapes, outputs
poisoned first, both producers; the MoE pair launches; tiny ModelOpt / compressed-tensors models kept quantized
against the same checkpoint dequantized at load (fp32: the same tokens and logprobs), under --compat sm70 (fp16:
it runs, keeps its bookkeeping), and a qwen3_moe with NVFP4 experts."""
from __future__ import annotations

import random

import pytest
import torch
from quant_checkpoints import assert_kept_matches_dequantized, nvfp4_layer, quantize_checkpoint
from tiny_models import make_model

from voltllm.kernels.quant_gemv import dequantize, quant_matmul, quant_moe_matmul
from voltllm.model.layers.gguf_planes import NVFP4_KIND, concat_rows
from voltllm.model.loader.nvfp4_checkpoint import NVFP4Scheme, NVFP4Weight

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _weight(w: torch.Tensor, producer: str) -> tuple[NVFP4Weight, torch.Tensor]:
    tensors, deq = nvfp4_layer(w, producer)
    scheme = NVFP4Scheme("modelopt" if producer == "modelopt_fp4" else "compressed-tensors")
    return NVFP4Weight.from_checkpoint(tensors[scheme.weight_part], tensors["weight_scale"],
                                       tensors[scheme.global_part], scheme.global_divides), deq


# (the tests' quantizer runs in float64 on the host: 3 ModelOpt shapes, one compressed-tensors)
@pytest.mark.parametrize("producer,n,k", [("modelopt_fp4", 4096, 4096), ("modelopt_fp4", 6144, 4096),
                                          ("modelopt_fp4", 4096, 12288), ("compressed-tensors", 12288, 4096)])
def test_kernels_match_definition(producer, n, k):
    seed = random.SystemRandom().randrange(1 << 30)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    packed, deq = _weight(w, producer)
    p = packed.to_weight(torch.device("cuda"), torch.float16)
    assert p.kind == NVFP4_KIND
    ref_w = deq.cuda()
    got = dequantize(p, torch.float32, out=torch.full((n, k), float("nan"), device="cuda"))
    assert torch.equal(got, ref_w), f"seed {seed}"
    for dtype in (torch.float16, torch.bfloat16):
        half = dequantize(p, dtype, out=torch.full((n, k), float("nan"), dtype=dtype, device="cuda"))
        assert torch.equal(half, ref_w.to(dtype)), f"{dtype} seed {seed}"
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        for m in (1, 2, 3, 4, 7, 16):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            quant_matmul(x, p, out=out)
            err = _rel(out, x.float() @ ref_w.T)
            assert err < tol and not out.isnan().any(), f"{producer} {n}x{k} m={m} {dtype}: {err:.2e} seed {seed}"


def test_moe_pairs():
    """quant_moe_matmul over 8 experts of 768 x 2048 NVFP4 blocks (Qwen3-30B-A3B's gate / up shape), each with its
    own global scale."""
    gen = torch.Generator().manual_seed(0)
    rows, k, experts = 768, 2048, 8
    parts, deqs = zip(*(_weight(torch.randn(rows, k, generator=gen) * 0.02 * (e + 1), "modelopt_fp4")
                        for e in range(experts)))
    p = concat_rows([w.to_weight(torch.device("cuda"), torch.float16) for w in parts])
    w = torch.cat(deqs).cuda()
    x = torch.randn(4, k, dtype=torch.float16, device="cuda")
    x_rows = torch.tensor([0, 0, 1, 2, 3, 3], dtype=torch.int32, device="cuda")
    ids = torch.tensor([7, 0, 3, 3, 5, 1], dtype=torch.int32, device="cuda")
    out = quant_moe_matmul(x, p, rows, x_rows, ids)
    ref = torch.stack([x[r].float() @ w[e * rows:(e + 1) * rows].T for r, e in zip(x_rows.tolist(), ids.tolist())])
    assert _rel(out, ref) < 2e-3


@pytest.fixture(scope="module", params=["modelopt_fp4", "compressed-tensors"])
def tiny_nvfp4(request, tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp(request.param)), "qwen3", hidden_size=128, intermediate_size=256,
                      head_dim=32, std=0.08)
    quantize_checkpoint(path, request.param, dense=("layers.1.self_attn.o_proj",))
    return request.param, path


def test_tiny_model_kept_quantized_matches_dequantized(monkeypatch, tiny_nvfp4):
    def check(llm, keep):
        assert llm.engine.runner.keep_quantized == keep

    assert_kept_matches_dequantized(monkeypatch, tiny_nvfp4[1], check)


def test_tiny_model_compat_route(tiny_nvfp4):
    from voltllm import LLM, SamplingParams

    method, path = tiny_nvfp4
    llm = LLM(path, device="cuda", dtype="float16", compat="sm70", quantization=method, max_model_len=512,
              gpu_memory_utilization=0.2)
    assert llm.engine.runner.keep_quantized and llm.engine.config.model.quantization == method
    out = llm.generate(["Hello world"] * 3, SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    llm.engine.check_integrity()


@pytest.mark.parametrize("method", ["modelopt_fp4", "compressed-tensors"])
def test_moe_experts_kept_quantized(monkeypatch, tmp_path, method):
    path = make_model(str(tmp_path / "moe"), "qwen3_moe", hidden_size=128, intermediate_size=256, head_dim=32,
                      moe_intermediate_size=128, std=0.08)
    quantize_checkpoint(path, method)

    def check(llm, keep):
        q = llm.engine.runner.model.layers[0].mlp.qexperts
        assert (q is not None) == keep and (not keep or q.w13.kind == NVFP4_KIND)

    assert_kept_matches_dequantized(monkeypatch, path, check)
