"""MTP speculation (CPU, tiny random qwen3_5 / qwen3_next / qwen3_5_moe with random mtp.* weights in the real names):

- the draft logits inside the engine, at every step and chained pass, equal a float64 reference of the MTP math fed
  by transformers' hidden states of the target (tests/mtp_models.py), through chunked prefill, rejected drafts
  (the random module's drafts are mostly wrong), concurrent requests and a prefix-cache hit: the MTP's KV is right
  wherever it is read;
- greedy outputs equal plain decoding's (concurrent requests, chunked prefill, prefix-cache hits, preemption), seeded
  sampled runs repeat;
- a target whose LM head is zero (every argmax is token 0, so the MTP always agrees): every draft is accepted and
  each saves a step;
- configuration errors.
"""
import random

import pytest

from mtp_models import (MTPReference, add_mtp_weights, check_against_reference, make_mtp_target, record_draft_logits,
                        record_drafts)
from spec_oracle import PlainRuns, run_checked
from tiny_models import HYBRID_VOCAB, make_model, make_tiny_hybrid, small_moe
from voltllm import LLM, SamplingParams
from voltllm.config import ConfigError

KINDS = ["qwen3_5", "qwen3_next", "qwen3_5_moe"]
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(HYBRID_VOCAB) for _ in range(11)], [_rng.randrange(HYBRID_VOCAB) for _ in range(23)],
           [7, 8], [_rng.randrange(HYBRID_VOCAB) for _ in range(6)]]
BASE = dict(block_size=4, max_num_seqs=4, skip_tokenizer_init=True, dtype="float32")


def _mtp(k):
    return {"method": "mtp", "num_speculative_tokens": k}


def _make(tmp_path_factory, kind, **kw):
    made = make_mtp_target(tmp_path_factory, kind, model=small_moe(kind), **kw)
    if made is None:
        pytest.skip(f"this transformers has no {kind}")
    return made


@pytest.fixture(scope="module", params=KINDS)
def target(request, tmp_path_factory):
    return _make(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return _make(tmp_path_factory, "qwen3_5")


_run = run_checked
_plain = PlainRuns(BASE)


@pytest.mark.parametrize("budget", [64, 5])
def test_draft_logits_equal_reference(target, monkeypatch, budget):
    """Budget 5: prompts in chunks beside verifications."""
    path, mtp = target
    k = 3
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = PROMPTS[:3]
    seen = record_draft_logits(monkeypatch)
    llm = LLM(path, speculative_config=_mtp(k), max_num_batched_tokens=budget, **BASE)
    outs = _run(llm, prompts, sp)
    assert outs == _plain(path, prompts, sp, max_num_batched_tokens=budget)
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(prompts, outs)}
    ref = MTPReference(path, mtp)
    assert check_against_reference(ref, seen, fulls, k) >= 3 * len(prompts)
    assert any(len(lg) == k for _, _, lg, _ in seen)


def test_draft_logits_after_a_prefix_cache_hit(qwen35, monkeypatch):
    """The second request starts at a cached prefix (snapshots every 8 tokens): the MTP's KV there was written by
    the first."""
    path, mtp = qwen35
    shared = PROMPTS[1][:17]
    prompts = [shared + [3, 4, 5], shared + [9, 9]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seen = record_draft_logits(monkeypatch)
    llm = LLM(path, speculative_config=_mtp(2), mamba_block_size=8, **BASE)
    outs = [_run(llm, [p], sp)[0] for p in prompts]
    assert outs == _plain(path, prompts, sp, enable_prefix_caching=False)
    assert llm.engine.runner.state_snapshots.stats()["restored"] > 0
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(prompts, outs)}
    assert check_against_reference(MTPReference(path, mtp), seen, fulls, 2) > 0


@pytest.mark.parametrize("budget", [64, 5])
def test_greedy_equals_plain(target, budget):
    path, _ = target
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(path, speculative_config=_mtp(3), max_num_batched_tokens=budget, **BASE)
    assert _run(llm, PROMPTS, sp) == _plain(path, PROMPTS, sp, max_num_batched_tokens=budget)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0


def test_preemption_and_prefix_hits(qwen35):
    path, _ = qwen35
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _plain(path, PROMPTS, sp)
    tight = LLM(path, speculative_config=_mtp(3), max_num_batched_tokens=16, num_gpu_blocks_override=24, **BASE)
    assert _run(tight, PROMPTS, sp) == ref
    assert tight.engine.stats().num_preemptions > 0
    cached = LLM(path, speculative_config=_mtp(2), mamba_block_size=8, **BASE)
    for _ in range(2):
        assert _run(cached, PROMPTS, sp) == ref
    assert cached.engine.runner.state_snapshots.stats()["restored"] > 0


def test_sampled_requests_repeat_and_greedy_stay_exact(qwen35):
    path, _ = qwen35
    greedy = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    sps = [greedy, SamplingParams(temperature=1.0, seed=11, max_tokens=25, ignore_eos=True)] * 2
    ref = _plain(path, PROMPTS, greedy)
    runs = [_run(LLM(path, speculative_config=_mtp(3), **BASE), PROMPTS, sps) for _ in range(2)]
    assert runs[0] == runs[1]
    assert [runs[0][i] for i in (0, 2)] == [ref[i] for i in (0, 2)]


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    return _make(tmp_path_factory, "qwen3_5", zero_lm_head=True)


@pytest.mark.parametrize("k", [1, 3])
def test_agreeing_module_accepts_every_draft(agreeing, k):
    """Zero LM head: the target's and the MTP's argmax are both token 0, so every draft is accepted; each verification
    emits k + 1 tokens."""
    path, _ = agreeing
    m = 21
    sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
    llm = LLM(path, speculative_config=_mtp(k), **BASE)
    steps0 = llm.engine.stats().step_counter
    assert _run(llm, PROMPTS[:1], sp) == [[0] * m]
    stats = llm.engine.stats()
    assert stats.extra["spec_accepted_tokens"] == stats.extra["spec_draft_tokens"] > 0
    assert stats.step_counter - steps0 == 1 + -(-(m - 1) // (k + 1))


# -- configuration ------------------------------------------------------------------------------------------
def test_alias_and_keys():
    from voltllm.engine.speculative import SpeculativeConfig, SpeculativeConfigError

    assert SpeculativeConfig.from_dict({"method": "qwen3_next_mtp", "num_speculative_tokens": 2}).uses_mtp
    with pytest.raises(SpeculativeConfigError, match="leave out"):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2, "model": "x"})
    with pytest.raises(SpeculativeConfigError, match="not built"):
        SpeculativeConfig.from_dict({"method": "deepseek_mtp", "num_speculative_tokens": 2})


def test_config_errors(tmp_path_factory, qwen35):
    llama = make_model(str(tmp_path_factory.mktemp("llama")), "llama")
    with pytest.raises(ConfigError, match="built for qwen3_next"):
        LLM(llama, speculative_config=_mtp(2), skip_tokenizer_init=True)
    bare = make_tiny_hybrid(str(tmp_path_factory.mktemp("bare")), "qwen3_5", seed=0, gen_seed=1)
    with pytest.raises(ConfigError, match="no mtp"):
        LLM(bare, speculative_config=_mtp(2), **BASE)
    path, _ = qwen35
    with pytest.raises(ConfigError, match="only one"):
        LLM(path, speculative_config=_mtp(2), hf_overrides={"mtp_num_hidden_layers": 2}, **BASE)
    with pytest.raises(ConfigError, match="no MTP layer"):
        LLM(path, speculative_config=_mtp(2), hf_overrides={"mtp_num_hidden_layers": 0}, **BASE)


def test_incomplete_mtp_weights(tmp_path_factory):
    from safetensors.torch import load_file, save_file
    import glob
    import os

    path = make_tiny_hybrid(str(tmp_path_factory.mktemp("partial")), "qwen3_5", seed=0, gen_seed=1)
    add_mtp_weights(path)
    f = glob.glob(os.path.join(path, "*.safetensors"))[0]
    sd = load_file(f)
    del sd["mtp.fc.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mtp.fc"):
        LLM(path, speculative_config=_mtp(2), **BASE)


# -- the CUDA-graph forms of decode and verification steps, on the CPU ---------------------------------------
class _EagerReplay:
    """A captured graph's stand-in: the forward it holds, run eagerly on the same persistent buffers and context."""

    def __init__(self, graphs, batch_size: int, log: list):
        self.graphs, self.batch_size, self.log = graphs, batch_size, log

    def replay(self):
        r, bs = self.graphs.runner, self.batch_size
        ctx = self.graphs.context(bs)
        ctx.meta.seq_lens_cpu = ctx.meta.seq_lens.tolist()
        ctx.meta.max_seq_len = max(ctx.meta.seq_lens_cpu)
        self.log.append((self.graphs.walks, bs))
        return r.model(r.buffers.input_ids[:bs], r.buffers.positions[:bs], ctx)


def _target_graph_form(runner) -> list:
    """The target's decode and verification-walks graphs as eager stand-ins; returns their replay log."""
    from voltllm.worker.cuda_graphs import DecodeGraphs

    runner._ensure_buffers()
    log: list = []
    for walks in (False, True):
        graphs = DecodeGraphs(runner, walks=walks)
        graphs.graphs = {bs: _EagerReplay(graphs, bs, log) for bs in graphs.sizes}
        setattr(runner, "verify_graphs" if walks else "graphs", graphs)
    return log


def test_graph_form_steps(qwen35, monkeypatch):
    """Decode steps replay decode graphs and verifications walks graphs (padded decode rows): the MTP's pass after
    them reads the graphs' rows, and its drafts stay the reference's."""
    path, mtp = qwen35
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    kw = dict(max_num_batched_tokens=64, max_num_seqs=16)
    prompts = PROMPTS[:3]
    seen = record_draft_logits(monkeypatch)
    llm = LLM(path, speculative_config=_mtp(3), **{**BASE, **kw})
    log = _target_graph_form(llm.engine.runner)
    outs = _run(llm, prompts, sp)
    assert outs == _plain(path, prompts, sp, **kw)
    assert any(w for w, _ in log)
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(prompts, outs)}
    assert check_against_reference(MTPReference(path, mtp), seen, fulls, 3) > 0


def test_sampled_verification_keeps_the_kv(qwen35, monkeypatch):
    """top_k 1 sampled requests (their tokens are the greedy ones) go through the sampled verification
    (DraftVerdicts: the MTP's next tokens are the drafts where accepted, else the replacements): the drafts stay the
    reference's."""
    path, mtp = qwen35
    one_hot = SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=14, ignore_eos=True)
    prompts = PROMPTS[:3]
    seen = record_draft_logits(monkeypatch)
    outs = _run(LLM(path, speculative_config=_mtp(3), **BASE), prompts, one_hot)
    assert outs == _plain(path, prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(prompts, outs)}
    assert check_against_reference(MTPReference(path, mtp), seen, fulls, 3) > 0


def test_first_step_after_a_hit_drafts(qwen35, monkeypatch):
    """A prompt cached but for its last token: its first step (admitted from the waiting queue, so without drafts)
    computes that token and leaves the MTP output its next step drafts from; no draft comes from the zero row."""
    from voltllm.worker.mtp_runner import MTPRunner

    zero_rows = []
    orig = MTPRunner._source
    monkeypatch.setattr(MTPRunner, "_source", lambda self, s: zero_rows.append(orig(self, s) == self._zero_row)
                        or orig(self, s))
    path, _ = qwen35
    base = PROMPTS[1][:16]
    prompts = [base + [5], base + [6]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(path, speculative_config=_mtp(3), mamba_block_size=8, **BASE)
    _run(llm, [base + [1, 2, 3]], sp)  # caches the 16-token prefix
    drafts0 = llm.engine.stats().extra["spec_draft_tokens"]
    assert [_run(llm, [p], sp)[0] for p in prompts] == _plain(path, prompts, sp, enable_prefix_caching=False)
    assert llm.engine.stats().extra["spec_draft_tokens"] > drafts0
    assert zero_rows and not any(zero_rows)


# -- the CUDA-graph form of the MTP's own passes, on the CPU ------------------------------------------------
def _mtp_graph_form(llm, max_rows: int) -> None:
    """The target's graphs and the MTP's (stand-ins: padded decode rows up to max_rows, eager past them)."""
    from graph_stand_ins import PaddedDecodeGraphs

    runner = llm.engine.runner
    _target_graph_form(runner)
    runner.draft.graphs = PaddedDecodeGraphs(runner.draft.graph_view(), max_rows)


@pytest.mark.parametrize("k,max_rows,sampled", [(1, 16, False), (2, 2, False), (3, 16, False), (3, 2, False),
                                                (3, 16, True)])
def test_mtp_graph_form_equals_eager(qwen35, monkeypatch, k, max_rows, sampled):
    """Four requests of different lengths joining (prompts in chunks of the 16-token budget) and finishing mid-run:
    with the MTP's passes in their graph form (rows padded to a power of two; max_rows 2: the wider passes eager)
    the drafts and tokens equal the eager form's, and (greedy) the tokens plain decoding's. sampled: two of the
    requests seeded sampled ones (drafts drawn from q, verified with min(1, p / q))."""
    path, _ = qwen35
    sps = [SamplingParams(temperature=0.9 if sampled and i % 2 else 0, seed=i, max_tokens=m, ignore_eos=True)
           for i, m in enumerate((14, 9, 17, 5))]
    kw = dict(max_num_batched_tokens=16, max_num_seqs=16)
    runs = []
    for graphs in (False, True):
        with monkeypatch.context() as mp:
            drafts, counts = record_drafts(mp)
            llm = LLM(path, speculative_config=_mtp(k), **{**BASE, **kw})
            if graphs:
                _mtp_graph_form(llm, max_rows)
            runs.append((_run(llm, PROMPTS, sps), drafts, dict(counts)))
    (eager, eager_drafts, eager_counts), (graph, graph_drafts, counts) = runs
    assert graph == eager
    if not sampled:
        assert eager == _plain(path, PROMPTS, sps, **kw)
    assert graph_drafts == eager_drafts and len(graph_drafts) > 3
    assert eager_counts == {"chained": 0, "step": 0}
    assert counts["step"] > 0 and (counts["chained"] > 0) == (k > 1)


def test_mtp_graph_form_reference_and_prefix_hits(qwen35, monkeypatch):
    """Graph form, K = 3: every draft logit equals the float64 reference through prefix-cache hits (snapshots every 8
    tokens; the second and third requests start at the first's cached prefix)."""
    path, mtp = qwen35
    shared = PROMPTS[1][:17]
    prompts = [shared + [3, 4, 5], shared + [9, 9], shared + [1]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seen = record_draft_logits(monkeypatch)
    llm = LLM(path, speculative_config=_mtp(3), mamba_block_size=8, **{**BASE, "max_num_seqs": 8})
    _mtp_graph_form(llm, 8)
    outs = [_run(llm, [p], sp)[0] for p in prompts[:1]] + _run(llm, prompts[1:], sp)
    assert outs == _plain(path, prompts, sp, enable_prefix_caching=False)
    assert llm.engine.runner.state_snapshots.stats()["restored"] > 0
    assert llm.engine.runner.draft.graphs.replays > 0
    fulls = {tuple(p): list(p) + list(o) for p, o in zip(prompts, outs)}
    assert check_against_reference(MTPReference(path, mtp), seen, fulls, 3) > 0


def test_greedy_draft_sampling_draws_nothing(qwen35, monkeypatch):
    """draft_sample_method greedy (vLLM's key): sampled requests take the MTP's argmax drafts, verified as one-hot
    proposals (no q drawn), and seeded runs repeat; probabilistic (the default) draws them from q."""
    from voltllm.sampling.sampler import Sampler

    path, _ = qwen35
    calls = []
    orig = Sampler.draw_drafts

    def draw(self, *a, **kw):
        calls.append(1)
        return orig(self, *a, **kw)

    monkeypatch.setattr(Sampler, "draw_drafts", draw)
    sps = [SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
           SamplingParams(temperature=0.8, seed=9, max_tokens=16, ignore_eos=True)]
    llm = LLM(path, speculative_config={**_mtp(3), "draft_sample_method": "greedy"}, **BASE)
    first = _run(llm, PROMPTS[:2], sps)
    assert calls == [] and llm.engine.stats().extra["spec_draft_tokens"] > 0
    assert _run(llm, PROMPTS[:2], sps) == first
    _run(LLM(path, speculative_config=_mtp(3), **BASE), PROMPTS[:2], sps)
    assert calls
