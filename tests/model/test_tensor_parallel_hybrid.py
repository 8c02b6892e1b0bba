"""Tensor parallelism for a dense hybrid (qwen3_5: Gated DeltaNet + gated attention + dense MLP) on the CPU (gloo):
a tiny fp32 model with -tp 2 against -tp 1 through the offline LLM API (rank 0 in this process, rank 1 a spawned
worker). Each rank holds half of the GDN key / value heads (and their recurrent state), half of the attention heads,
half of the MLP and of the vocabulary; prefix-cache hits resume from recurrent-state snapshots on every rank."""
import random

import pytest
import torch

from tiny_models import HYBRID_VOCAB, full_prompt_logprobs, make_tiny_hybrid
from voltllm import LLM, SamplingParams

_rng = random.Random(3)
_SHARED = [_rng.randrange(HYBRID_VOCAB) for _ in range(17)]  # a common prefix: prefix-cache hits across prompts
PROMPTS = [_SHARED + [_rng.randrange(HYBRID_VOCAB) for _ in range(9)],
           [_rng.randrange(HYBRID_VOCAB) for _ in range(23)],
           _SHARED + [5, 9],
           [7, 8]]
# small blocks, snapshots every 8 tokens and a small token budget: chunked prefill, mixed prefill + decode steps,
# prefix-cache hits restored from snapshots, four requests at once
ENGINE = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=7, max_num_seqs=4, skip_tokenizer_init=True)


def _inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


CASES = {
    # untied head (vocabulary rows split evenly), 2 KV heads: one per rank
    "untied": dict(tie_word_embeddings=False),
    # tied head over a vocabulary that does not divide by 2 (the last rank's shard zero-padded), one KV head:
    # replicated on both ranks
    "tied-kv1": dict(tie_word_embeddings=True, vocab_size=HYBRID_VOCAB + 1, num_key_value_heads=1),
}


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, tmp_path_factory):
    path = make_tiny_hybrid(str(tmp_path_factory.mktemp(request.param)), "qwen3_5", seed=0, gen_seed=1,
                            **CASES[request.param])
    if path is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    one = LLM(path, **ENGINE)
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    yield one, two
    two.engine.shutdown()


def test_logits_match_tp1(engines):
    """Full distributions at every prompt position, batched, chunked prefill (each chunk resumes the state)."""
    one, two = engines
    a, b = full_prompt_logprobs(one, _inputs(PROMPTS)), full_prompt_logprobs(two, _inputs(PROMPTS))
    assert not a.isnan().any() and not b.isnan().any()
    assert torch.allclose(a, b, atol=2e-5, rtol=0), (a - b).abs().max()


def test_greedy_matches_tp1_chunked_and_cached(engines):
    one, two = engines
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in one.generate(_inputs(PROMPTS), params)]
    assert [o.outputs[0].token_ids for o in two.generate(_inputs(PROMPTS), params)] == expected
    snaps = two.engine.runner.state_snapshots
    hits, restored = two.engine.stats().prefix_cache_hits, snaps.num_restored
    warm = two.generate(_inputs(PROMPTS), params)  # again: hits restored from every rank's snapshots
    assert [o.outputs[0].token_ids for o in warm] == expected
    assert two.engine.stats().prefix_cache_hits > hits and snaps.num_restored > restored
    # a prompt that continues a cached one past a boundary (its state comes from a snapshot), alone
    longer = [PROMPTS[0] + expected[0][:6]]
    assert ([o.outputs[0].token_ids for o in two.generate(_inputs(longer), params)]
            == [o.outputs[0].token_ids for o in one.generate(_inputs(longer), params)])
    two.engine.check_integrity()


def test_each_rank_holds_half_the_heads(engines):
    one, two = engines
    r1, r2 = one.engine.runner, two.engine.runner
    assert r2.state_cache.ssm_shape[0] * 2 == r1.state_cache.ssm_shape[0]  # value heads of the recurrent state
    assert r2.state_cache.conv_shape[1] * 2 == r1.state_cache.conv_shape[1]  # conv channels (q, k, v heads)
    # KV heads of the full-attention layers: halved, or the one KV head replicated
    assert r2.kv_caches[0].shape[-2] == max(1, r1.kv_caches[0].shape[-2] // 2)
    attn = [next(m for m in r.model.modules() if type(m).__name__ == "GatedAttention") for r in (r1, r2)]
    assert attn[1].num_heads * 2 == attn[0].num_heads
    g1 = next(m for m in r1.model.modules() if type(m).__name__ == "GatedDeltaNet")
    g2 = next(m for m in r2.model.modules() if type(m).__name__ == "GatedDeltaNet")
    assert (g2.nk * 2, g2.nv * 2) == (g1.nk, g1.nv)
    assert r2.state_snapshots.store.ssm_shape == r2.state_cache.ssm_shape


def test_quantized_checkpoint_dequantized_at_load(tmp_path):
    """An AWQ qwen3_5 checkpoint under TP: dequantized at load (the CPU's policy), then sharded
    (kept quantized: test_tensor_parallel_quantized.py)."""
    from quant_checkpoints import quantized_hybrid

    path = quantized_hybrid(str(tmp_path), "qwen3_5", dict(method="awq"))
    if path is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(_inputs(PROMPTS), params)]
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert two.config.model.quantized_weights == "dequantized"
        assert [o.outputs[0].token_ids for o in two.generate(_inputs(PROMPTS), params)] == expected
    finally:
        two.engine.shutdown()


def test_decode_graph_path_on_every_rank(engines, monkeypatch, tmp_path):
    """The decode CUDA-graph path on both ranks (stood in for on the CPU by eager replays on the same buffers,
    tests/tp_eager_graphs.py): rank 0 uploads its slots for the replay, the worker fills its own slot buffer from the
    step, and both keep the states and snapshots as the eager engine does."""
    import sys

    import tp_eager_graphs

    one, _ = engines
    tp_eager_graphs.worker_env(monkeypatch, tmp_path, sys.path)
    monkeypatch.setattr("voltllm.worker.runner.ModelRunner.capture_cuda_graphs", tp_eager_graphs._capture)
    path = one.config.model.model
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in one.generate(_inputs(PROMPTS), params)]
        for _ in range(2):  # the second round resumes from snapshots
            assert [o.outputs[0].token_ids for o in two.generate(_inputs(PROMPTS), params)] == expected
        assert two.engine.runner.graphs.replays > 0 and two.engine.runner.state_snapshots.num_restored > 0
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()
