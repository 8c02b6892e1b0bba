"""Quantized Qwen4-Exp (qwen4_exp_text) checkpoints on the CPU, fp32: tiny random checkpoints (PLE layers, QSA past
its budget) quantized by tests/quant_checkpoints.py (attention, Gated DeltaNet, routed and shared experts; the router,
the shared expert's gate, the hyper-connection, PLE and QSA indexer linears left dense, as quantizers leave them) or
by the compressed-tensors library (int4 pack-quantized). Kept quantized, the projections hold planes and the routed
experts quant_moe.QuantExperts, each multiplying like the same checkpoint dequantized at load; the whole model gives
the dequantized model's logits, and through the engine (chunked prompts, decode batches) its greedy tokens and
logprobs. A checkpoint that quantizes the small linears too has them dequantized at load (dense parameters)."""
from __future__ import annotations

import pytest
import torch

from quant_checkpoints import kept_and_dense, quantized_qwen4_exp
from tiny_models import QWEN4_EXP_INDEXER, QWEN4_EXP_PLE

pytest.importorskip("transformers")

MODEL = dict(QWEN4_EXP_INDEXER, **QWEN4_EXP_PLE, indexer_budget=8)
# the small linears a quantizer may also take: hyper-connections (down), PLE key / value, the QSA indexer
SMALL = ("input_mix_weight_down", "key_proj", "value_proj", "index_qk_proj")
CASES = {
    "awq": dict(method="awq"),
    "gptq-sym": dict(method="gptq", symmetric=True),
    "fp8-block": dict(method="fp8"),
    "fp8-channel": dict(method="fp8", block=None),
    "nvfp4-ct": dict(method="compressed-tensors"),
    "nvfp4-modelopt": dict(method="modelopt_fp4"),
    "awq-small-quantized": dict(method="awq", extra=SMALL),
    "ct-int4": None,  # compressed-tensors w4a16 (int4 pack-quantized, asymmetric, groups of 32), the library's own
}
KIND = {"awq": "INT4_G32_ZP", "gptq": "INT4_G32", "fp8": "FP8_E4M3", "modelopt_fp4": "NVFP4",
        "compressed-tensors": "NVFP4", "ct-int4": "INT4_G32_ZP"}


def _ct_int4(path: str) -> str | None:
    from ct_checkpoints import quantize_files
    from tiny_models import make_tiny_qwen4_exp

    from quant_checkpoints import HYBRID_QUANT_MOE, HYBRID_QUANT_SHAPE

    pytest.importorskip("compressed_tensors")
    shape = {k: v for k, v in HYBRID_QUANT_SHAPE.items() if k != "intermediate_size"}
    if make_tiny_qwen4_exp(path, 3, **{**shape, **HYBRID_QUANT_MOE, **MODEL}) is None:
        return None
    # as a quantizer's recipe: the router, the shared expert's gate, GDN b / a, the hyper-connections and the n-gram
    # tables (embeddings) ignored; the PLE and indexer projections quantized (dequantized at load)
    quantize_files(path, "w4a16-asym-g32", ignore=("lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$",
                                                   "re:.*in_proj_(a|b)$", "re:.*hyper_connection.*",
                                                   "re:.*ngram_embedding.*"))
    return path


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    quant = CASES[request.param]
    path = _ct_int4(d) if quant is None else quantized_qwen4_exp(d, quant, **MODEL)
    if path is None:
        pytest.skip("this transformers has no Qwen4-Exp")
    return request.param, path


def test_layers_held_as_planes_and_model_matches(checkpoint):
    """Every attention / GDN / shared-expert projection holds planes of the checkpoint's kind (GDN in_proj's b / a
    rows dense where the checkpoint keeps them dense), the routed experts are QuantExperts, the small linears dense
    parameters; each multiplies like the dequantized model's, and so does the whole model over chunked prompts and
    decode steps (QSA past its budget, PLE)."""
    from model.test_hybrid_parity import Harness

    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.linear import Linear
    from voltllm.model.layers.moe import SparseMoE

    name, path = checkpoint
    kind = KIND[name if name == "ct-int4" else CASES[name]["method"]]
    kept, dense = kept_and_dense(path)
    dense_mods = dict(dense.named_modules())
    gen = torch.Generator().manual_seed(0)
    seen = {"planes": 0, "moe": 0, "small": 0}
    for n, mod in kept.named_modules():
        if isinstance(mod, SparseMoE):
            assert mod.qexperts is not None and mod.qexperts.ready and mod.w13 is None, n
            assert mod.qexperts.w13.kind.name == mod.qexperts.w2.kind.name == kind, n
            assert isinstance(mod.gate.weight, torch.Tensor) and isinstance(mod.shared_expert_gate.weight,
                                                                              torch.Tensor)
            x = torch.randn(5, mod.hidden, generator=gen)
            seen["moe"] += 1
        elif isinstance(mod, Linear) and n != "lm_head" and not n.endswith(("mlp.gate", "shared_expert_gate")):
            segs = mod.gguf_segments
            assert mod.weight is None and isinstance(segs[0].weight, Planes) and segs[0].weight.kind.name == kind, n
            if n.endswith("linear_attn.in_proj"):  # q k v z planes; b / a planes too unless left dense
                assert [type(s.weight) for s in segs[1:]] in ([], [Planes], [torch.Tensor]), n
            x = torch.randn(3, mod.in_features, generator=gen)
            seen["planes"] += 1
        elif isinstance(mod, (torch.nn.Linear, Linear)) and n != "lm_head":  # hyper-connections, PLE, indexer,
            # the router and the shared expert's gate: dense parameters
            assert isinstance(mod.weight, torch.nn.Parameter) and mod.weight.dtype == torch.float32, n
            x = torch.randn(3, mod.in_features, generator=gen)
            seen["small"] += 1
        else:
            continue
        torch.testing.assert_close(mod(x), dense_mods[n](x), rtol=1e-5, atol=1e-5)
    assert seen["moe"] == len(kept.layers) and seen["planes"] >= 2 * len(kept.layers) and seen["small"] > 0
    prompts = [[(7 * i + 3 * j) % 190 + 6 for j in range(n)] for i, n in enumerate((29, 9, 17))]
    outs = []
    for model in (kept, dense):
        h = Harness(model, block_size=4)
        first = h.step([(f"r{i}", p, 0, len(p) - 3) for i, p in enumerate(prompts)])
        rest = [h.step([(f"r{i}", p, len(p) + n, 1) for i, p in enumerate(prompts)]) for n in range(-3, 0)]
        outs.append(torch.cat([torch.cat(first)] + [torch.cat(r) for r in rest]))
    assert outs[1].std() > 0.02
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_small_linears_dequantized_at_load(checkpoint):
    """Where the checkpoint quantized the hyper-connection / PLE / indexer linears, they load as dense parameters
    holding the dequantized weights (the reference model's)."""
    name, path = checkpoint
    if name != "awq-small-quantized":
        pytest.skip("the small linears are quantized in awq-small-quantized only")
    kept, dense = kept_and_dense(path)
    p_kept, p_dense = dict(kept.named_parameters()), dict(dense.named_parameters())
    names = [n for n in p_kept if n.rsplit(".", 2)[-2] in SMALL]
    assert len(names) >= 3 * len(kept.layers)
    for n in names:
        assert torch.equal(p_kept[n], p_dense[n]), n


def test_engine_kept_matches_dequantized(checkpoint, monkeypatch):
    """The engine (16-token budget: chunked prompts beside decode rows) kept quantized against dequantized at load:
    the same greedy tokens and logprobs."""
    import voltllm.config
    from voltllm import LLM, SamplingParams

    _, path = checkpoint
    prompts = [[(7 * i + 3 * j) % 190 + 6 for j in range(n)] for i, n in enumerate((23, 5, 14))]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = []
    for keep in (True, False):
        monkeypatch.setattr(voltllm.config, "_quantized_weights",
                            lambda *a, keep=keep, **k: "quantized" if keep else "dequantized")
        llm = LLM(path, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
        assert llm.engine.runner.keep_quantized == keep
        outs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], sp))
        llm.engine.check_integrity()
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in lb.items():
                assert abs(la[tok].logprob - lp.logprob) < 1e-4
