"""Tensor parallelism for Qwen4-Exp (qwen4_exp_text) on the CPU (gloo): tiny fp32 checkpoints with -tp 2 against
-tp 1 through the offline LLM API (rank 0 in this process, rank 1 a spawned worker). Each rank holds half of the
attention heads, GDN key / value heads, every expert's intermediate rows (or half of the experts whole with
--enable-expert-parallel), the vocabulary, and half of every PLE n-gram table's columns; the hyper-connections and the
QSA indexer are replicated, the raw index keys packed into each rank's narrower KV cache rows. Prompt logprobs over
the whole vocabulary and greedy tokens (chunked prefill, decode batches, QSA past its budget) must equal -tp 1's."""
import random

import pytest
import torch

from tiny_models import (HYBRID_VOCAB, QWEN4_EXP_INDEXER as INDEXER, QWEN4_EXP_PLE as PLE, full_prompt_logprobs,
                         make_tiny_qwen4_exp)
from parallel_checks import assert_matches_one_rank
from voltllm import LLM, SamplingParams

_rng = random.Random(11)
_SHARED = [_rng.randrange(6, HYBRID_VOCAB) for _ in range(17)]
PROMPTS = [{"prompt_token_ids": p} for p in (_SHARED + [_rng.randrange(6, HYBRID_VOCAB) for _ in range(9)],
                                             [_rng.randrange(6, HYBRID_VOCAB) for _ in range(23)],
                                             _SHARED + [5, 9], [7, 8])]
ENGINE = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=7, max_num_seqs=4, skip_tokenizer_init=True)

CASES = {
    # untied head, 2 KV heads (one per rank)
    "plain": (dict(INDEXER), {}),
    # tied head over a vocabulary that does not divide by 2, one KV head (replicated), experts placed whole
    "tied-kv1-ep": (dict(INDEXER, tie_word_embeddings=True, vocab_size=HYBRID_VOCAB + 1, num_key_value_heads=1),
                    dict(enable_expert_parallel=True)),
    # PLE layers (each rank half of every table's columns), sigmoid output gate
    "ple": (dict(INDEXER, **PLE, output_gate_type="sigmoid"), {}),
    # QSA past its budget (contexts of 12 tokens or more take the sparse path) in two indexed layers, whose raw keys
    # share one extra cache's row (-tp 1: 2 KV heads of 32, both at offsets 0 / 32 of plane 0) or take a plane each
    # (-tp 2: one KV head per rank)
    "qsa": (dict(INDEXER, indexer_budget=8, layer_types=["linear_attention", "indexed_attention"] * 2), {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, tmp_path_factory):
    cfg, extra = CASES[request.param]
    path = make_tiny_qwen4_exp(str(tmp_path_factory.mktemp(request.param)), 3, **cfg)
    if path is None:
        pytest.skip("this transformers has no Qwen4-Exp")
    one = LLM(path, **ENGINE)
    two = LLM(path, tensor_parallel_size=2, **ENGINE, **extra)
    yield request.param, one, two
    two.engine.shutdown()


def test_logits_and_greedy_match_tp1(engines):
    """Full distributions at every prompt position (batched, chunked), then 16 greedy tokens (decode batches; QSA's
    sparse path on every rank), then again from the prefix cache (every rank's state snapshots)."""
    _, one, two = engines
    assert_matches_one_rank(one, two, PROMPTS)


def test_each_rank_holds_its_share(engines):
    name, one, two = engines
    m1, m2 = one.engine.runner.model, two.engine.runner.model
    a1, a2 = (next(x.self_attn for x in m.layers if x.kind == "indexed_attention") for m in (m1, m2))
    assert a2.num_heads * 2 == a1.num_heads and a2.num_kv_heads == max(1, a1.num_kv_heads // 2)
    g1, g2 = (next(x.linear_attn for x in m.layers if x.kind == "linear_attention") for m in (m1, m2))
    assert (g2.nk * 2, g2.nv * 2) == (g1.nk, g1.nv)
    r1, r2 = one.engine.runner, two.engine.runner
    assert r2.state_cache.ssm_shape[0] * 2 == r1.state_cache.ssm_shape[0]
    assert r2.kv_caches[0].shape[-2] == a2.num_kv_heads
    for m, r in ((m1, r1), (m2, r2)):  # the attention layers' caches, then the index keys' (raw and pooled)
        assert len(r.kv_caches) == m.num_attention_layers
        assert m.num_attention_layers == m._num_attn + (m.index_store.num_caches if m.qsa else 0)
    assert m2.embed_tokens.weight.shape[0] == -(-m1.vocab_size // 2)
    if m1.layers[0].ple is not None:
        t1, t2 = m1.layers[0].ple.table, m2.layers[0].ple.table
        assert t2.shape == (t1.shape[0], t1.shape[1] // 2)
        assert torch.equal(t2, t1[:, :t2.shape[1]])  # rank 0: the first half of every head's channels
    if name == "qsa":
        # two indexed layers: raw keys then pooled keys, 32 channels each, in rows of 2 x 32 (-tp 1: both layers'
        # raw keys in plane 0, their pooled keys in plane 1) or 1 x 32 (-tp 2: one per plane, two caches)
        assert [x.self_attn.index_slot for x in m1.layers if x.kind == "indexed_attention"] == [
            ((2, 0, 0), (2, 1, 0)), ((2, 0, 32), (2, 1, 32))]
        assert [x.self_attn.index_slot for x in m2.layers if x.kind == "indexed_attention"] == [
            ((2, 0, 0), (3, 0, 0)), ((2, 1, 0), (3, 1, 0))]
    if name.endswith("-ep"):
        assert m2.layers[0].mlp.experts_shard.count == 2


def test_what_stays_refused():
    """GGUF / bitsandbytes checkpoints: refused for Qwen4-Exp with one line; -tp sizes whose
    PLE or QSA cuts do not fit: refused by tensor_parallel_error."""
    from types import SimpleNamespace

    from tiny_models import QWEN4_EXP_COMMON
    from voltllm.config import EngineArgs, _qwen4_exp_unbuilt
    from voltllm.distributed.support import tensor_parallel_error

    cfg = SimpleNamespace(model_type="qwen4_exp_text", **QWEN4_EXP_COMMON, **PLE, **INDEXER)
    assert _qwen4_exp_unbuilt(EngineArgs(model="m", tensor_parallel_size=2), cfg, "awq", None, "generate") is None
    assert _qwen4_exp_unbuilt(EngineArgs(model="m", pipeline_parallel_size=2), cfg, None, None, "generate") is None
    for method in ("gguf", "bitsandbytes"):
        assert method in _qwen4_exp_unbuilt(EngineArgs(model="m"), cfg, method, None, "generate")
    cpu = torch.device("cpu")
    assert tensor_parallel_error(2, cfg, cpu, None, "dequantized") is None
    wide = SimpleNamespace(**{**vars(cfg), "indexer_head_dim": 64})  # a 64-channel key in a rank's 32-channel row
    assert "QSA index keys" in tensor_parallel_error(2, wide, cpu, None, "dequantized")
    narrow = SimpleNamespace(**{**vars(cfg), "ple_embed_dim": 4 * 6})  # 6 channels per n-gram head, -tp 4
    assert "PLE" in tensor_parallel_error(4, SimpleNamespace(**{**vars(narrow), "linear_num_key_heads": 4,
                                                                 "num_key_value_heads": 4}), cpu, None, "dequantized")


def test_awq_kept_quantized_matches_tp1(tmp_path, monkeypatch):
    """An AWQ checkpoint kept quantized (as on a GPU), its PLE key / value and indexer projections quantized too
    (dequantized at load, then cut by table columns): the planes cut by heads / expert rows on each rank; prompt
    logprobs and greedy tokens of -tp 2 equal -tp 1's (PLE and QSA past its budget)."""
    import voltllm.config
    from quant_checkpoints import quantized_qwen4_exp
    from voltllm.model.layers.gguf_planes import Planes

    path = quantized_qwen4_exp(str(tmp_path), dict(method="awq", extra=("key_proj", "value_proj", "index_qk_proj")),
                               **{**INDEXER, **PLE, "indexer_budget": 8})
    if path is None:
        pytest.skip("this transformers has no Qwen4-Exp")
    monkeypatch.setattr(voltllm.config, "_quantized_weights", lambda *a, **k: "quantized")
    one = LLM(path, **ENGINE)
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        model = two.engine.runner.model
        out = model.layers[0].linear_attn.out_proj.gguf_segments[0].weight
        assert isinstance(out, Planes) and out.k == 8 * 16 // 2 and model.layers[0].mlp.qexperts is not None
        a, b = full_prompt_logprobs(one, PROMPTS[:3]), full_prompt_logprobs(two, PROMPTS[:3])
        assert not a.isnan().any() and torch.allclose(a, b, atol=5e-5, rtol=0), (a - b).abs().max()
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)] == expected
    finally:
        two.engine.shutdown()
