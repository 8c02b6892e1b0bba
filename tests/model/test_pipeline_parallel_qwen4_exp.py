"""Pipeline parallelism for Qwen4-Exp (qwen4_exp_text) on the CPU (gloo): tiny fp32 checkpoints of 4 layers
(linear / indexed attention alternating: each stage holds one of each) with -pp 2 against -pp 1 through the offline
LLM API (rank 0 in this process, stage 1 a spawned worker). The hand-over is the hyper-connection streams h
[T, hc * H]; rank 0 applies the final mixer and the LM head to the last stage's h. Each stage keeps its own PLE state
(its layers' conv rows, its own copy of the n-gram context, advanced from the broadcast ids) and its own QSA index
keys. Prompt logprobs over the whole vocabulary and greedy tokens (chunked prefill, decode batches, QSA past its
budget, prefix-cache hits) must equal -pp 1's."""
import random

import pytest
import torch

from tiny_models import (HYBRID_VOCAB, QWEN4_EXP_COMMON, QWEN4_EXP_INDEXER as INDEXER, QWEN4_EXP_PLE as PLE,
                         full_prompt_logprobs, make_tiny_qwen4_exp)
from parallel_checks import assert_matches_one_rank
from voltllm import LLM, SamplingParams
from voltllm.distributed.pipeline import PipelineStage

_rng = random.Random(13)
_SHARED = [_rng.randrange(6, HYBRID_VOCAB) for _ in range(17)]
PROMPTS = [{"prompt_token_ids": p} for p in (_SHARED + [_rng.randrange(6, HYBRID_VOCAB) for _ in range(9)],
                                             [_rng.randrange(6, HYBRID_VOCAB) for _ in range(23)],
                                             _SHARED + [5, 9], [7, 8])]
ENGINE = dict(block_size=4, mamba_block_size=8, max_num_batched_tokens=7, max_num_seqs=4, skip_tokenizer_init=True)
ALTERNATING = dict(layer_types=["linear_attention", "indexed_attention"] * 2)

CASES = {
    # untied head
    "plain": dict(INDEXER, **ALTERNATING),
    # PLE on layers 0 (stage 0) and 2 (stage 1): each stage its own conv rows and n-gram context
    "ple": dict(INDEXER, **PLE, **ALTERNATING, output_gate_type="sigmoid"),
    # QSA past its budget (contexts of 12 tokens or more take the sparse path) on both stages, PLE on stage 1 alone
    # (rank 0 keeps no PLE state), tied head
    "qsa": dict(INDEXER, **dict(PLE, ple_layer_ids=[3]), **ALTERNATING, indexer_budget=8, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, tmp_path_factory):
    path = make_tiny_qwen4_exp(str(tmp_path_factory.mktemp(request.param)), 5, **CASES[request.param])
    if path is None:
        pytest.skip("this transformers has no Qwen4-Exp")
    one = LLM(path, **ENGINE)
    two = LLM(path, pipeline_parallel_size=2, **ENGINE)
    yield request.param, one, two
    two.engine.shutdown()


def test_logits_and_greedy_match_pp1(engines):
    """Full distributions at every prompt position (batched, chunked), then 16 greedy tokens (decode batches), then
    again from the prefix cache (every stage's state snapshots, PLE state included)."""
    _, one, two = engines
    assert_matches_one_rank(one, two, PROMPTS)


def test_perturbed_hand_over_is_caught(engines, monkeypatch):
    """The comparison can fail: rank 0 taking the last stage's first stream for all of them (as a hand-over of the
    hidden state alone would) moves the logits far past the tolerance (the tiny model's distributions are nearly
    flat: 20 times it)."""
    _, one, two = engines
    a = full_prompt_logprobs(one, PROMPTS[:2])
    real = PipelineStage.pass_on_stream

    def first_stream(self, h):
        out = real(self, h)
        return out[:, :QWEN4_EXP_COMMON["hidden_size"]].repeat(1, QWEN4_EXP_COMMON["hc_count"])

    monkeypatch.setattr(PipelineStage, "pass_on_stream", first_stream)
    b = full_prompt_logprobs(two, PROMPTS[:2])
    assert (a - b).abs().max() > 20 * 5e-5


def test_each_stage_holds_its_layers(engines):
    """Rank 0: layers 0-1, the embedding, final mixer and LM head, the KV caches of its attention layer (and its
    index keys), its own PLE state rows (none where its layers have no PLE)."""
    name, one, two = engines
    m1, m0 = one.engine.runner.model, two.engine.runner.model
    runner = two.engine.runner
    assert (runner.pp.start, runner.pp.end) == (0, 2) and len(m0.layers) == 2 and len(m1.layers) == 4
    assert m0.embed_tokens is not None and m0.hyper_connection_mixer is not None
    assert len(runner.kv_caches) == m0.num_attention_layers == 1 + (m0.index_store.num_caches if m0.qsa else 0)
    assert runner.state_cache.ssm_shape == one.engine.runner.state_cache.ssm_shape  # (one GDN layer vs two)
    extras = runner.state_cache.extra
    if name == "ple":  # layer 0 of the model's two PLE layers: row 0 here, its hash by PLE index 0
        assert extras["ple_conv"].shape[1] == 1 and m0.layers[0].ple_row == m0.layers[0].ple_index == 0
    else:
        assert "ple_conv" not in extras and "ple_ctx" not in extras
    assert len(two.engine.tp_workers.procs) == 1


def test_stages_of_two_tensor_parallel_ranks(tmp_path):
    """-tp 2 -pp 2 (four ranks): each stage's layers split over its two ranks (PLE tables by columns), every rank
    handing its replicated streams to its peer of the next stage."""
    path = make_tiny_qwen4_exp(str(tmp_path), 5, **CASES["ple"])
    if path is None:
        pytest.skip("this transformers has no Qwen4-Exp")
    prompts = PROMPTS[:3]
    one = LLM(path, **ENGINE)
    a = full_prompt_logprobs(one, prompts)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    four = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    try:
        runner = four.engine.runner
        assert runner.tp.size == 2 and runner.pp.size == 2 and len(four.engine.tp_workers.procs) == 3
        b = full_prompt_logprobs(four, prompts)
        assert torch.allclose(a, b, atol=5e-5, rtol=0), (a - b).abs().max()
        assert [o.outputs[0].token_ids for o in four.generate(prompts, params)] == expected
    finally:
        four.engine.shutdown()


def test_what_stays_refused():
    """A stage without an attention layer (or without a Gated DeltaNet layer), LoRA under -pp: one line each; images
    are taken."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("this transformers has no Qwen4-Exp")
    from types import SimpleNamespace

    from voltllm.config import EngineArgs, _qwen4_exp_unbuilt
    from voltllm.distributed.support import pipeline_parallel_error

    cpu = torch.device("cpu")
    args = EngineArgs(model="m", pipeline_parallel_size=2)
    default = transformers.Qwen4ExpTextConfig(**QWEN4_EXP_COMMON, **INDEXER)  # attention at layer 3 alone
    assert "stage 0 (layers 0-1) would hold no full-attention layer" in pipeline_parallel_error(
        args, default, None, "generate", cpu)
    ok = transformers.Qwen4ExpTextConfig(**QWEN4_EXP_COMMON, **INDEXER, **ALTERNATING)
    assert pipeline_parallel_error(args, ok, None, "generate", cpu) is None
    assert _qwen4_exp_unbuilt(args, ok, None, None, "generate") is None
    vl = SimpleNamespace(model_type="qwen4_exp", vision_config=SimpleNamespace(), text_config=ok,
                         get_text_config=lambda: ok)
    assert _qwen4_exp_unbuilt(args, vl, None, None, "generate") is None  # (images: test_qwen4_exp_image_input.py)
    assert _qwen4_exp_unbuilt(EngineArgs(model="m"), vl, None, None, "generate") is None
    assert "LoRA (--enable-lora) under pipeline parallelism" in _qwen4_exp_unbuilt(
        EngineArgs(model="m", pipeline_parallel_size=2, enable_lora=True), ok, None, None, "generate")
