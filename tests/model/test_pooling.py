"""Pooling (embedding) engines on a tiny random qwen3 (LLM(runner="pooling")): LAST / MEAN / CLS embeddings against
transformers' AutoModel last hidden state, normalize, matryoshka dimensions, chunked prefill, batching, prefix caching,
preemption, the request's finish (its blocks freed), and one runner per engine."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from tiny_models import make_model
from voltllm import LLM, PoolingParams, SamplingParams
from voltllm.engine.core import InvalidRequestError
from voltllm.engine.types import EngineCoreRequest
from voltllm.pooling.params import PoolingParamsError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# mixed lengths: 1 token, a few, and ~40 (over the 16-token step budget below: chunked prefill)
PROMPTS = ["Hello", "The quick brown fox", "What is the capital of France? The capital of France is Paris. " * 2,
           "def add(a, b):\n    return a + b\n"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="module")
def hidden_states(tiny_path):
    """transformers' final hidden states (after the last norm) per prompt: AutoModel's last_hidden_state."""
    from transformers import AutoModel, AutoTokenizer

    ref = AutoModel.from_pretrained(tiny_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_path)
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            out[p] = ref(torch.tensor([tok.encode(p)])).last_hidden_state[0]
    return out


def _engine(path, **kw):
    return LLM(path, runner="pooling", block_size=4, max_num_batched_tokens=16, **kw)


def _expected(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers(tiny_path, hidden_states, pooling_type):
    """Each pooling type, normalized (the default) and not, chunked over several steps and batched."""
    llm = _engine(tiny_path, pooler_config={"pooling_type": pooling_type})
    assert llm.config.model.runner == "pooling" and llm.config.model.pooler.pooling_type == pooling_type
    normed = llm.embed(PROMPTS, use_tqdm=False)
    raw = llm.embed(PROMPTS, pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    for p, a, b in zip(PROMPTS, normed, raw):
        want = _expected(hidden_states[p], pooling_type)
        assert a.finished and len(a.outputs.embedding) == want.numel() == a.outputs.hidden_size
        torch.testing.assert_close(torch.tensor(b.outputs.embedding), want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), F.normalize(want, dim=-1), atol=2e-5, rtol=1e-4)
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0


def test_normalize_default_from_pooler_config_and_use_activation(tiny_path, hidden_states):
    llm = _engine(tiny_path, pooler_config={"normalize": False})
    p = PROMPTS[1]
    want = _expected(hidden_states[p], "LAST")
    plain = llm.encode(p, use_tqdm=False)[0]
    assert plain.outputs.data.dtype == torch.float32
    torch.testing.assert_close(plain.outputs.data, want, atol=2e-5, rtol=1e-4)
    normed = llm.embed(p, pooling_params=PoolingParams(use_activation=True), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(normed.outputs.embedding), F.normalize(want, dim=-1), atol=2e-5, rtol=1e-4)


def test_one_step_pools_a_mixed_batch_without_sampling(tiny_path, monkeypatch):
    """Several pooling requests of different lengths in one step; no step asks the sampler for anything."""
    llm = LLM(tiny_path, runner="pooling", block_size=4)
    runner = llm.engine.runner
    sizes = []
    launch = runner.launch_forward
    monkeypatch.setattr(runner, "launch_forward", lambda sched: sizes.append(len(sched.scheduled)) or launch(sched))

    def no_sampling(*args, **kwargs):
        raise AssertionError("a pooling step sampled")

    monkeypatch.setattr(runner.sampler, "sample", no_sampling)
    monkeypatch.setattr(runner.sampler, "sample_argmax", no_sampling)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert sizes == [len(PROMPTS)]
    assert [len(o.outputs.embedding) for o in outs] == [64] * len(PROMPTS)


def test_the_request_finishes_with_its_embedding_and_frees_its_blocks(tiny_path):
    llm = _engine(tiny_path)
    core = llm.engine
    ids = llm.get_tokenizer().encode(PROMPTS[2])  # 40 tokens: three steps of 16
    core.add_request(EngineCoreRequest("r", ids, None, pooling_params=PoolingParams(normalize=True)))
    outputs, steps = [], 0
    while not outputs:
        outputs = core.step()
        steps += 1
        if not outputs:
            assert core.kv.usage() > 0.0
    (out,) = outputs
    assert out.request_id == "r" and out.finish_reason == "stop" and out.new_token_ids == []
    assert out.pooled.shape == (64,) and abs(out.pooled.norm().item() - 1.0) < 1e-5
    assert steps >= 3  # chunked
    assert core.kv.usage() == 0.0 and not core.scheduler.requests and not core.has_unfinished_requests()
    core.check_integrity()


def test_last_pooling_keeps_prefix_caching_and_computes_the_last_token(tiny_path, hidden_states):
    llm = _engine(tiny_path)
    assert llm.config.cache.enable_prefix_caching
    tok = llm.get_tokenizer()
    p = PROMPTS[2]
    ids = tok.encode(p)
    cut = ids[: len(ids) // 4 * 4]  # a whole number of blocks: every block but the last token's could hit
    first = llm.encode([p, {"prompt_token_ids": cut}], use_tqdm=False)
    again = llm.encode([p, {"prompt_token_ids": cut}], use_tqdm=False)
    assert again[0].num_cached_tokens > 0 and again[1].num_cached_tokens == len(cut) - 4
    for a, b in zip(first, again):
        torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(again[0].outputs.data, F.normalize(hidden_states[p][-1], dim=-1), atol=2e-5,
                               rtol=1e-4)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_turn_prefix_caching_off(tiny_path, pooling_type, caplog):
    with caplog.at_level("INFO", logger="voltllm"):
        llm = _engine(tiny_path, pooler_config={"pooling_type": pooling_type})
    assert not llm.config.cache.enable_prefix_caching and not llm.engine.kv.enable_caching
    assert f"prefix caching is off: {pooling_type} pooling" in caplog.text
    llm.embed([PROMPTS[2]] * 2, use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits == 0


def test_preemption_mid_prompt_gives_the_same_mean_embedding(tiny_path):
    """8 blocks of 4 tokens: the second prompt's first chunk runs beside the first's last, then finds no block for its
    next chunk while the first still holds its blocks (async scheduling): it is preempted and its sum starts over."""
    free = _engine(tiny_path, pooler_config={"pooling_type": "MEAN"})
    ids = free.get_tokenizer().encode(PROMPTS[2] * 2)
    prompts = [{"prompt_token_ids": ids[:20]}, {"prompt_token_ids": ids[20:40]}, {"prompt_token_ids": ids[5:25]}]
    free = free.embed(prompts, use_tqdm=False)
    tight = _engine(tiny_path, pooler_config={"pooling_type": "MEAN"}, num_gpu_blocks_override=8)
    squeezed = tight.embed(prompts, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    for a, b in zip(free, squeezed):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding), atol=1e-6,
                                   rtol=1e-6)
    tight.engine.check_integrity()
    assert tight.engine.kv.usage() == 0.0


def test_dimensions_on_a_matryoshka_model(tiny_path, hidden_states):
    llm = _engine(tiny_path, hf_overrides={"is_matryoshka": True})
    p = PROMPTS[1]
    want = hidden_states[p][-1]
    outs = llm.embed([p, p, p], pooling_params=[PoolingParams(dimensions=16), PoolingParams(),
                                                 PoolingParams(dimensions=8, normalize=False)], use_tqdm=False)
    torch.testing.assert_close(torch.tensor(outs[0].outputs.embedding), F.normalize(want[:16], dim=-1), atol=2e-5,
                               rtol=1e-4)
    assert len(outs[1].outputs.embedding) == 64
    torch.testing.assert_close(torch.tensor(outs[2].outputs.embedding), want[:8], atol=2e-5, rtol=1e-4)
    with pytest.raises(PoolingParamsError, match="greater than 0"):
        llm.embed(p, pooling_params=PoolingParams(dimensions=0), use_tqdm=False)
    with pytest.raises(PoolingParamsError, match="have 64 values"):
        llm.embed(p, pooling_params=PoolingParams(dimensions=65), use_tqdm=False)
    listed = _engine(tiny_path, hf_overrides={"matryoshka_dimensions": [16, 32]}, pooler_config={"dimensions": 32})
    assert len(listed.embed(p, use_tqdm=False)[0].outputs.embedding) == 32  # the pooler's default
    with pytest.raises(PoolingParamsError, match=r"\[16, 32\] only, got 8"):
        listed.embed(p, pooling_params=PoolingParams(dimensions=8), use_tqdm=False)


def test_dimensions_refused_without_matryoshka(tiny_path):
    llm = _engine(tiny_path)
    with pytest.raises(PoolingParamsError, match="does not support matryoshka"):
        llm.embed(PROMPTS[0], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_truncation_and_the_context_limit(tiny_path, hidden_states):
    llm = _engine(tiny_path, max_model_len=48)
    tok = llm.get_tokenizer()
    p = PROMPTS[2]
    ids = tok.encode(p)
    out = llm.embed(p, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-10:]
    full = llm.embed({"prompt_token_ids": (ids * 2)[:48]}, use_tqdm=False)[0]  # exactly the context: accepted
    assert len(full.prompt_token_ids) == 48
    with pytest.raises(InvalidRequestError, match="49 tokens, more than the maximum context length"):
        llm.embed({"prompt_token_ids": (ids * 2)[:49]}, use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed(p, truncate_prompt_tokens=49, use_tqdm=False)


def test_one_runner_per_engine(tiny_path):
    pooling = _engine(tiny_path)
    with pytest.raises(ValueError, match=r"LLM.generate\(\) is for generative models.*runner='generate'"):
        pooling.generate("hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"LLM.chat\(\) is for generative models"):
        pooling.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="pooling .* generates nothing"):
        pooling.engine.add_request(EngineCoreRequest("g", [1, 2], SamplingParams(max_tokens=2)))
    generate = LLM(tiny_path, block_size=4)
    assert generate.config.model.runner == "generate" and generate.config.model.pooler is None
    with pytest.raises(ValueError, match=r"LLM.embed\(\) is for pooling \(embedding\) models.*runner='pooling'"):
        generate.embed("hi")
    with pytest.raises(InvalidRequestError, match="computes no embeddings"):
        generate.engine.add_request(EngineCoreRequest("e", [1, 2], None, pooling_params=PoolingParams(normalize=True)))
    with pytest.raises(PoolingParamsError, match="task 'classify': model .* is an embedding model"):
        pooling.encode("hi", pooling_task="classify")
    with pytest.raises(ValueError, match="token-level pooling is not built"):
        pooling.encode("hi", pooling_task="token_embed")
    with pytest.raises(ValueError, match=r"LLM.score\(\) is for pooling \(embedding\) models"):
        generate.score("a", "b")


def test_an_encoder_checkpoint_without_lm_head_runs_as_pooling(tmp_path, hidden_states, tiny_path):
    """A checkpoint saved as Qwen3Model (no lm_head, untied): --runner auto picks pooling from the architecture's
    name, as vLLM does, and the model is built without a head."""
    from transformers import AutoModel

    enc = tmp_path / "encoder"
    AutoModel.from_pretrained(tiny_path, dtype=torch.float32).save_pretrained(enc)
    for f in os.listdir(tiny_path):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            (enc / f).write_bytes(open(os.path.join(tiny_path, f), "rb").read())
    assert json.loads((enc / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = LLM(str(enc), block_size=4)
    assert llm.config.model.runner == "pooling"
    assert llm.engine.runner.model.lm_head is None
    out = llm.embed(PROMPTS[1], use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(hidden_states[PROMPTS[1]][-1], dim=-1),
                               atol=2e-5, rtol=1e-4)


def test_sentence_transformers_files_choose_the_pooler(tmp_path, hidden_states, tiny_path):
    """modules.json with a Pooling module: --runner auto is pooling, the pooling mode comes from its config.json, and
    without a Normalize module the embeddings are not normalized (vLLM's reading)."""
    import shutil

    st = tmp_path / "st"
    shutil.copytree(tiny_path, st)
    (st / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (st / "1_Pooling").mkdir()
    (st / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                              "pooling_mode_cls_token": False,
                                                              "pooling_mode_mean_tokens": True}))
    llm = LLM(str(st), block_size=4)
    pooler = llm.config.model.pooler
    assert llm.config.model.runner == "pooling" and (pooler.pooling_type, pooler.normalize) == ("MEAN", False)
    out = llm.embed(PROMPTS[2], use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), hidden_states[PROMPTS[2]].mean(0), atol=2e-5,
                               rtol=1e-4)


def test_tensor_parallel_pooling_matches_one_rank(tiny_path):
    """-tp 2 on the CPU (gloo): rank 0 pools the whole final hidden state (every rank has it after the last
    all-reduce); the other rank computes no logits for a pooling step. LLM.score on it: the cosine of two
    embeddings, one rank's."""
    one = _engine(tiny_path, pooler_config={"pooling_type": "MEAN"})
    two = _engine(tiny_path, pooler_config={"pooling_type": "MEAN"}, tensor_parallel_size=2)
    try:
        for a, b in zip(one.embed(PROMPTS, use_tqdm=False), two.embed(PROMPTS, use_tqdm=False)):
            torch.testing.assert_close(torch.tensor(b.outputs.embedding), torch.tensor(a.outputs.embedding),
                                       atol=2e-5, rtol=1e-4)
        for args in ((PROMPTS[0], PROMPTS[1:]), (PROMPTS[:2], PROMPTS[2:])):  # 1:N and N:N
            want = [o.outputs.score for o in one.score(*args, use_tqdm=False)]
            got = [o.outputs.score for o in two.score(*args, use_tqdm=False)]
            assert len(got) == len(args[1]) and len(set(got)) == len(got)  # (distinct pairs, distinct scores)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-6, rtol=1e-5)
    finally:
        two.engine.shutdown()
