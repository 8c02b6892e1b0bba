"""Speculation for requests the verification restricts, on the GPU: structured outputs (each verification row
masked by its grammar after the drafts before it), bad words, penalties, allowed_token_ids, min_tokens, logprobs and
prompt logprobs, with device drafts (a draft model: the target itself, with CUDA graphs) and host drafts (n-gram).
In fp32 (native and --compat sm70) the greedy tokens equal plain decoding's."""
import pytest

from structured_cases import REGEX, SCHEMA, check_regex_output, check_schema_output
from tiny_models import make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick", "0123456789 0123456789 0123456789 0123",
           "What is the capital of France?", "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3", max_position_embeddings=512)


def _params(llm):
    free = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tok = llm.get_tokenizer()
    word = next(tok.decode([t]) for t in free[0].outputs[0].token_ids[3:]
                if tok.encode(tok.decode([t]).lstrip(), add_special_tokens=False) == [t])
    stop = free[1].outputs[0].token_ids[2]
    g = dict(temperature=0, max_tokens=40)
    so = dict(temperature=0, max_tokens=100)
    return [SamplingParams(**so, structured_outputs={"json": SCHEMA}),
            SamplingParams(**so, structured_outputs={"regex": REGEX}, logprobs=2),
            SamplingParams(**g, ignore_eos=True, bad_words=[word], repetition_penalty=1.2),
            SamplingParams(**g, stop_token_ids=[stop], min_tokens=10, prompt_logprobs=1,
                           allowed_token_ids=sorted(set(range(30, 90)) | {stop})),
            SamplingParams(**g, ignore_eos=True, frequency_penalty=0.3, presence_penalty=0.4, logprobs=1)]


def _run(llm, params):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params)
    assert len(llm.engine.grammars) == 0
    llm.engine.check_integrity()
    return outs


@pytest.mark.parametrize("compat", ["none", "sm70"])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_restricted_requests_speculate_and_equal_plain_decoding_fp32(path, compat, method):
    kw = dict(device="cuda", dtype="float32", compat=compat, max_model_len=512, gpu_memory_utilization=0.2)
    plain = LLM(path, **kw)
    params = _params(plain)
    want = _run(plain, params)
    spec = ({"method": "draft_model", "model": path, "num_speculative_tokens": 4} if method == "draft_model" else
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    llm = LLM(path, speculative_config=spec, **kw)
    outs = _run(llm, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    check_schema_output(outs[0].outputs[0].text)
    check_regex_output(outs[1].outputs[0].text)
    for got, exp in zip(outs, want):
        for a, b in zip(got.outputs[0].logprobs or [], exp.outputs[0].logprobs or []):
            # (masked tokens' logprobs are -inf in both)
            assert list(a) == list(b) and all(a[t].logprob == b[t].logprob or abs(a[t].logprob - b[t].logprob) < 1e-3
                                              for t in a)
    assert [len(p) for p in outs[3].prompt_logprobs[1:]] == [len(p) for p in want[3].prompt_logprobs[1:]]
    stats = llm.engine.stats().extra
    assert stats["spec_draft_tokens"] > 0
    if method == "draft_model":  # (the self-draft proposes unrestricted argmaxes: some fall to the restrictions)
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_sampled_constrained_requests_speculate_fp16(path):
    """Seeded sampled structured-output requests with a self-draft in fp16: inside their grammar, repeating from
    run to run."""
    kw = dict(device="cuda", dtype="float16", max_model_len=512, gpu_memory_utilization=0.2)
    llm = LLM(path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 4}, **kw)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=60, structured_outputs=so)
              for i, so in enumerate([{"json": SCHEMA}, {"regex": REGEX}] * 2)]
    first = _run(llm, params)
    again = _run(llm, params)
    for o in first[::2]:
        check_schema_output(o.outputs[0].text)
    for o in first[1::2]:
        check_regex_output(o.outputs[0].text)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert llm.engine.stats().extra["spec_accepted_tokens"] > 0
