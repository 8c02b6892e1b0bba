"""Quantized hybrid checkpoints (Qwen3-Next / Qwen3.5 / Qwen3.5-MoE) kept quantized, on the CPU, fp32: tiny random
checkpoints quantized by tests/quant_checkpoints.py (attention, Gated DeltaNet in / out projections, dense MLPs,
routed and shared experts; the router and the shared expert's gate left dense, as the quantizers leave them) hold
their projections as planes and their routed experts as quant_moe.QuantExperts, every layer multiplying like the
same checkpoint dequantized at load; through the whole engine (chunked prompts, decode batches, state slots) the kept
model gives the dequantized model's prompt logprobs and greedy tokens."""
from __future__ import annotations

import pytest
import torch
from quant_checkpoints import HYBRID_QUANT_MOE as MOE, kept_and_dense, quantized_hybrid

pytest.importorskip("transformers")

CASES = {
    "qwen3_next-awq": ("qwen3_next", dict(MOE, mlp_only_layers=[1]), dict(method="awq")),
    "qwen3_next-fp8": ("qwen3_next", MOE, dict(method="fp8")),
    "qwen3_next-nvfp4": ("qwen3_next", MOE, dict(method="modelopt_fp4")),
    "qwen3_5-awq": ("qwen3_5", {}, dict(method="awq")),
    "qwen3_5-gptq-sym": ("qwen3_5", {}, dict(method="gptq", symmetric=True)),
    # 8-bit GPTQ (asymmetric): int8 planes in the GDN / attention / MLP projections and the routed experts
    "qwen3_5_moe-gptq8": ("qwen3_5_moe", MOE, dict(method="gptq", bits=8)),
    "qwen3_5-fp8-channel": ("qwen3_5", {}, dict(method="fp8", block=None)),
    "qwen3_5_moe-nvfp4": ("qwen3_5_moe", MOE, dict(method="compressed-tensors")),
    # the GDN b / a projections left unquantized (as quantizers commonly do): in_proj holds planes and dense rows
    "qwen3_5-awq-dense-ba": ("qwen3_5", {}, dict(method="awq", dense=tuple(
        f"layers.{i}.linear_attn.in_proj_{x}" for i in range(3) for x in "ba"))),
    "qwen3_next-nvfp4-dense-ba": ("qwen3_next", MOE, dict(method="compressed-tensors", dense=tuple(
        f"layers.{i}.linear_attn.in_proj_ba" for i in range(3)))),
    # experts and shared expert of 64 inputs: not whole 128-input FP8 scales, so they stay dense
    "qwen3_next-fp8-narrow": ("qwen3_next", dict(MOE, moe_intermediate_size=64, shared_expert_intermediate_size=64),
                              dict(method="fp8")),
}
KIND = {"awq": "INT4_G32_ZP", "gptq": "INT4_G32", "fp8": "FP8_E4M3", "modelopt_fp4": "NVFP4",
        "compressed-tensors": "NVFP4", "gptq8": "INT8_G32_ZP"}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    kind, extra, quant = CASES[request.param]
    path = quantized_hybrid(str(tmp_path_factory.mktemp(request.param)), kind, quant, **extra)
    if path is None:
        pytest.skip(f"this transformers has no {kind}")
    return request.param, path


def _projections(model) -> dict[str, torch.nn.Module]:
    """name -> every Linear a quantizer quantizes (attention, GDN, dense MLP, shared expert)."""
    from voltllm.model.layers.linear import Linear

    skip = ("lm_head", ".mlp.gate", ".shared_expert_gate")
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and not n.endswith(skip)}


def test_layers_held_as_planes(checkpoint):
    """What the kept model holds: one plane segment per projection (dense where the planes cannot hold the input
    width), the routed experts as QuantExperts with no dense expert weights (dense where they cannot), the router and
    the shared expert's gate as dense parameters; each projection and MoE block gives the dequantized one's output
    (the GDN in_proj checks the grouped qkvz / ba rows were cut out of the packed weight in the right order)."""
    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.moe import SparseMoE

    name, path = checkpoint
    quant = CASES[name][2]
    method = quant["method"] + ("8" if quant.get("bits") == 8 else "")
    narrow = name.endswith("narrow")
    kept, dense = kept_and_dense(path)
    dense_mods = dict(dense.named_modules())
    gen = torch.Generator().manual_seed(0)
    projections = _projections(kept)
    assert any(".linear_attn.in_proj" in n for n in projections) and any(".self_attn.o_proj" in n for n in projections)
    for n, mod in projections.items():
        assert mod.weight is None, n  # no dense parameter behind a kept layer
        segs = mod.gguf_segments
        held_dense = narrow and ".shared_expert.down_proj" in n
        if held_dense:
            assert len(segs) == 1 and isinstance(segs[0].weight, torch.Tensor), n
        elif name.endswith("dense-ba") and n.endswith("in_proj"):  # q k v z as one plane segment, b a dense
            assert [type(s.weight) for s in segs] == [Planes, torch.Tensor] and segs[1].size == 2 * 8, n
        else:
            assert len(segs) == 1 and isinstance(segs[0].weight, Planes) and segs[0].weight.kind.name == KIND[method], n
        x = torch.randn(3, mod.in_features, generator=gen)
        torch.testing.assert_close(mod(x), dense_mods[n](x), rtol=1e-5, atol=1e-5)
    moes = [(n, m) for n, m in kept.named_modules() if isinstance(m, SparseMoE)]
    assert bool(moes) == ("num_experts" in CASES[name][1])
    for n, moe in moes:
        if narrow:
            assert moe.qexperts is None and moe.w13 is not None, n
        else:
            assert moe.qexperts is not None and moe.qexperts.ready and moe.w13 is None and moe.w2 is None, n
            assert moe.qexperts.w13.kind.name == moe.qexperts.w2.kind.name == KIND[method]
        assert isinstance(moe.gate.weight, torch.Tensor) and isinstance(moe.shared_expert_gate.weight, torch.Tensor)
        x = torch.randn(5, moe.hidden, generator=gen)
        torch.testing.assert_close(moe(x), dense_mods[n](x), rtol=1e-5, atol=1e-5)


def _run(path: str, keep: bool, monkeypatch):
    import voltllm.config
    from voltllm import LLM, SamplingParams

    # as on a GPU: the CPU engine keeps them quantized too once the config says so (torch reference products)
    monkeypatch.setattr(voltllm.config, "_quantized_weights",
                        lambda *a, **k: "quantized" if keep else "dequantized")
    llm = LLM(path, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.engine.runner.keep_quantized == keep
    from voltllm.acceleration import build_report

    moe_route = build_report(llm.engine.config, llm.engine.runner)["routes"].get("moe")
    if moe_route is not None:  # the report names the experts' route (dense experts: the reference GEMMs)
        quantized = any(getattr(m, "qexperts", None) is not None for m in llm.engine.runner.model.modules())
        assert ("experts dequantized one at a time" in moe_route["impl"]) == quantized
    prompts = [[(7 * i + 3 * j) % 190 + 1 for j in range(n)] for i, n in enumerate((23, 5, 40, 11))]
    sp = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, logprobs=2, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    llm.engine.check_integrity()
    return outs


def test_engine_kept_matches_dequantized(checkpoint, monkeypatch):
    """The whole engine (16-token budget: chunked prompts mixed with decode rows, then decode batches) kept
    quantized against dequantized at load: the same greedy tokens, prompt logprobs and sampled logprobs."""
    _, path = checkpoint
    kept, dense = _run(path, True, monkeypatch), _run(path, False, monkeypatch)
    for a, b in zip(kept, dense):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for tok, lp in lb.items():
                assert abs(la[tok].logprob - lp.logprob) < 1e-4
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in lb.items():
                assert abs(la[tok].logprob - lp.logprob) < 1e-4


def test_split_rows_relays_once():
    """split_rows on a packed weight: each part is the dense split's rows (planes and dequantized), and the packed
    tensor is re-laid once for all parts (Qwen3-Next's in_proj_qkvz gives four)."""
    from quant_checkpoints import pack_awq, quantize_rtn

    from voltllm.model.layers.gguf_planes import dequantize_planes
    from voltllm.model.layers.quantized_linear import split_rows
    from voltllm.model.loader.int4_checkpoint import Int4Scheme, Int4Weight

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    codes, scales, zeros, deq = quantize_rtn(w, 32, False)
    packed = Int4Weight(Int4Scheme("awq", 32, False, 0), **pack_awq(codes, zeros, scales), g_idx=None)
    calls = []
    relay = packed.to_weight
    packed.to_weight = lambda *a: calls.append(a) or relay(*a)
    index = [torch.arange(64).reshape(4, 16)[:, :8].reshape(-1), torch.arange(64).reshape(4, 16)[:, 8:].reshape(-1)]
    parts = split_rows(packed, index)
    for part, idx, dense in zip(parts, index, split_rows(deq, index)):
        assert (part.out_features, part.in_features) == (32, 128)
        assert torch.equal(dequantize_planes(part.to_weight(torch.device("cpu"), torch.float32)), dense)
        assert torch.equal(part.dequantize(), deq[idx])
    assert len(calls) == 1
