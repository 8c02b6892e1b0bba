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


def _record_proposals(monkeypatch, key) -> list:
    """Scheduler._propose as usual, recording (key(scheduler, request), drafts taken) for each proposal."""
    seen = []
    orig = Scheduler._propose

    def propose(self, req, max_new):
        drafts = orig(self, req, max_new)
        seen.append((key(self, req), len(drafts)))
        return drafts

    monkeypatch.setattr(Scheduler, "_propose", propose)
    return seen


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_drafts_follow_the_batch_size_schedule(tiny_path, monkeypatch, method):
    """Four requests, two of them short: while three or more run, no drafts (K = 0); with two, at most 1; alone, at
    most 3. The tokens equal plain decoding's."""
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
            if method == "ngram" else {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3})
    spec["num_speculative_tokens_per_batch_size"] = [[1, 1, 3], [2, 2, 1], [3, 64, 0]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 12, 24, 40)]
    want = LLM(tiny_path, block_size=4).generate(PROMPTS, params)
    seen = _record_proposals(monkeypatch, lambda sched, req: len(sched.running))  # (requests running, drafts)
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    engine = llm.engine
    launches = []  # (a step in flight at the launch, the step has drafts)
    launch = engine.runner.launch_forward

    def spy(sched):
        launches.append((engine._inflight is not None, any(s.spec_tokens for s in sched.scheduled)))
        return launch(sched)

    monkeypatch.setattr(engine.runner, "launch_forward", spy)
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
    # async scheduling stays on where the schedule says 0: those steps launch while the previous one runs; a step
    # that may draft waits for it (its drafts follow every token)
    assert engine.async_scheduling
    assert not any(inflight and drafted for inflight, drafted in launches)
    assert any(inflight for inflight, _ in launches)
    llm.engine.check_integrity()


def test_a_schedule_of_zeros_never_speculates(tiny_path):
    spec = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3,
            "speculative_token_schedule": [[1, 1024, 0]]}
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.engine.stats().extra["spec_draft_tokens"] == 0
    llm.engine.check_integrity()


def test_get_metrics_reads_as_vllms(tiny_path):
    """LLM.get_metrics() as vLLM's speculative-decoding example reads it: drafts, draft and accepted tokens, and the
    per-position Vector, equal to the engine's counts; no speculative metrics without speculation."""
    from voltllm.engine.metrics_snapshot import Counter, Gauge, Vector

    spec = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3}
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    sched = llm.engine.scheduler
    got = {m.name: m for m in llm.get_metrics()}
    assert isinstance(got["vllm:spec_decode_num_drafts"], Counter)
    assert got["vllm:spec_decode_num_drafts"].value == sched.num_drafts > 0
    assert got["vllm:spec_decode_num_draft_tokens"].value == sched.num_draft_tokens
    assert got["voltllm:spec_decode_num_accepted_tokens"].value == sched.num_accepted_tokens > 0  # (a self-draft)
    per_pos = got["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == sched.accepted_per_pos and len(per_pos.values) == 3
    assert isinstance(got["vllm:num_requests_running"], Gauge) and got["vllm:num_requests_running"].value == 0
    plain = {m.name for m in LLM(tiny_path, block_size=4).get_metrics()}
    assert "vllm:num_preemptions" in plain and not any("spec_decode" in n for n in plain)


@pytest.fixture(scope="module")
def drafters(tiny_path, tmp_path_factory):
    """The device drafters' checkpoints for the tiny llama (random: few drafts accepted; EAGLE-3 with a 4-layer
    target, its head reading three distinct layers) and a tiny hybrid target with MTP weights (None where this
    transformers lacks qwen3_5)."""
    import json
    import os

    from dflash_models import make_dflash
    from eagle1_models import make_eagle1
    from eagle3_models import make_eagle3
    from mtp_models import make_mtp_target

    with open(os.path.join(tiny_path, "config.json")) as f:
        c = json.load(f)
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    root = tmp_path_factory.mktemp("drafters")
    mtp = make_mtp_target(tmp_path_factory, "qwen3_5")
    e3_target = make_model(str(root / "e3-target"), "llama", num_hidden_layers=4, max_position_embeddings=256)
    return {"dflash": make_dflash(str(root / "dflash"), hidden, vocab, c["num_hidden_layers"], [0, 2], block_size=4),
            "eagle3": (e3_target, make_eagle3(str(root / "eagle3"), hidden, vocab, layer_ids=[1, 2, 3])),
            "eagle": make_eagle1(str(root / "eagle1"), hidden, vocab),
            "mtp": mtp[0] if mtp is not None else None}


# (the penalized request, whose sampling needs every token on the host, ends first: the three left overlap at K = 0)
ASYNC_PROMPTS_PARAMS = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.2),
                        SamplingParams(temperature=0.8, seed=3, max_tokens=14, ignore_eos=True),
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
                        SamplingParams(temperature=0.7, seed=9, max_tokens=36, ignore_eos=True, logprobs=1)]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "dflash", "eagle3", "eagle", "mtp"])
def test_async_steps_between_speculating_ones_equal_sync(tiny_path, drafters, method, monkeypatch):
    """A schedule that speculates only below three running requests, with async scheduling on and off, for host
    drafts and every drafter on the device (whose per-step work runs on the K = 0 steps too: the draft model's KV,
    DFlash's context, EAGLE's and MTP's hidden states): the greedy requests' tokens equal plain decoding's and their
    logprobs agree either way; with it on, K = 0 steps launched while the one before ran, and no step with drafts did.
    (Async learns of a finished request a step later, so the first speculating step may come a step later: a sampled
    request's draws, exact in distribution either way, may then differ.)"""
    import torch

    target, prompts = tiny_path, PROMPTS
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_max=2, prompt_lookup_min=1)
    elif method == "draft_model":
        spec["model"] = tiny_path
    elif method == "mtp":
        target = drafters["mtp"]
        if target is None:
            pytest.skip("this transformers lacks qwen3_5")
        from tiny_models import HYBRID_VOCAB  # (the hybrid has no tokenizer: token ids)

        prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % HYBRID_VOCAB for j in range(9 + 5 * i)]} for i in range(4)]
    elif method == "eagle3":
        target, spec["model"] = drafters["eagle3"]
    else:
        spec["model"] = drafters[method]
    spec["num_speculative_tokens_per_batch_size"] = [[1, 2, 3], [3, 64, 0]]
    params = ASYNC_PROMPTS_PARAMS
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    plain = LLM(target, block_size=4).generate(prompts, params)
    runs, launches = [], []
    for async_scheduling in (True, False):
        llm = LLM(target, block_size=4, speculative_config=spec, async_scheduling=async_scheduling)
        engine = llm.engine
        assert engine.async_scheduling == async_scheduling
        if async_scheduling:
            launch = engine.runner.launch_forward

            def spy(sched, engine=engine, launch=launch):
                launches.append((engine._inflight is not None, any(s.spec_tokens for s in sched.scheduled)))
                return launch(sched)

            monkeypatch.setattr(engine.runner, "launch_forward", spy)
        outs = llm.generate(prompts, params)
        assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
        assert [outs[i].outputs[0].token_ids for i in greedy] == [plain[i].outputs[0].token_ids for i in greedy]
        runs.append(outs)
        assert engine.stats().extra["spec_draft_tokens"] > 0
        engine.check_integrity()
    for i in greedy:
        for a, b in zip(*(r[i].outputs[0].logprobs or [] for r in runs)):
            assert a.keys() == b.keys()
            assert torch.allclose(torch.tensor([a[t].logprob for t in a]), torch.tensor([b[t].logprob for t in a]),
                                  atol=1e-4)
    assert any(inflight for inflight, _ in launches) and any(drafted for _, drafted in launches)
    assert not any(inflight and drafted for inflight, drafted in launches)


def test_self_drafting_stays_exact_across_async_steps(tiny_path):
    """The target as its own draft model, greedy: every draft is accepted only if the draft's KV of the K = 0 steps,
    which ran overlapped, was written as a synchronous run writes it."""
    spec = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 0]]}
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 10, 28, 40)]
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    assert llm.engine.async_scheduling
    outs = llm.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in LLM(tiny_path, block_size=4).generate(PROMPTS, sp)]
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] == extra["spec_draft_tokens"] > 0
    llm.engine.check_integrity()


def test_requests_arriving_after_a_speculative_step(tiny_path, monkeypatch):
    """Two requests speculate (oracle drafts, most accepted), then two more arrive: the step that admits them has
    drafts and the next, at four running, none (K = 0, async). The speculative step's tokens are taken on the host
    before that step is scheduled, so every request's tokens equal plain decoding's."""
    from spec_oracle import oracle_table, patch_ngram
    from voltllm.engine.types import EngineCoreRequest

    spec = {"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 2, 3],
                                                                                                       [3, 64, 0]]}
    plain = LLM(tiny_path, block_size=4)
    tok = plain.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    patch_ngram(monkeypatch, oracle_table(prompts, want), len(tok))
    llm = LLM(tiny_path, block_size=4, speculative_config=spec)
    core = llm.engine
    got = {str(i): [] for i in range(4)}
    launches = []  # per launch: (a step in flight, it has drafts, this step has drafts)
    launch = core.runner.launch_forward

    def spy(sched):
        held = core._inflight[0].scheduled if core._inflight is not None else None
        launches.append((held is not None, held is not None and any(s.spec_tokens for s in held),
                         any(s.spec_tokens for s in sched.scheduled)))
        return launch(sched)

    monkeypatch.setattr(core.runner, "launch_forward", spy)

    def step():
        for out in core.step():
            got[out.request_id] += out.new_token_ids

    for i in (0, 1):
        core.add_request(EngineCoreRequest(str(i), prompts[i], sp))
    for _ in range(6):
        step()
    assert core.scheduler.num_accepted_tokens > 0
    for i in (2, 3):
        core.add_request(EngineCoreRequest(str(i), prompts[i], sp))
    while core.has_unfinished_requests():
        step()
    assert [got[str(i)] for i in range(4)] == want
    # K = 0 steps overlapped the one before; never a speculative one (its requests would sit out a step), and a step
    # with drafts never launched with one in flight
    assert any(inflight for inflight, _, _ in launches)
    assert not any(spec_held or (inflight and drafted) for inflight, spec_held, drafted in launches), launches
    core.check_integrity()


def test_a_draft_model_with_fewer_positions_drafts_up_to_them(tiny_path, tmp_path, monkeypatch):
    """vLLM's rule for a draft model of fewer positions than --max-model-len: it drafts while a request's tokens
    and drafts fit in them, plain decoding beyond (no refusal); `max_model_len` in --speculative-config sets that
    limit for any method. The tokens equal plain decoding's."""
    short = make_model(str(tmp_path / "short"), "llama", max_position_embeddings=40)  # (the target's weights)
    spec = {"method": "draft_model", "model": short, "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(tiny_path, block_size=4).generate(PROMPTS[:2], sp)
    seen = _record_proposals(monkeypatch, lambda sched, req: len(req.all_token_ids))  # (tokens, drafts)
    for kw, limit in ((spec, 40), ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                    "max_model_len": 30}, 30)):
        seen.clear()
        llm = LLM(tiny_path, block_size=4, speculative_config=kw)
        assert llm.engine.scheduler.spec.max_model_len == limit
        outs = llm.generate(PROMPTS[:2], sp)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        assert all(n + k <= limit for n, k in seen if k), seen
        assert any(k for _, k in seen) and any(n >= limit for n, _ in seen)  # (drafts below it, none beyond)
        llm.engine.check_integrity()


def test_speculative_max_model_len_checks():
    from voltllm.config import ConfigError, speculative_max_len
    from voltllm.engine.speculative import SpeculativeConfig, SpeculativeConfigError

    assert speculative_max_len(None, 40, 256) == 40 and speculative_max_len(None, 512, 256) is None
    assert speculative_max_len(None, None, 256) is None and speculative_max_len(100, None, 256) == 100
    with pytest.raises(ConfigError, match="exceeds the draft model's 40 positions"):
        speculative_max_len(64, 40, 256)
    with pytest.raises(ConfigError, match="exceeds --max-model-len 256"):
        speculative_max_len(300, None, 256)
    for bad in (0, "64", 1.5, True):
        with pytest.raises(SpeculativeConfigError, match="max_model_len must be a positive integer"):
            SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": bad})
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 50})
    assert (c.drafts_room(45), c.drafts_room(60)) == (5, 0)
