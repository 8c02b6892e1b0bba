"""Suffix decoding in the engine (CPU, tiny random llama / qwen3 and the qwen3_5 hybrid): greedy outputs are exactly
the ones without speculation, drafts from the request's own loops and from earlier requests' outputs are accepted,
seeded sampled requests speculate beside greedy ones, a finished or aborted request's automaton is dropped, and the
/metrics spec-decode counters count the drafts."""
import pytest

from spec_oracle import TEXT_PROMPTS, run_checked, text_outputs
from tiny_models import HYBRID_VOCAB, make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams

SPEC = {"method": "suffix", "num_speculative_tokens": 6}
PROMPTS = TEXT_PROMPTS


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def path(request, tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp(request.param)), request.param)


_run = text_outputs


@pytest.mark.parametrize("budget", [64, 5])
def test_greedy_outputs_equal_without_speculation(path, budget):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
    ref = _run(LLM(path, **kw), PROMPTS, sp)
    llm = LLM(path, speculative_config=SPEC, **kw)
    assert _run(llm, PROMPTS, sp) == ref
    stats = llm.engine.stats()
    assert stats.extra["spec_accepted_tokens"] > 0  # the tiny models fall into loops that the automata catch
    assert stats.extra["spec_draft_tokens"] >= stats.extra["spec_accepted_tokens"]


def test_an_earlier_requests_output_is_drafted_from_the_cache(path):
    """The same prompt a second time: its output is the first one's, drafted from the cache (the request's own
    tokens alone give far fewer accepted drafts), in fewer steps."""
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    accepted = {}
    for cached in (0, 10):
        llm = LLM(path, block_size=4, speculative_config={**SPEC, "suffix_decoding_max_cached_requests": cached})
        first = _run(llm, PROMPTS[:1], sp)
        before = llm.engine.stats()
        assert _run(llm, PROMPTS[:1], sp) == first
        after = llm.engine.stats()
        accepted[cached] = after.extra["spec_accepted_tokens"] - before.extra["spec_accepted_tokens"]
        assert after.step_counter - before.step_counter <= 1 + 60 - accepted[cached]
    assert accepted[10] >= 40 and accepted[10] > accepted[0]


def test_sampled_requests_speculate_too(path):
    sps = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
           SamplingParams(temperature=0.3, seed=7, max_tokens=48, ignore_eos=True)] * 2
    ref = _run(LLM(path, block_size=4), PROMPTS, sps)
    runs = []
    for _ in range(2):
        llm = LLM(path, block_size=4, speculative_config=SPEC)
        runs.append(_run(llm, PROMPTS, sps))
        assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    assert runs[0] == runs[1]
    assert [runs[0][i] for i in (0, 2)] == [ref[i] for i in (0, 2)]
    assert all(len(t) == 48 for t in runs[0])


def test_finished_and_aborted_requests_drop_their_automata(path):
    from voltllm.engine.types import EngineCoreRequest
    from voltllm.entrypoints.openai.metrics import ServerMetrics

    llm = LLM(path, block_size=4, speculative_config={**SPEC, "suffix_decoding_max_cached_requests": 2})
    core = llm.engine
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    for rid in ("a", "b", "c"):
        core.add_request(EngineCoreRequest(rid, ids, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    reqs = dict(core.scheduler.requests)
    for _ in range(6):
        core.step()
    assert all(r.suffix_state is not None for r in reqs.values())
    core.abort_requests(["b"])
    assert reqs["b"].suffix_state is None
    while core.has_unfinished_requests():
        core.step()
    core.check_integrity()
    assert all(r.suffix_state is None for r in reqs.values())
    cache = core.scheduler.suffix.cache
    assert cache.num_cached == 2 and len(cache.generations) == 2  # three requests, the first one's output out
    # /metrics: the spec-decode counters are the scheduler's, as for n-gram drafts
    from prometheus_client import generate_latest

    text = generate_latest(ServerMetrics("m", core.stats, lambda: True, lambda: 0, max_model_len=64).registry).decode()
    drafts = core.stats().extra["spec_draft_tokens"]
    assert drafts > 0 and f'voltllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {float(drafts)}' \
        in text


def test_hybrid_target_greedy_equals_plain(tmp_path):
    target = make_tiny_hybrid(str(tmp_path / "q35"), "qwen3_5", seed=0, gen_seed=1)
    if target is None:
        pytest.skip("this transformers has no qwen3_5")
    import random

    rng = random.Random(0)
    pat = [rng.randrange(HYBRID_VOCAB) for _ in range(7)]
    prompts = [pat * 4, [rng.randrange(HYBRID_VOCAB) for _ in range(23)], [7, 8]]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = dict(block_size=4, max_num_seqs=4, skip_tokenizer_init=True)
    ref = run_checked(LLM(target, **base), prompts, sp)
    llm = LLM(target, speculative_config={**SPEC, "num_speculative_tokens": 4}, **base)
    assert run_checked(llm, prompts, sp) == ref
    assert llm.engine.stats().extra["spec_accepted_tokens"] > 0
