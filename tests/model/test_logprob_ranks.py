"""The offline API's Logprob.rank on a tiny model: a sampled or prompt token's rank in the whole vocabulary, also
outside the top-N asked for, against transformers' full logits of the same sequence; and the logprobs of tokens a
speculative verification emits (accepted drafts, the correction, the token after them), greedy and sampled, host and
device drafts."""
import pytest
import torch

from tiny_models import make_model
from voltllm import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "What is the capital of France? The capital of", "def add(a, b):"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "llama", max_position_embeddings=256)


@pytest.fixture(scope="module")
def llm(tiny_path):  # 8-token budget: prompts in chunks, decode rows beside them
    return LLM(tiny_path, block_size=4, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def ref(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


def _full_logprobs(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _rank(row: torch.Tensor, token: int) -> int:
    return int((row >= row[token]).sum())


@pytest.mark.parametrize("num_logprobs", [0, 1])
def test_sampled_token_ranks_match_full_logits(llm, ref, num_logprobs):
    params = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=11, logprobs=num_logprobs)
    outside = 0
    for out in llm.generate(PROMPTS, params):
        c, n = out.outputs[0], len(out.prompt_token_ids)
        full = _full_logprobs(ref, out.prompt_token_ids + c.token_ids)
        for j, (tid, pos) in enumerate(zip(c.token_ids, c.logprobs)):
            row = full[n + j - 1]
            assert list(pos)[0] == tid and len(pos) <= num_logprobs + 1
            assert pos[tid].rank == _rank(row, tid)
            assert pos[tid].logprob == pytest.approx(row[tid].item(), abs=1e-4)
            if num_logprobs:
                assert pos[int(row.argmax())].rank == 1
            outside += pos[tid].rank > num_logprobs
    assert outside >= 5  # the hot temperature samples well outside the top-N


def test_prompt_token_ranks_match_full_logits(llm, ref):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    outside = 0
    for out in outs:
        ids = out.prompt_token_ids
        full = _full_logprobs(ref, ids)
        assert out.prompt_logprobs[0] is None
        for p in range(1, len(ids)):
            pos, row = out.prompt_logprobs[p], full[p - 1]
            assert pos[ids[p]].rank == _rank(row, ids[p])
            assert pos[int(row.argmax())].rank == 1
            outside += pos[ids[p]].rank > 1
        # greedy: the sampled token is the argmax
        assert out.outputs[0].token_ids[0] == int(_full_logprobs(ref, ids)[-1].argmax())
    assert outside >= 5


def test_ranks_beside_speculating_requests(tiny_path, ref):
    """Under speculative decoding a request with logprobs speculates too (its logprobs are the verification rows'):
    its ranks are the same as without speculation."""
    spec = LLM(tiny_path, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    prompt = "0123456789 0123456789 0123456789 0123"
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=3, logprobs=1)]
    outs = spec.generate([prompt, prompt], params)
    assert spec.engine.stats().extra["spec_draft_tokens"] > 0
    c, n = outs[1].outputs[0], len(outs[1].prompt_token_ids)
    full = _full_logprobs(ref, outs[1].prompt_token_ids + c.token_ids)
    ranks = [pos[tid].rank for tid, pos in zip(c.token_ids, c.logprobs)]
    assert ranks == [_rank(full[n + j - 1], tid) for j, tid in enumerate(c.token_ids)]
    assert max(ranks) > 1


def _check_against_full(ref, out, num_logprobs):
    """Every emitted token's logprob, rank and top-N against transformers' full logits of the sequence."""
    c, n = out.outputs[0], len(out.prompt_token_ids)
    assert len(c.logprobs) == len(c.token_ids)
    full = _full_logprobs(ref, out.prompt_token_ids + c.token_ids)
    for j, (tid, pos) in enumerate(zip(c.token_ids, c.logprobs)):
        row = full[n + j - 1]
        assert list(pos)[0] == tid and pos[tid].rank == _rank(row, tid)
        assert pos[tid].logprob == pytest.approx(row[tid].item(), abs=1e-4)
        top = row.topk(num_logprobs)
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert pos[t].rank == r and pos[t].logprob == pytest.approx(v, abs=1e-4)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_steps_give_every_emitted_tokens_logprobs(tiny_path, tmp_path, ref, method):
    """Greedy and seeded sampled requests with logprobs that speculate: each emitted token (accepted drafts, the
    correction of a rejected one, the token after the drafts) gets its own entry, equal to transformers' full
    logits; greedy ones equal a plain engine's entries. A draft model that is the target itself (device drafts,
    greedy ones all accepted: several tokens per step) and n-gram drafts (host-side, rejected here: the correction's
    entry)."""
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    else:
        spec = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3}
    prompts = ["0123456789 0123456789 0123456789 0123", "The quick brown fox jumps over the lazy dog. The quick"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    outs = llm.generate(prompts, greedy)
    stats = llm.engine.stats().extra
    assert stats["spec_draft_tokens"] > 0
    assert (stats["spec_accepted_tokens"] > 0) if method == "draft_model" else (
        stats["spec_accepted_tokens"] < stats["spec_draft_tokens"])
    plain = LLM(tiny_path, block_size=4).generate(prompts, greedy)
    for out, want in zip(outs, plain):
        _check_against_full(ref, out, 2)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        for got, exp in zip(out.outputs[0].logprobs, want.outputs[0].logprobs):
            assert list(got) == list(exp) and all(got[t].rank == exp[t].rank for t in got)
    sampled = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=5, logprobs=3)
    before = llm.engine.stats().extra["spec_draft_tokens"]
    for out in llm.generate(prompts, sampled):
        _check_against_full(ref, out, 3)
    assert llm.engine.stats().extra["spec_draft_tokens"] > before



@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_penalized_requests_speculate_and_keep_plain_tokens(tiny_path, method):
    """Requests with repetition / frequency / presence penalties speculate: each verification row's distribution
    counts the request's generated ids and the drafts before the row, so greedy tokens (and logprobs) equal a plain
    engine's; the draft model (the target itself, no penalties) proposes unpenalized argmaxes, partly rejected, and
    n-gram drafts repeat what the penalties push away."""
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    else:
        spec = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3}
    prompts = ["0123456789 0123456789 0123456789 0123", "The quick brown fox jumps over the lazy dog. The quick"]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, logprobs=1),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.4,
                             presence_penalty=0.6)]
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats().extra
    assert stats["spec_draft_tokens"] > 0
    if method == "draft_model":
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    plain = LLM(tiny_path, block_size=4).generate(prompts, params)
    for out, want in zip(outs, plain):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    for got, exp in zip(outs[0].outputs[0].logprobs, plain[0].outputs[0].logprobs):
        assert list(got) == list(exp)
    sampled = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=2, presence_penalty=1.0)
    first = llm.generate(prompts, sampled)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)]
    llm.engine.check_integrity()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_min_tokens_and_allowed_ids_requests_speculate_and_keep_plain_tokens(tiny_path, method):
    """min_tokens (its stop token banned before the minimum) and allowed_token_ids requests speculate: the
    verification applies both to each row (row j counts j more generated tokens), so a draft they exclude is
    rejected and greedy tokens equal a plain engine's. The stop token is one the model emits early without the ban,
    and the self-draft proposes it (the drafter applies no ban)."""
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    else:
        spec = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3}
    prompts = ["0123456789 0123456789 0123456789 0123", "The quick brown fox jumps over the lazy dog. The quick"]
    plain_llm = LLM(tiny_path, block_size=4)
    free = plain_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stops = [o.outputs[0].token_ids[2] for o in free]
    allowed = sorted(set(free[1].outputs[0].token_ids) | set(range(40, 60)))
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stops[0]], min_tokens=12),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed)]
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    plain = plain_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert len(outs[0].outputs[0].token_ids) >= 12 and set(outs[1].outputs[0].token_ids) <= set(allowed)
    llm.engine.check_integrity()
