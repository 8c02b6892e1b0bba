"""Tensor parallelism over two GPUs (NCCL): -tp 2 against -tp 1 on a tiny qwen3 and a tiny dense hybrid (qwen3_5:
Gated DeltaNet + gated attention) with decode CUDA graphs on (their all-reduces captured), and a killed worker
reported by the engine instead of a hang; speculative decoding (n-gram, draft model) on both, its verifications in
the decode / walks graphs; sparse MoE models (qwen3_moe, qwen3_5_moe). Needs 2 CUDA devices (benchmarks/run_h200.sh
s83tp, kind nvidia-h200-x2); skipped otherwise."""
import os
import signal

import pytest
import torch

from tiny_models import HYBRID_MOE, HYBRID_VOCAB, make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams
from voltllm.distributed.executor import TPWorkerError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PROMPTS = ["The quick brown fox jumps", "What is the capital of France?", "Hi", "0123456789 " * 30]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # one KV head: replicated on both ranks; untied head (qwen3)
    return make_model(str(tmp_path_factory.mktemp("tiny-tp")), "qwen3", max_position_embeddings=2048,
                      num_key_value_heads=1)


def _greedy(llm, n=24):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, min_tokens=n))
    return [o.outputs[0].token_ids for o in outs]


def _prompt_logprobs(llm):
    vocab = llm.config.model.hf_config.vocab_size
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=vocab))
    return torch.tensor([[lp[t].logprob for t in range(vocab)] for o in outs for lp in o.prompt_logprobs[1:]])


def test_tp2_fp32_matches_tp1_with_cuda_graphs(tiny):
    one = LLM(tiny, device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    ref, ref_lp = _greedy(one), _prompt_logprobs(one)
    del one
    two = LLM(tiny, device="cuda", dtype="float32", gpu_memory_utilization=0.3, tensor_parallel_size=2)
    try:
        assert two.engine.runner.graphs is not None  # decode graphs with NCCL all-reduces inside
        assert _greedy(two) == ref
        assert two.engine.runner.graphs.replays > 0
        assert torch.allclose(_prompt_logprobs(two), ref_lp, atol=1e-4, rtol=0)
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


def test_tp2_half_agrees_with_tp1(tiny):
    one = LLM(tiny, device="cuda", dtype="float16", gpu_memory_utilization=0.3)
    ref = _greedy(one)
    del one
    two = LLM(tiny, device="cuda", dtype="float16", gpu_memory_utilization=0.3, tensor_parallel_size=2)
    try:
        got = _greedy(two)
    finally:
        two.engine.shutdown()
    agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
    assert agree >= 0.97, agree  # half precision: the all-reduce sums partial products in another order


def test_killed_worker_is_reported_not_hung(tiny):
    """NCCL does not notice a dead peer by itself: the executor's watchdog aborts the group."""
    two = LLM(tiny, device="cuda", dtype="float16", gpu_memory_utilization=0.3, tensor_parallel_size=2)
    try:
        os.kill(two.engine.tp_workers.procs[0].pid, signal.SIGKILL)
        with pytest.raises(TPWorkerError, match="worker 1"):
            _greedy(two, 64)
    finally:
        two.engine.shutdown()


# -- dense hybrid (qwen3_5) ----------------------------------------------------------------------------------------
_SHARED = [(7 * i + 3) % HYBRID_VOCAB for i in range(40)]
HYBRID_PROMPTS = [{"prompt_token_ids": p} for p in (_SHARED + [1, 2, 3], [(5 * i + 1) % HYBRID_VOCAB for i in range(
    150)], _SHARED + [9], [7, 8])]
# snapshots every 16 tokens: the second round's shared prefix resumes from them on both ranks
HYBRID_ENGINE = dict(device="cuda", gpu_memory_utilization=0.3, skip_tokenizer_init=True, block_size=16,
                     mamba_block_size=16, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    path = make_tiny_hybrid(str(tmp_path_factory.mktemp("tiny-tp-hybrid")), "qwen3_5", seed=0, gen_seed=1,
                            tie_word_embeddings=False)
    if path is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    return path


def _hybrid_greedy(llm, n=24):
    outs = llm.generate(HYBRID_PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _hybrid_prompt_logprobs(llm):
    outs = llm.generate(HYBRID_PROMPTS[:3], SamplingParams(temperature=0, max_tokens=1,
                                                           prompt_logprobs=HYBRID_VOCAB))
    return torch.tensor([[lp[t].logprob for t in range(HYBRID_VOCAB)] for o in outs for lp in o.prompt_logprobs[1:]])


def test_tp2_hybrid_fp32_matches_tp1_with_cuda_graphs_and_snapshots(tiny_hybrid):
    one = LLM(tiny_hybrid, dtype="float32", **HYBRID_ENGINE)
    ref, ref_lp = _hybrid_greedy(one), _hybrid_prompt_logprobs(one)
    del one
    two = LLM(tiny_hybrid, dtype="float32", tensor_parallel_size=2, **HYBRID_ENGINE)
    try:
        assert two.engine.runner.graphs is not None  # hybrid decode graphs (state slots) with NCCL all-reduces
        assert _hybrid_greedy(two) == ref
        assert two.engine.runner.graphs.replays > 0
        restored = two.engine.runner.state_snapshots.num_restored
        assert _hybrid_greedy(two) == ref  # again: prefix hits restored from every rank's snapshots
        assert two.engine.runner.state_snapshots.num_restored > restored
        assert torch.allclose(_hybrid_prompt_logprobs(two), ref_lp, atol=1e-4, rtol=0)
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_tp2_moe_fp32_matches_tp1_with_cuda_graphs(tmp_path, kind, ep):
    """Sparse MoE layers split by every expert's intermediate rows (or, with --enable-expert-parallel, by whole
    experts: local ids from the device expert map, other ranks' pairs skipped): the Triton router, per-pair / grouped
    expert kernels and the fused shared-expert decode launch on each rank's experts, the layer's all-reduce captured
    in the decode graphs."""
    if kind == "qwen3_moe":
        path, greedy, lps, engine = (make_model(str(tmp_path), "qwen3_moe", max_position_embeddings=2048), _greedy,
                                     _prompt_logprobs, dict(device="cuda", gpu_memory_utilization=0.3))
    else:
        path, greedy, lps, engine = (make_tiny_hybrid(str(tmp_path), "qwen3_5_moe", 0, 1, **HYBRID_MOE),
                                     _hybrid_greedy, _hybrid_prompt_logprobs, HYBRID_ENGINE)
        if path is None:
            pytest.skip("this transformers has no Qwen3_5MoeTextConfig")
    one = LLM(path, dtype="float32", **engine)
    ref, ref_lp = greedy(one), lps(one)
    del one
    two = LLM(path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=ep, **engine)
    try:
        assert two.engine.runner.graphs is not None and two.config.parallel.enable_expert_parallel is ep
        assert greedy(two) == ref
        assert two.engine.runner.graphs.replays > 0
        assert torch.allclose(lps(two), ref_lp, atol=1e-4, rtol=0)
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


def test_tp2_hybrid_bf16_agrees_with_tp1(tiny_hybrid):
    one = LLM(tiny_hybrid, dtype="bfloat16", **HYBRID_ENGINE)
    ref = _hybrid_greedy(one)
    del one
    two = LLM(tiny_hybrid, dtype="bfloat16", tensor_parallel_size=2, **HYBRID_ENGINE)
    try:
        got = _hybrid_greedy(two)
    finally:
        two.engine.shutdown()
    agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
    assert agree >= 0.9, agree  # bf16: the all-reduce sums partial products in another order


@pytest.mark.parametrize("method,compat", [("awq", "none"), ("modelopt_fp4", "none"), ("awq", "sm70")])
def test_tp2_kept_quantized_matches_tp1_kept_quantized(tmp_path, method, compat):
    """--quantization METHOD keeps the weights quantized on every rank (the planes cut on group boundaries): fp32,
    -tp 2 against -tp 1 kept quantized (the dequant-GEMM decode rows, dequantize + cuBLAS prompt steps, decode CUDA
    graphs); the same greedy tokens and prompt logprobs up to the all-reduce's summation order."""
    from quant_checkpoints import quantize_checkpoint

    from voltllm.model.layers.gguf_planes import Planes

    path = make_model(str(tmp_path), "qwen3", max_position_embeddings=2048, hidden_size=128, head_dim=32,
                      intermediate_size=256)
    quantize_checkpoint(path, method)
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, quantization=method, compat=compat)
    one = LLM(path, **kw)
    ref, ref_lp = _greedy(one), _prompt_logprobs(one)
    del one
    two = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert two.config.model.quantized_weights == "quantized"
        down = two.engine.runner.model.layers[0].mlp.down_proj.gguf_segments[0].weight
        assert isinstance(down, Planes) and down.k == 128
        assert _greedy(two) == ref
        assert torch.allclose(_prompt_logprobs(two), ref_lp, atol=1e-3, rtol=0)
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("method", ["awq", "modelopt_fp4"])
def test_tp2_expert_parallel_kept_quantized_matches_tp1(tmp_path, method):
    """--enable-expert-parallel with the experts kept quantized: each rank's planes hold its 4 of 8 whole experts; the
    per-pair dequant-GEMM (decode, in the graphs) and the grouped kernel (prompt steps) skip the other ranks' pairs."""
    from quant_checkpoints import quantize_checkpoint

    path = make_model(str(tmp_path), "qwen3_moe", max_position_embeddings=2048, hidden_size=128, head_dim=32,
                      intermediate_size=256, moe_intermediate_size=128)
    quantize_checkpoint(path, method)
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, quantization=method)
    one = LLM(path, **kw)
    ref, ref_lp = _greedy(one), _prompt_logprobs(one)
    del one
    two = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        moe = two.engine.runner.model.layers[0].mlp
        assert moe.qexperts is not None and moe.qexperts.num_experts == 4 and moe.qexperts.inter == 128
        assert _greedy(two) == ref
        assert two.engine.runner.graphs.replays > 0
        assert torch.allclose(_prompt_logprobs(two), ref_lp, atol=1e-3, rtol=0)
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


# -- speculative decoding under TP ---------------------------------------------------------------------------------
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_speculation_fp32_matches_tp1_with_cuda_graphs(tiny, method):
    """Verification steps as decode rows replay the decode graphs on both ranks; a draft model (the target itself:
    every greedy draft accepted) runs unsharded on rank 0 with its own graphs."""
    one = LLM(tiny, device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    ref = _greedy(one, 48)
    del one
    spec = NGRAM if method == "ngram" else {"model": tiny, "num_speculative_tokens": 3}
    two = LLM(tiny, device="cuda", dtype="float32", gpu_memory_utilization=0.3, tensor_parallel_size=2,
              speculative_config=spec)
    try:
        assert _greedy(two, 48) == ref
        assert _greedy(two, 48) == ref  # again: prefix-cache hits, then verification from there
        assert two.engine.runner.graphs.replays > 0
        assert two.engine.stats().extra["spec_accepted_tokens"] > 0
        if method == "draft_model":
            assert two.engine.runner.draft.graphs is not None
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_hybrid_speculation_fp32_matches_tp1_with_verify_graphs(tiny_hybrid, tmp_path, monkeypatch, method):
    """qwen3_5 under TP: verifications replay the walks graphs on both ranks and every rank keeps the checkpoint rows
    of rank 0's accepted counts. Oracle drafts (tests/spec_oracle.py): the tiny random hybrid hardly repeats itself."""
    from spec_oracle import oracle_table, patch_draft_model, patch_ngram

    one = LLM(tiny_hybrid, dtype="float32", **{**HYBRID_ENGINE, "max_num_seqs": 32})
    ref = _hybrid_greedy(one, 40)
    del one
    table = oracle_table([p["prompt_token_ids"] for p in HYBRID_PROMPTS], ref)
    if method == "ngram":
        patch_ngram(monkeypatch, table, HYBRID_VOCAB)
        spec = NGRAM
    else:
        draft = make_model(str(tmp_path / "draft"), "llama", seed=1, num_hidden_layers=1, vocab_size=HYBRID_VOCAB,
                           max_position_embeddings=4096)
        patch_draft_model(monkeypatch, table, HYBRID_VOCAB)
        spec = {"model": draft, "num_speculative_tokens": 3}
    # room for every request's verification rows in one walks graph (4 x 5 rows)
    two = LLM(tiny_hybrid, dtype="float32", tensor_parallel_size=2, speculative_config=spec,
              **{**HYBRID_ENGINE, "max_num_seqs": 32})
    try:
        assert _hybrid_greedy(two, 40) == ref
        assert _hybrid_greedy(two, 40) == ref  # again: snapshot restores, then verification from there
        runner = two.engine.runner
        assert runner.verify_graphs is not None and runner.verify_graphs.replays > 0
        stats = two.engine.stats().extra
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()


def _split_mtp_with_graphs(runner):
    return runner.draft.group is not None and runner.draft.graphs is not None


def test_tp2_mtp_fp32_drafts_equal_reference_with_graphs(tmp_path_factory, monkeypatch):
    """MTP under TP (NCCL): the module is split over both ranks, each running its passes in its own CUDA graphs
    (the all-reduces captured) with the target's vocabulary-parallel embedding and LM head; its fp32 draft logits
    equal the float64 reference and greedy tokens plain decoding's on one GPU."""
    from mtp_models import MTPReference, check_against_reference, make_mtp_target, record_draft_logits

    made = make_mtp_target(tmp_path_factory, "qwen3_5")
    if made is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    path, mtp = made
    one = LLM(path, dtype="float32", **HYBRID_ENGINE)
    ref = _hybrid_greedy(one, 24)
    del one
    seen = record_draft_logits(monkeypatch)
    two = LLM(path, dtype="float32", tensor_parallel_size=2, speculative_config={"method": "mtp",
                                                                               "num_speculative_tokens": 3},
              **HYBRID_ENGINE)
    try:
        got = _hybrid_greedy(two, 24)
        assert got == ref
        assert two.engine.runner.draft.graphs is not None and two.engine.runner.full_vocab is None
        assert two.engine.tp_workers.call_on_workers(_split_mtp_with_graphs) == [True]
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()
    fulls = {tuple(p["prompt_token_ids"]): list(p["prompt_token_ids"]) + list(o) for p, o in zip(HYBRID_PROMPTS, got)}
    assert check_against_reference(MTPReference(path, mtp), seen, fulls, 3, atol=2e-3) > 0
