"""Tensor parallelism for sparse MoE models on the CPU (gloo): qwen3_moe (dense fp32 and AWQ kept quantized) and the
hybrid + MoE families (qwen3_5_moe, qwen3_next: routed experts, a gated shared expert) with -tp 2 against -tp 1
through the offline LLM API (rank 0 in this process, rank 1 a spawned worker). Every rank holds each expert's half of
the intermediate rows (layers/moe.py), or with --enable-expert-parallel half of the experts whole, so the prompt
logprobs over the whole vocabulary and the greedy tokens must equal -tp 1's."""
import random

import pytest
import torch

from quant_checkpoints import quantize_checkpoint
from tiny_models import HYBRID_MOE, HYBRID_VOCAB, full_prompt_logprobs, make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams
from voltllm.model.layers.gguf_planes import Planes
from voltllm.model.layers.moe import SparseMoE

TEXT = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?", "Hi",
        "def add(a, b):\n    return a + b\n# now the quick brown fox"]
_rng = random.Random(7)
IDS = [{"prompt_token_ids": [_rng.randrange(HYBRID_VOCAB) for _ in range(n)]} for n in (21, 6, 13)]
# chunked prefill, mixed prefill + decode steps, several requests per step
LLAMA_ENGINE = dict(block_size=4, max_num_batched_tokens=7, max_num_seqs=8)
HYBRID_ENGINE = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=7, max_num_seqs=4,
                     skip_tokenizer_init=True)


def _qwen3_moe(path, quant=None, moe_inter=128, hidden=128, head_dim=32):
    """8 experts of 128 intermediate rows (64 per rank: whole 64-input plane groups), top 2, layer 1 dense."""
    make_model(path, "qwen3_moe", hidden_size=hidden, head_dim=head_dim, intermediate_size=2 * hidden,
               moe_intermediate_size=moe_inter)
    if quant:
        quantize_checkpoint(path, **quant)
    return path


CASES = {
    "qwen3_moe": (lambda p: _qwen3_moe(p), TEXT, LLAMA_ENGINE),
    "qwen3_moe-awq-kept": (lambda p: _qwen3_moe(p, dict(method="awq")), TEXT, LLAMA_ENGINE),
    # 192 expert rows: an even 96 per rank would cut a 64-input plane group, so rank 0 holds 128 rows and rank 1 64
    # (sharding.intermediate_split; Qwen3-30B-A3B's 768 rows at -tp 4 with groups of 128 are this case)
    "qwen3_moe-awq-kept-uneven": (lambda p: _qwen3_moe(p, dict(method="awq"), moe_inter=192), TEXT, LLAMA_ENGINE),
    # routed experts + sigmoid-gated shared expert; qwen3_next also stores GDN in_proj_qkvz grouped by key head
    "qwen3_5_moe": (lambda p: make_tiny_hybrid(p, "qwen3_5_moe", 0, 1, **HYBRID_MOE), IDS, HYBRID_ENGINE),
    "qwen3_next": (lambda p: make_tiny_hybrid(p, "qwen3_next", 0, 1, **HYBRID_MOE), IDS, HYBRID_ENGINE),
}


def _moe_layers(llm) -> list[SparseMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(case, tmp_path, monkeypatch):
    build, prompts, engine = CASES[case]
    path = build(str(tmp_path))
    if path is None:
        pytest.skip(f"this transformers has no {case} config")
    kept = "-kept" in case
    if kept:  # as on a GPU: the routed experts stay quantized (quant_moe.QuantExperts), each rank cutting its rows
        import voltllm.config

        monkeypatch.setattr(voltllm.config, "_quantized_weights", lambda *a, **k: "quantized")
    one = LLM(path, **engine)
    two = LLM(path, tensor_parallel_size=2, **engine)
    try:
        whole, half = _moe_layers(one), _moe_layers(two)
        assert whole and len(whole) == len(half)
        for a, b in zip(whole, half):  # each rank: half of every expert's and the shared expert's rows
            if case.endswith("-uneven"):  # whole 64-row groups: 2 on rank 0 (this process), 1 on rank 1
                assert (a.inter, b.inter, b.inter_start) == (192, 128, 0) and b.qexperts.w2.k == 128
                continue
            assert b.inter * 2 == a.inter and b.inter_start == 0
            if a.shared_expert is not None:
                assert b.shared_expert.down_proj.in_features * 2 == a.shared_expert.down_proj.in_features
            if kept:
                assert isinstance(b.qexperts.w2, Planes) and b.qexperts.w2.k == a.qexperts.w2.k // 2
        x, y = full_prompt_logprobs(one, prompts), full_prompt_logprobs(two, prompts)
        assert not x.isnan().any() and torch.allclose(x, y, atol=2e-5, rtol=0), (x - y).abs().max()
        params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == expected
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


# --enable-expert-parallel: each rank holds whole routed experts (4 of 8, or 4 / 3 of 7: the first rank one more, as
# vLLM's linear placement), the shared expert still split by rows; the MoE output's partial sums are all-reduced as
# under plain TP, so -tp 2 -ep must equal -tp 1 as closely
EP_CASES = {
    "qwen3_moe": (lambda p: _qwen3_moe(p), TEXT, LLAMA_ENGINE, 8),
    # fp16 (the residual stream fp32, the experts' sums fp16): -tp 2, with or without -ep, rounds its partial sums
    # apart from -tp 1's (max 0.017 nats over these prompts either way, where near-tied greedy tokens may flip), so
    # here the logprobs are held to fp16's spread and the greedy tokens are not compared
    "qwen3_moe-fp16": (lambda p: _qwen3_moe(p), TEXT, dict(LLAMA_ENGINE, dtype="float16"), 8),
    "qwen3_moe-7-experts": (lambda p: make_model(p, "qwen3_moe", hidden_size=128, head_dim=32, intermediate_size=256,
                                                 moe_intermediate_size=96, num_experts=7), TEXT, LLAMA_ENGINE, 7),
    # kept quantized: whole experts' planes (192 rows: plain -tp 2 would split them in whole groups, 128 + 64)
    "qwen3_moe-awq-kept": (lambda p: _qwen3_moe(p, dict(method="awq"), moe_inter=192), TEXT, LLAMA_ENGINE, 8),
    # (FP8's 128 x 128 blocks: attention widths of 256, 128 inputs per rank)
    "qwen3_moe-fp8-kept": (lambda p: _qwen3_moe(p, dict(method="fp8"), hidden=256, head_dim=64), TEXT,
                           LLAMA_ENGINE, 8),
    "qwen3_moe-nvfp4-kept": (lambda p: _qwen3_moe(p, dict(method="modelopt_fp4")), TEXT, LLAMA_ENGINE, 8),
    "qwen3_moe-ct-nvfp4-kept": (lambda p: _qwen3_moe(p, dict(method="compressed-tensors")), TEXT, LLAMA_ENGINE, 8),
    "qwen3_5_moe": (lambda p: make_tiny_hybrid(p, "qwen3_5_moe", 0, 1, **HYBRID_MOE), IDS, HYBRID_ENGINE, 4),
    "qwen3_next": (lambda p: make_tiny_hybrid(p, "qwen3_next", 0, 1, **HYBRID_MOE), IDS, HYBRID_ENGINE, 4),
}


@pytest.mark.parametrize("case", list(EP_CASES))
def test_tp2_expert_parallel_matches_tp1(case, tmp_path, monkeypatch):
    build, prompts, engine, experts = EP_CASES[case]
    path = build(str(tmp_path))
    if path is None:
        pytest.skip(f"this transformers has no {case} config")
    kept = "-kept" in case
    if kept:
        import voltllm.config

        monkeypatch.setattr(voltllm.config, "_quantized_weights", lambda *a, **k: "quantized")
    one = LLM(path, **engine)
    two = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **engine)
    try:
        assert two.config.parallel.enable_expert_parallel
        whole, part = _moe_layers(one), _moe_layers(two)
        assert whole and len(whole) == len(part)
        held = -(-experts // 2)  # rank 0 (this process): experts [0, held)
        for a, b in zip(whole, part):
            assert b.experts_shard.start == 0 and b.num_local_experts == held and b.inter == a.inter
            assert b.expert_map.tolist() == list(range(held)) + [-1] * (experts - held) + [held]
            if a.shared_expert is not None:  # still split by rows
                assert b.shared_expert.down_proj.in_features * 2 == a.shared_expert.down_proj.in_features
            if kept:  # whole experts' planes: rows of `held` experts, every input column
                assert b.w13 is None and b.qexperts.num_experts == held
                assert b.qexperts.w2.n == held * a.hidden and b.qexperts.w2.k == a.qexperts.w2.k
            else:
                assert tuple(b.w13.shape) == (held,) + tuple(a.w13.shape[1:])
                assert torch.equal(b.w13, a.w13[:held]) and torch.equal(b.w2, a.w2[:held])
        fp16 = engine.get("dtype") == "float16"
        x, y = full_prompt_logprobs(one, prompts), full_prompt_logprobs(two, prompts)
        atol = 3e-2 if fp16 else 2e-5
        assert not x.isnan().any() and torch.allclose(x, y, atol=atol, rtol=0), (x - y).abs().max()
        if not fp16:
            params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
            expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
            assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == expected
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()
