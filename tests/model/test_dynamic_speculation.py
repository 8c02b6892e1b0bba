"""Dynamic speculative decoding (vLLM's num_speculative_tokens_per_batch_size) offline on a tiny random llama: each
step's requests take at most the schedule's drafts for the number of requests running, none where it says 0, and
the greedy tokens stay plain decoding's (n-gram and a draft model)."""
import pytest

from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.engine.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["0123456789 0123456789 0123456789 0123", "The quick brown fox jumps over the lazy dog. The quick",
           "abc abc abc abc abc", "def add(a, b):\n    return a + b\n\ndef add("]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "llama", max_position_embeddings=256)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_drafts_follow_the_batch_size_schedule(tiny_path, monkeypatch, method):
    """Four requests, two of them short: while three or more run, no drafts (K = 0); with two, at most 1; alone, at
    most 3. The tokens equal plain decoding's."""
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
            if method == "ngram" else {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3})
    spec["num_speculative_tokens_per_batch_size"] = [[1, 1, 3], [2, 2, 1], [3, 64, 0]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 12, 24, 40)]
    want = LLM(tiny_path, block_size=4).generate(PROMPTS, params)
    seen = []  # (requests running, drafts a request took)
    orig = Scheduler._propose

    def propose(self, req, max_new):
        drafts = orig(self, req, max_new)
        seen.append((len(self.running), len(drafts)))
        return drafts

    monkeypatch.setattr(Scheduler, "_propose", propose)
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    cap = {1: 3, 2: 1}
    assert all(k <= cap.get(n, 0) for n, k in seen), seen
    assert {n for n, k in seen if k} == {1, 2} if method == "draft_model" else any(k for _, k in seen)
    extra = llm.engine.stats().extra
    assert extra["spec_draft_tokens"] == sum(k for _, k in seen) > 0
    # the per-position counts (/metrics, the periodic log): drafts at position p are those of rounds with > p drafts
    assert extra["spec_drafted_per_pos"] == [sum(k > p for _, k in seen) for p in range(3)]
    assert extra["spec_drafts"] == sum(k > 0 for _, k in seen) == extra["spec_drafted_per_pos"][0]
    assert sum(extra["spec_accepted_per_pos"]) == extra["spec_accepted_tokens"]
    assert all(a <= d for a, d in zip(extra["spec_accepted_per_pos"], extra["spec_drafted_per_pos"]))
    llm.engine.check_integrity()


def test_a_schedule_of_zeros_never_speculates(tiny_path):
    spec = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3,
            "speculative_token_schedule": [[1, 1024, 0]]}
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.engine.stats().extra["spec_draft_tokens"] == 0
    llm.engine.check_integrity()
