"""repetition_detection offline on a tiny random model whose greedy outputs fall into loops (runs of one token and
longer cycles): each request ends, with finish_reason "repetition" and stop_reason "repetition_detected", on the first
token at which its plain greedy output's tail is a pattern of min..max tokens repeated min_count times (vLLM's rule,
written out here), with async scheduling on and off and with n-gram speculation (whose accepted drafts run through
the loops several tokens a step: the run is cut at the repeating token)."""
import pytest

from tiny_models import make_model
from voltllm import LLM, RepetitionDetectionParams, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "What is the capital of France?", "Hello world! Voltllm", "0123456789 0123"]
MAX_TOKENS = 60
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CASES = [RepetitionDetectionParams(max_pattern_size=1, min_pattern_size=1, min_count=5),
         RepetitionDetectionParams(max_pattern_size=8, min_pattern_size=2, min_count=2),
         RepetitionDetectionParams(max_pattern_size=6, min_pattern_size=3, min_count=2)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="module")
def plain(tiny_path):
    outs = LLM(tiny_path, block_size=4).generate(PROMPTS, _greedy())
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["async", "sync", "ngram"])
def llm(request, tiny_path):
    kw = dict(block_size=4, max_num_batched_tokens=64)
    if request.param == "ngram":
        kw["speculative_config"] = SPEC
    return LLM(tiny_path, async_scheduling=request.param != "sync", **kw)


def _greedy(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw})


def _repeats(tokens, rd: RepetitionDetectionParams) -> bool:
    n = len(tokens)
    return any(n >= p * rd.min_count and tokens[n - p * rd.min_count:] == tokens[n - p:] * rd.min_count
               for p in range(max(1, rd.min_pattern_size), rd.max_pattern_size + 1))


def _expected(tokens, rd, min_tokens=0):
    """(output, finish_reason) under vLLM's rule: the first token, from min_tokens on, where the tail repeats; on
    the max_tokens-th token the length comes first (as in vLLM's check_stop)."""
    for i in range(max(min_tokens, 1), len(tokens)):
        if _repeats(tokens[:i], rd):
            return tokens[:i], "repetition"
    return tokens, "length"


def test_requests_stop_at_the_first_repeated_pattern(llm, plain):
    stopped = 0
    for rd in CASES:
        outs = llm.generate(PROMPTS, _greedy(repetition_detection=rd))
        for o, ref in zip(outs, plain):
            c = o.outputs[0]
            want, reason = _expected(ref, rd)
            assert (c.token_ids, c.finish_reason) == (want, reason), rd
            assert c.stop_reason == ("repetition_detected" if reason == "repetition" else None)
            stopped += reason == "repetition" and len(want) < MAX_TOKENS
    assert stopped >= 6  # (the loops are there: most requests stop early)
    if llm.config.speculative is not None:  # drafts were taken through the loops the check cuts
        assert llm.engine.stats().extra["spec_accepted_tokens"] > 0
    llm.engine.check_integrity()


def test_min_tokens_defers_the_check(llm, plain):
    rd = CASES[0]
    first, _ = _expected(plain[1], rd)
    min_tokens = len(first) + 3  # inside the same run of one token: it stops there instead
    out = llm.generate(PROMPTS[1], _greedy(repetition_detection=rd, min_tokens=min_tokens))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == _expected(plain[1], rd, min_tokens)
    assert len(out.token_ids) == min_tokens


def test_requests_without_it_and_beside_it_run_to_their_length(llm, plain):
    sps = [_greedy(repetition_detection=CASES[0]) if i % 2 else _greedy() for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, sps)
    for i, (o, ref) in enumerate(zip(outs, plain)):
        c = o.outputs[0]
        want = _expected(ref, CASES[0]) if i % 2 else (ref, "length")
        assert (c.token_ids, c.finish_reason) == want
