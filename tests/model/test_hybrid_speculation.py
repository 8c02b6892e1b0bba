"""Speculative decoding on hybrid targets (CPU, tiny random qwen3_5 / qwen3_next / qwen3_5_moe): greedy outputs are
exactly plain decoding's with n-gram drafts, an attention-only draft model and a DFlash drafter (whose block logits
also equal a float64 reference fed by transformers' hidden states of the hybrid); the recurrent state keeps only
accepted drafts (StateCache checkpoints, worker/hybrid_spec.py), through chunked prefill, prefix-cache snapshot hits,
preemption, stops inside accepted drafts and sampled verification; no state slot, snapshot row or block leaks.

The tiny random hybrids hardly ever repeat themselves, so most tests draft with an oracle (tests/spec_oracle.py: the
plain run's own tokens, some replaced by wrong ones), whose windows of drafts see every outcome (all accepted, some,
none) at every offset, which the rollback of the states must get right."""
import random

import pytest

from dflash_models import V2, check_block_logits, make_dflash, record_block_logits, zero_lm_head
from graph_stand_ins import PaddedDecodeGraphs
from spec_oracle import PlainRuns, oracle_table, patch_dflash, patch_draft_model, patch_ngram, run_checked
from tiny_models import HYBRID_COMMON, HYBRID_VOCAB, make_model, make_tiny_hybrid, small_moe
from voltllm import LLM, SamplingParams

KINDS = ["qwen3_5", "qwen3_next", "qwen3_5_moe"]
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
_rng = random.Random(0)
_PAT = [_rng.randrange(HYBRID_VOCAB) for _ in range(7)]
PROMPTS = [_PAT * 4, [_rng.randrange(HYBRID_VOCAB) for _ in range(23)], (_PAT[:3] + [5]) * 5 + [9], [7, 8]]
BASE = dict(block_size=4, max_num_seqs=4, skip_tokenizer_init=True)


def _make(tmp_path_factory, kind):
    path = make_tiny_hybrid(str(tmp_path_factory.mktemp(kind)), kind, seed=0, gen_seed=1, **small_moe(kind))
    if path is None:
        pytest.skip(f"this transformers has no {kind}")
    return path


@pytest.fixture(scope="module", params=KINDS)
def target(request, tmp_path_factory):
    """Every hybrid architecture (the core checks); the rest run on qwen3_5 only (the CPU's MoE is slow)."""
    return _make(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return _make(tmp_path_factory, "qwen3_5")


_run = run_checked
_plain = PlainRuns(BASE)


@pytest.fixture
def oracle_ngram(monkeypatch):
    table: dict = {}
    patch_ngram(monkeypatch, table, HYBRID_VOCAB)
    return table


@pytest.mark.parametrize("budget", [64, 5])
def test_ngram_greedy_equals_plain(qwen35, budget):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _plain(qwen35, PROMPTS, sp, max_num_batched_tokens=budget)
    llm = LLM(qwen35, speculative_config=NGRAM, max_num_batched_tokens=budget, **BASE)
    assert _run(llm, PROMPTS, sp) == ref
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0


@pytest.mark.parametrize("budget", [64, 7])
def test_accepted_and_rejected_drafts_keep_plain_tokens(target, oracle_ngram, budget):
    """Budget 7: prompt chunks and verifications share steps (the walked rows beside chunked ones)."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _plain(target, PROMPTS, sp, max_num_batched_tokens=budget)
    oracle_ngram.update(oracle_table(PROMPTS, ref))
    llm = LLM(target, speculative_config=NGRAM, max_num_batched_tokens=budget, **BASE)
    assert _run(llm, PROMPTS, sp) == ref
    stats = llm.engine.stats().extra
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_each_accepted_draft_saves_a_step(qwen35, oracle_ngram):
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ref = _plain(qwen35, PROMPTS[:1], sp)
    oracle_ngram.update(oracle_table(PROMPTS[:1], ref))
    llm = LLM(qwen35, speculative_config=NGRAM, **BASE)
    steps0 = llm.engine.stats().step_counter
    assert _run(llm, PROMPTS[:1], sp) == ref
    stats = llm.engine.stats()
    accepted = stats.extra["spec_accepted_tokens"]
    assert accepted >= 20  # 3 of every 5 positions are right
    assert stats.step_counter - steps0 == 60 - accepted


def test_stops_inside_accepted_drafts(qwen35, oracle_ngram):
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    free = _plain(qwen35, PROMPTS[:1], sp)
    stop_tok = free[0][12]
    oracle_ngram.update(oracle_table(PROMPTS[:1], free))
    llm = LLM(qwen35, speculative_config=NGRAM, **BASE)
    for sp2 in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)):
        assert _run(llm, PROMPTS[:1], sp2) == _plain(qwen35, PROMPTS[:1], sp2)


def test_sampled_verification_keeps_the_states(qwen35, oracle_ngram):
    """Sampled requests (top_k 1: the model's distribution is one-hot, so their tokens are known) run the sampled
    verification (Sampler.verify_drafts' verdicts pick the states); seeded sampled requests beside greedy ones
    repeat from run to run."""
    one_hot = SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _plain(qwen35, PROMPTS, greedy)
    oracle_ngram.update(oracle_table(PROMPTS, ref))
    llm = LLM(qwen35, speculative_config=NGRAM, **BASE)
    assert _run(llm, PROMPTS, one_hot) == ref
    assert llm.engine.stats().extra["spec_accepted_tokens"] > 0
    sps = [greedy, SamplingParams(temperature=0.7, seed=7, max_tokens=40, ignore_eos=True)] * 2
    runs = [_run(LLM(qwen35, speculative_config=NGRAM, **BASE), PROMPTS, sps) for _ in range(2)]
    assert runs[0] == runs[1]
    assert [runs[0][i] for i in (0, 2)] == [ref[i] for i in (0, 2)]


def test_preemption_while_speculating(qwen35, oracle_ngram):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _plain(qwen35, PROMPTS, sp)
    oracle_ngram.update(oracle_table(PROMPTS, ref))
    tight = LLM(qwen35, speculative_config=NGRAM, max_num_batched_tokens=16, num_gpu_blocks_override=24, **BASE)
    assert _run(tight, PROMPTS, sp) == ref
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.extra["spec_accepted_tokens"] > 0


def test_prefix_cache_snapshot_hits(qwen35, oracle_ngram):
    """Snapshots every 8 tokens: the second round resumes from snapshots taken in the first (prompt boundaries and
    decode positions of accepted tokens only), and both rounds give plain decoding's tokens."""
    shared = PROMPTS[1][:17]
    prompts = [shared + [3, 4, 5] * 3, shared + [9] * 6, PROMPTS[0]]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _plain(qwen35, prompts, sp, enable_prefix_caching=False)
    oracle_ngram.update(oracle_table(prompts, ref))
    llm = LLM(qwen35, speculative_config=NGRAM, mamba_block_size=8, async_scheduling=False, **BASE)
    for _ in range(2):
        assert _run(llm, prompts, sp) == ref
    snaps = llm.engine.runner.state_snapshots.stats()
    assert snaps["restored"] > 0 and llm.engine.stats().extra["spec_accepted_tokens"] > 0


# -- draft model ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """An attention-only llama with the hybrids' vocabulary (its own tokenizer is not read: skip_tokenizer_init)."""
    return make_model(str(tmp_path_factory.mktemp("draft")), "llama", seed=1, num_hidden_layers=1,
                      vocab_size=HYBRID_VOCAB, max_position_embeddings=4096)


@pytest.fixture
def oracle_draft_model(monkeypatch):
    table: dict = {}
    patch_draft_model(monkeypatch, table, HYBRID_VOCAB)
    return table


@pytest.mark.parametrize("budget", [64, 5])
def test_draft_model_greedy_equals_plain(qwen35, draft, budget):
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _plain(qwen35, PROMPTS, sp, max_num_batched_tokens=budget)
    llm = LLM(qwen35, speculative_config={"model": draft, "num_speculative_tokens": 3},
              max_num_batched_tokens=budget, **BASE)
    assert _run(llm, PROMPTS, sp) == ref
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0


def test_draft_model_accepted_drafts(target, draft, oracle_draft_model):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _plain(target, PROMPTS, sp)
    oracle_draft_model.update(oracle_table(PROMPTS, ref))
    llm = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": K}, **BASE)
    assert _run(llm, PROMPTS, sp) == ref
    stats = llm.engine.stats().extra
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_draft_model_sampled_requests(qwen35, draft):
    """Drafts drawn from the draft's q and verified with min(1, p/q): seeded runs repeat, greedy ones beside stay
    exact, and drafts get accepted (both tiny models are near uniform, so p/q is often near 1)."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    sps = [greedy, SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)] * 2
    ref = _plain(qwen35, PROMPTS, greedy)
    runs = []
    for _ in range(2):
        llm = LLM(qwen35, speculative_config={"model": draft, "num_speculative_tokens": 3}, **BASE)
        runs.append(_run(llm, PROMPTS, sps))
        assert llm.engine.stats().extra["spec_accepted_tokens"] > 0
    assert runs[0] == runs[1]
    assert [runs[0][i] for i in (0, 2)] == [ref[i] for i in (0, 2)]


# -- verification as decode rows (the CUDA-graph form), on the CPU -----------------------------------------
class EagerReplay:
    """A captured graph's stand-in (as tests/unit/test_hybrid_graph_path.py's): the forward a graph holds, run
    eagerly on the same persistent buffers and context; the GDN layers' torch path regroups the walks by request."""

    def __init__(self, graphs, batch_size: int, log: list):
        self.graphs, self.batch_size, self.log = graphs, batch_size, log

    def replay(self):
        r, bs = self.graphs.runner, self.batch_size
        ctx = self.graphs.context(bs)
        ctx.meta.seq_lens_cpu = ctx.meta.seq_lens.tolist()
        ctx.meta.max_seq_len = max(ctx.meta.seq_lens_cpu)
        n = r.buffers.max_seqs
        self.log.append((self.graphs.walks, r.buffers.state_walks[:bs].tolist(),
                         r.buffers.state_walks[n:n + bs].tolist()))
        return r.model(r.buffers.input_ids[:bs], r.buffers.positions[:bs], ctx)


def _with_stand_in_graphs(llm) -> list:
    from voltllm.worker.cuda_graphs import DecodeGraphs

    runner = llm.engine.runner
    runner._ensure_buffers()
    log: list = []
    for walks in (False, True):
        graphs = DecodeGraphs(runner, walks=walks)
        graphs.graphs = {bs: EagerReplay(graphs, bs, log) for bs in graphs.sizes}
        setattr(runner, "verify_graphs" if walks else "graphs", graphs)
    return log


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "dflash"])
def test_verification_graph_form(target, draft, dflash, monkeypatch, drafter):
    """Decode steps replay the decode graphs and verification steps (every request decoding, drafts included, up to
    --max-num-seqs rows) the walks graphs, padded to the bucket sizes; the tokens are plain decoding's. (DFlash: its
    block forwards take their graph form too, and its context is written from the walks rows.)"""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(max_num_batched_tokens=64, max_num_seqs=16)
    ref = _plain(target, PROMPTS, sp, **kw)
    table = oracle_table(PROMPTS, ref)
    if drafter == "ngram":
        patch_ngram(monkeypatch, table, HYBRID_VOCAB)
        spec = NGRAM
    elif drafter == "draft_model":
        patch_draft_model(monkeypatch, table, HYBRID_VOCAB)
        spec = {"model": draft, "num_speculative_tokens": 3}
    else:
        patch_dflash(monkeypatch, table, HYBRID_VOCAB)
        spec = _dflash(dflash)
    llm = LLM(target, speculative_config=spec, **{**BASE, **kw})
    log = _with_stand_in_graphs(llm)
    if drafter == "dflash":
        llm.engine.runner.draft.graphs = PaddedDecodeGraphs(llm.engine.runner.draft, kw["max_num_seqs"])
    assert _run(llm, PROMPTS, sp) == ref
    walks = [(starts, ends) for is_walks, starts, ends in log if is_walks]
    assert any(e - s > 1 for starts, ends in walks for s, e in zip(starts, ends))  # a request's rows walked
    assert llm.engine.stats().extra["spec_accepted_tokens"] > 0


# -- DFlash: a drafter reading the hybrid's hidden states ----------------------------------------------------
DFLASH_LAYERS = [1, 3]  # a GDN layer's residual stream, and the last (attention) layer's output after the final norm


@pytest.fixture(scope="module")
def dflash(tmp_path_factory):
    """A tiny random DFlash drafter for the hybrids' shape (block 5: up to 4 drafts)."""
    return make_dflash(str(tmp_path_factory.mktemp("dflash")), HYBRID_COMMON["hidden_size"], HYBRID_VOCAB,
                       HYBRID_COMMON["num_hidden_layers"], DFLASH_LAYERS, block_size=5)


@pytest.fixture(scope="module")
def dflash2(tmp_path_factory):
    """A tiny random DFlash2 drafter (convolutions, candidate selector) for the hybrids' shape."""
    return make_dflash(str(tmp_path_factory.mktemp("dflash2")), HYBRID_COMMON["hidden_size"], HYBRID_VOCAB,
                       HYBRID_COMMON["num_hidden_layers"], DFLASH_LAYERS, block_size=5, v2=V2)


def _dflash(path, k=3):
    return {"method": "dflash", "model": path, "num_speculative_tokens": k}


@pytest.fixture
def oracle_dflash(monkeypatch):
    table: dict = {}
    patch_dflash(monkeypatch, table, HYBRID_VOCAB)
    return table


@pytest.mark.parametrize("form, v2", [("eager", False), ("graphs", False), ("graphs", True)])
def test_dflash_block_logits_equal_the_reference(target, dflash, dflash2, oracle_dflash, form, v2):
    """Every proposal of a batched greedy run with chunked prefill: the drafter's logits against the float64
    reference fed by transformers' hidden states of the hybrid. The oracle's drafts are partly accepted, so the
    context also comes from verified positions past a verification's first row. graphs: decode and verification
    steps replay the target's decode / walks graphs and the block forwards the drafter's (stand-ins on the CPU), so
    the context is written from graph rows. v2: a DFlash2 drafter."""
    dflash = dflash2 if v2 else dflash
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(max_num_batched_tokens=7) if form == "eager" else dict(max_num_batched_tokens=16, max_num_seqs=16)
    prompts = PROMPTS[:3]
    ref = _plain(target, prompts, sp, **kw)
    oracle_dflash.update(oracle_table(prompts, ref))
    llm = LLM(target, speculative_config=_dflash(dflash), **{**BASE, **kw})
    log = _with_stand_in_graphs(llm) if form == "graphs" else []
    dr = llm.engine.runner.draft
    if form == "graphs":
        dr.graphs = PaddedDecodeGraphs(dr, 16)
    records = record_block_logits(dr)
    assert _run(llm, prompts, sp) == ref
    assert llm.engine.stats().extra["spec_accepted_tokens"] > 0
    assert check_block_logits(records, target, dflash, DFLASH_LAYERS) >= 2 * len(prompts)
    assert form == "eager" or (dr.graphs.replays > 0 and any(w for w, _, _ in log))


def test_dflash_oracle_drafts_keep_plain_tokens(target, dflash, oracle_dflash):
    """All / some / no drafts accepted at every offset, prompt chunks beside verifications (budget 7)."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _plain(target, PROMPTS, sp, max_num_batched_tokens=7)
    oracle_dflash.update(oracle_table(PROMPTS, ref))
    llm = LLM(target, speculative_config=_dflash(dflash, K), max_num_batched_tokens=7, **BASE)
    assert _run(llm, PROMPTS, sp) == ref
    stats = llm.engine.stats().extra
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


@pytest.mark.parametrize("budget", [64, 5])
def test_dflash_greedy_equals_plain(qwen35, dflash, budget):
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(qwen35, speculative_config=_dflash(dflash), max_num_batched_tokens=budget, **BASE)
    assert _run(llm, PROMPTS, sp) == _plain(qwen35, PROMPTS, sp, max_num_batched_tokens=budget)
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0


def test_dflash_prefix_hits_and_preemption(qwen35, dflash):
    """Requests resuming from state snapshots (every 8 tokens) read context the first ones wrote, preempted requests
    rewrite theirs: the drafter's logits stay the reference's and the tokens plain decoding's."""
    shared = PROMPTS[1][:17]
    prompts = [shared + [3, 4, 5], shared + [9, 9], PROMPTS[0]]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = _plain(qwen35, prompts, sp, enable_prefix_caching=False)
    cached = LLM(qwen35, speculative_config=_dflash(dflash), mamba_block_size=8, **BASE)
    records = record_block_logits(cached.engine.runner.draft)
    assert [_run(cached, [p], sp)[0] for p in prompts] == ref
    assert cached.engine.runner.state_snapshots.stats()["restored"] > 0
    tight = LLM(qwen35, speculative_config=_dflash(dflash), max_num_batched_tokens=16, num_gpu_blocks_override=24,
                **BASE)
    records += record_block_logits(tight.engine.runner.draft)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert _run(tight, PROMPTS, sp) == _plain(qwen35, PROMPTS, sp, max_num_batched_tokens=16)
    assert tight.engine.stats().num_preemptions > 0
    assert check_block_logits(records, qwen35, dflash, DFLASH_LAYERS) > 0


@pytest.fixture(scope="module")
def agreeing_hybrid(tmp_path_factory):
    """A qwen3_5 whose LM head is zero (greedy picks id 0, sampling is uniform): a DFlash drafter using that head
    always agrees with it."""
    path = _make(tmp_path_factory, "qwen3_5")
    zero_lm_head(path)
    return path


@pytest.mark.parametrize("k", [2, 4])
def test_dflash_agreeing_drafter_accepts_everything(agreeing_hybrid, dflash, k):
    n = 21
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm = LLM(agreeing_hybrid, speculative_config=_dflash(dflash, k), **BASE)
    steps0 = llm.engine.stats().step_counter
    assert _run(llm, PROMPTS[:1], sp) == [[0] * n]
    stats = llm.engine.stats()
    rounds = -(-(n - 1) // (k + 1))  # each emits its drafts + 1 (the last one's drafts cut by max_tokens)
    assert stats.extra["spec_accepted_tokens"] == stats.extra["spec_draft_tokens"] == n - 1 - rounds
    assert stats.step_counter - steps0 == 1 + rounds


def test_dflash_sampled_requests(qwen35, agreeing_hybrid, dflash):
    """Seeded sampled requests: q = p for the agreeing drafter (every draft accepted); with the random drafter they
    repeat from run to run and greedy requests beside them keep plain decoding's tokens."""
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    llm = LLM(agreeing_hybrid, speculative_config=_dflash(dflash), **BASE)
    _run(llm, PROMPTS[:2], sp)
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] == extra["spec_draft_tokens"] > 0
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sps = [greedy, SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)] * 2
    runs = [_run(LLM(qwen35, speculative_config=_dflash(dflash), **BASE), PROMPTS, sps) for _ in range(2)]
    assert runs[0] == runs[1]
    assert [runs[0][i] for i in (0, 2)] == [_plain(qwen35, PROMPTS, greedy)[i] for i in (0, 2)]
