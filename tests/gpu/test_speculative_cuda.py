"""n-gram speculative decoding on the GPU: verification steps run as multi-token steps (prompt CUDA graphs or
eager) beside one-token decode graphs; greedy outputs equal plain decoding in fp32 (native and --compat sm70),
and in fp16 agree except at near-ties (a verification step computes a token with the prompt kernels, plain
decoding with the decode ones)."""
import pytest

from tiny_models import make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "0123456789 0123456789 0123", "Hi"] * 3


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("llama")), "llama")


def _tokens(llm, sp):
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    llm.engine.check_integrity()
    return out


@pytest.mark.parametrize("compat", ["none", "sm70"])
def test_fp32_greedy_equals_plain_decoding(path, compat):
    kw = dict(device="cuda", dtype="float32", compat=compat, max_model_len=512, gpu_memory_utilization=0.2)
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    ref = _tokens(LLM(path, **kw), sp)
    llm = LLM(path, speculative_config=SPEC, **kw)
    assert _tokens(llm, sp) == ref
    assert llm.engine.stats().extra["spec_accepted_tokens"] > 0


def test_fp16_agrees_with_plain_decoding(path):
    kw = dict(device="cuda", dtype="float16", max_model_len=512, gpu_memory_utilization=0.2)
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    ref = _tokens(LLM(path, **kw), sp)
    got = _tokens(LLM(path, speculative_config=SPEC, **kw), sp)
    agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
    assert agree >= 0.9, agree


def test_sampled_requests_speculate_and_repeat(path):
    """Seeded sampled requests speculate (Sampler.verify_drafts on the GPU) and repeat from run to run."""
    kw = dict(device="cuda", dtype="float16", max_model_len=512, gpu_memory_utilization=0.2)
    sp = SamplingParams(temperature=0.4, seed=3, max_tokens=64, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(path, speculative_config=SPEC, **kw)
        runs.append(_tokens(llm, sp))
        assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    assert runs[0] == runs[1] and all(len(t) == 64 for t in runs[0])
