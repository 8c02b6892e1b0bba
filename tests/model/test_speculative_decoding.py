"""n-gram speculative decoding in the engine (CPU, tiny random llama / qwen3): greedy outputs are exactly the ones
without speculation, in fewer steps; drafts are cut by the token budget, max_tokens and stop tokens; seeded sampled
requests speculate beside greedy ones and repeat from run to run; blocks are not leaked."""
import pytest

from spec_oracle import TEXT_PROMPTS, text_outputs
from tiny_models import make_model
from voltllm import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
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
    got = _run(llm, PROMPTS, sp)
    assert got == ref
    stats = llm.engine.stats()
    assert stats.extra["spec_accepted_tokens"] > 0
    assert stats.extra["spec_draft_tokens"] >= stats.extra["spec_accepted_tokens"]


def test_each_accepted_draft_saves_a_step(path):
    """One request, its prompt in one step: 120 tokens take 120 - accepted steps (the model's own next token comes
    with every verified step), and the accepted tokens are the ones plain decoding gives."""
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    llm = LLM(path, block_size=4, speculative_config=SPEC)
    steps0 = llm.engine.stats().step_counter
    got = _run(llm, PROMPTS[2:3], sp)
    stats = llm.engine.stats()
    accepted = stats.extra["spec_accepted_tokens"]
    assert accepted >= 4  # the tiny models fall into loops that the n-grams catch
    assert stats.step_counter - steps0 == 120 - accepted
    assert got == _run(LLM(path, block_size=4), PROMPTS[2:3], sp)


def test_stops_and_lengths_inside_accepted_drafts(path):
    ref_llm = LLM(path, block_size=4)
    free = _run(ref_llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop_tok = free[12]
    llm = LLM(path, block_size=4, speculative_config=SPEC)
    for sp in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)):
        assert _run(llm, PROMPTS[:1], sp) == _run(ref_llm, PROMPTS[:1], sp)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok],
                                                   ignore_eos=True))[0].outputs[0]
    assert out.token_ids[-1] == stop_tok and out.finish_reason == "stop"


def test_sampled_requests_speculate_too(path):
    """Seeded sampled requests speculate as well (verify_drafts: exact in distribution, tests/unit); beside them
    the greedy requests keep their exact tokens, and a seeded request's tokens repeat from run to run."""
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


def test_preemption_while_speculating(path):
    """A KV cache too small for every request: speculating requests are preempted (their draft slots freed with
    the rest) and recomputed, and the greedy outputs stay those of plain decoding with room."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _run(LLM(path, block_size=4), PROMPTS, sp)
    tight = LLM(path, block_size=4, max_num_batched_tokens=32, num_gpu_blocks_override=24, speculative_config=SPEC)
    assert _run(tight, PROMPTS, sp) == ref
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.extra["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("max_num_seqs", [8, 2])
def test_decode_steps_with_drafts_run_as_token_rows(path, monkeypatch, max_num_seqs):
    """A step where every request decodes runs its known tokens and drafts as decode rows (what a decode CUDA graph
    replays on the GPU), each row attending to its own prefix, up to max_num_seqs x (K + 1) rows
    (cuda_graphs.decode_graph_rows: more rows than requests); steps with more take the prompt-step form. Either way
    the greedy tokens are plain decoding's."""
    from voltllm.worker.runner import ModelRunner

    rows = []
    orig = ModelRunner._prepare_token_rows

    def counting(self, scheduled, table, h):
        out = orig(self, scheduled, table, h)
        rows.append(out[0])
        return out

    monkeypatch.setattr(ModelRunner, "_prepare_token_rows", counting)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    kw = dict(block_size=4, max_num_seqs=max_num_seqs)
    llm = LLM(path, speculative_config=SPEC, **kw)
    got = _run(llm, PROMPTS[1:3], sp)
    cap = llm.engine.runner.max_decode_rows
    assert cap == min(max_num_seqs * (1 + SPEC["num_speculative_tokens"]), llm.config.scheduler.max_num_batched_tokens)
    assert rows and all(r <= cap for r in rows) and max(rows) > 2  # both requests draft (2: past max_num_seqs)
    assert got == _run(LLM(path, **kw), PROMPTS[1:3], sp)
