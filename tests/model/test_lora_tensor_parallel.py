"""LoRA adapters with tensor parallelism on the CPU (gloo, fp32): `-tp 2 --enable-lora` gives `-tp 1 --enable-lora`'s
greedy tokens, logprobs and prompt distributions for batches mixing adapters and the base model (each rank holds its
cut of every adapter, lora/sharding.py; rank 0's slot choices reach the workers in the step, lora/manager.py), with
the KV heads split or replicated (fewer than the ranks), slots reloaded and adapters read again on the workers, the
decode graphs' replays (CPU stand-ins), and a qwen3_moe's attention and dense-MLP adapters."""
from __future__ import annotations

import sys

import pytest
import torch

from lora_adapters import make_adapter
from tiny_models import make_model
from voltllm import LLM, LoRARequest, SamplingParams

PROMPTS = ["The quick brown fox jumps over", "What is the capital of France? The capital",
           "def add(a, b):\n    return", "Hello world! Voltllm serves language models on old GPUs, fast.",
           "0123456789 0123", "Paris"]
NAMES = ["a1", None, "a2", "a1", None, "a2"]
# a small token budget and blocks: chunked prefill, steps mixing prefill and decode
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, max_num_batched_tokens=16,
              max_num_seqs=6)
ADAPTERS = {"a1": dict(rank=8, alpha=16, seed=1),
            "a2": dict(rank=4, alpha=8, seed=2, rslora=True, targets=("q_proj", "k_proj", "v_proj", "down_proj"))}
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

CASES = {
    "llama-kv-split": ("llama", 2, {}),  # 2 KV heads: one per rank
    "qwen3-kv-replicated": ("qwen3", 2, dict(num_key_value_heads=1)),  # one KV head on both ranks
}


def _setup(root: str, kind: str, **overrides):
    model = make_model(f"{root}/{kind}", kind, **overrides)
    return model, {name: LoRARequest(name, i, make_adapter(f"{root}/{kind}-{name}", model, **kw))
                   for i, (name, kw) in enumerate(ADAPTERS.items(), 1)}


def _run(llm, loras, names=NAMES, params=PARAMS):
    return llm.generate(PROMPTS[:len(names)], params, lora_request=[loras.get(n) for n in names], use_tqdm=False)


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert p.keys() == q.keys()
            assert all(abs(p[t].logprob - q[t].logprob) < 2e-5 for t in p)


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, tmp_path_factory):
    kind, tp, overrides = CASES[request.param]
    model, loras = _setup(str(tmp_path_factory.mktemp(request.param)), kind, **overrides)
    one = LLM(model, **ENGINE)
    two = LLM(model, tensor_parallel_size=tp, **ENGINE)
    yield one, two, loras
    two.engine.shutdown()


def test_mixed_batch_matches_tp1(engines):
    one, two, loras = engines
    a, b = _run(one, loras), _run(two, loras)
    _assert_same(a, b)
    base = _run(one, loras, [None] * len(NAMES))
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in a]  # (the adapters count)
    two.engine.check_integrity()


def test_prompt_distributions_match_tp1(engines):
    """Every prompt position's full distribution (prompt logprobs over the whole vocabulary), batched."""
    one, two, loras = engines
    vocab = one.config.model.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=vocab)
    names = NAMES[:4]
    for x, y in zip(_run(one, loras, names, params), _run(two, loras, names, params)):
        for p, q in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            a = torch.tensor([p[t].logprob for t in range(vocab)])
            b = torch.tensor([q[t].logprob for t in range(vocab)])
            assert torch.allclose(a, b, atol=2e-5, rtol=0), (a - b).abs().max()


def test_removed_and_reloaded_adapters_on_every_rank(engines, tmp_path):
    """remove_lora on a -tp engine (the workers drop it with rank 0's next step), then the adapter's name reloaded with
    other weights under a new id, and the removed LoRARequest used again (read afresh, dropped after): every batch
    matches -tp 1."""
    one, two, loras = engines
    before = _run(two, loras)
    for llm in (one, two):
        assert llm.remove_lora(1) is True and llm.list_loras() == {2}
    model = one.config.model.model
    reloaded = dict(loras, a1=LoRARequest("a1", 9, make_adapter(str(tmp_path / "a1-new"), model, rank=8, alpha=16,
                                                                seed=5)))
    after = _run(two, reloaded)
    _assert_same(_run(one, reloaded), after)
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]
    _assert_same(before, _run(two, loras))  # the removed id 1 again: its old files, read anew
    assert two.list_loras() == {2, 9}
    two.engine.check_integrity()
    for llm in (one, two):  # (as the other tests of these engines expect)
        assert llm.remove_lora(9) is True and llm.add_lora(loras["a1"]) is True


def test_one_slot_reloaded_and_adapters_read_again_on_every_rank(tmp_path):
    """--max-loras 1 --max-cpu-loras 1: adapters take turns in the one slot, and the worker, which keeps only the
    resident one in CPU memory, reads the others again when rank 0 puts them back."""
    model, loras = _setup(str(tmp_path), "llama")
    engine = {**ENGINE, "max_loras": 1, "max_cpu_loras": 1}
    names = ["a1", "a2", None, "a1"]
    one = LLM(model, **engine)
    alone, batch = [_run(one, loras, [n]) for n in names], _run(one, loras, names)
    two = LLM(model, tensor_parallel_size=2, **engine)
    try:
        for name, want in zip(names, alone):  # one after another: a1, a2, a1 again in slot 0
            _assert_same(want, _run(two, loras, [name]))
        _assert_same(batch, _run(two, loras, names))  # and in one batch (a2 waits for a1's requests)
    finally:
        two.engine.shutdown()


def test_four_ranks_kv_heads_replicated_and_cut(tmp_path):
    """tp=4 over 4 query / 2 KV heads: each KV head on two ranks, so k / v's B rows are cut to one head of two."""
    model, loras = _setup(str(tmp_path), "llama")
    names = NAMES[:4]
    expected = _run(LLM(model, **ENGINE), loras, names)
    four = LLM(model, tensor_parallel_size=4, **ENGINE)
    try:
        _assert_same(expected, _run(four, loras, names))
    finally:
        four.engine.shutdown()


def test_decode_graph_replays_on_every_rank(monkeypatch, tmp_path):
    """Decode steps replayed by the decode graphs on both ranks (CPU stand-ins on the same buffers,
    tests/tp_eager_graphs.py): the padded rows' mask is each rank's, filled from rank 0's step."""
    import tp_eager_graphs

    model, loras = _setup(str(tmp_path), "qwen3")
    expected = _run(LLM(model, **ENGINE), loras)
    tp_eager_graphs.worker_env(monkeypatch, tmp_path, sys.path)
    monkeypatch.setattr("voltllm.worker.runner.ModelRunner.capture_cuda_graphs", tp_eager_graphs._capture)
    two = LLM(model, tensor_parallel_size=2, **ENGINE)
    try:
        _assert_same(expected, _run(two, loras))
        assert two.engine.runner.graphs.replays > 0
    finally:
        two.engine.shutdown()


def test_qwen3_moe_attention_and_dense_mlp_adapters(tmp_path):
    """qwen3_moe: adapters on the attention of every layer and on the one dense MLP layer (layer 1), beside the
    sparse layers' experts split by rows."""
    model = make_model(str(tmp_path / "moe"), "qwen3_moe")
    loras = {"a1": LoRARequest("a1", 1, make_adapter(str(tmp_path / "a1"), model, targets=("q_proj", "v_proj",
                                                                                           "o_proj"))),
             "a2": LoRARequest("a2", 2, make_adapter(str(tmp_path / "a2"), model, seed=3, layers=[1],
                                                     targets=("k_proj", "gate_proj", "up_proj", "down_proj")))}
    expected = _run(LLM(model, **ENGINE), loras)
    two = LLM(model, tensor_parallel_size=2, **ENGINE)
    try:
        _assert_same(expected, _run(two, loras))
    finally:
        two.engine.shutdown()
