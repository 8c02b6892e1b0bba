"""Draft-model speculative decoding in the engine (CPU, tiny random llama / qwen3 targets): greedy outputs are exactly
plain decoding's whatever the draft (the target itself, a perturbed copy that agrees part of the time, an unrelated
model that never agrees); the self-draft accepts every draft, also after prefix-cache hits, chunked prefills and
preemptions (the draft's KV shares the target's blocks: a stale draft KV would lose agreement); seeded sampled
requests speculate and repeat; requests that may not speculate run beside; no block leaks; bad configs refused."""
import os
import shutil

import pytest
import torch

from graph_stand_ins import PaddedDecodePass
from tiny_models import make_model
from voltllm import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "0123456789 0123456789 0123",
           "Hi"]
K = 3


def perturbed_copy(src: str, dst: str, noise: float, seed: int = 5) -> str:
    """The checkpoint at src with N(0, noise) added to every weight (same tokenizer): a draft that agrees with the
    target often but not always."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    file = os.path.join(dst, "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    weights = {k: v + noise * torch.randn(v.shape, generator=gen) for k, v in load_file(file).items()}
    save_file(weights, file, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = make_model(str(root / "target"), request.param)
    return {"self": target, "near": perturbed_copy(target, str(root / "near"), 0.01),
            "other": make_model(str(root / "other"), request.param, seed=1, num_hidden_layers=1)}


def _spec(draft, k=K):
    return {"model": draft, "num_speculative_tokens": k}


def _run(llm, prompts, sps):
    outs = llm.generate(prompts, sps)
    llm.engine.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


_PLAIN: dict = {}


def _plain(target, prompts, sps, **kw):
    """Plain decoding's outputs (cached: several tests compare with the same ones)."""
    key = (target, tuple(prompts), repr(sps), tuple(sorted(kw.items())))
    if key not in _PLAIN:
        _PLAIN[key] = _run(LLM(target, **kw), prompts, sps)
    return _PLAIN[key]


@pytest.mark.parametrize("budget", [64, 5])
@pytest.mark.parametrize("draft", ["self", "near", "other"])
def test_greedy_outputs_equal_plain_decoding(models, draft, budget):
    """A batch of four, the token budget large or small (prompts in chunks of 5; drafts cut by the budget)."""
    target = models["self"]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(block_size=4, max_num_batched_tokens=budget, max_num_seqs=4)
    ref = _plain(target, PROMPTS, sp, **kw)
    llm = LLM(target, speculative_config=_spec(models[draft]), **kw)
    assert _run(llm, PROMPTS, sp) == ref
    extra = llm.engine.stats().extra
    assert extra["spec_draft_tokens"] > 0
    if draft == "self":
        assert extra["spec_accepted_tokens"] == extra["spec_draft_tokens"]
    elif draft == "near":
        assert 0 < extra["spec_accepted_tokens"] < extra["spec_draft_tokens"]


@pytest.mark.parametrize("k", [1, 4])
def test_self_draft_takes_one_step_per_k_plus_one_tokens(models, k):
    """The target as its own draft agrees with itself: after the prompt step every step emits K + 1 tokens."""
    target = models["self"]
    n = 41
    llm = LLM(target, block_size=4, speculative_config=_spec(target, k))
    steps0 = llm.engine.stats().step_counter
    got = _run(llm, PROMPTS[2:3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.extra["spec_accepted_tokens"] == stats.extra["spec_draft_tokens"] == n - 1 - (n - 1) // (k + 1)
    assert stats.step_counter - steps0 == 1 + -(-(n - 1) // (k + 1))
    assert got == _plain(target, PROMPTS[2:3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                         block_size=4)


def test_prefix_cache_hits_carry_the_draft_kv(models):
    """Prompts sharing long prefixes, run twice: the second run starts from cached blocks that the target and the
    draft computed in the first; the self-draft still agrees everywhere."""
    target = models["self"]
    prompts = [PROMPTS[0] + " and again", PROMPTS[0] + " once more", PROMPTS[1]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = _plain(target, prompts, sp, block_size=4)
    llm = LLM(target, block_size=4, speculative_config=_spec(target))
    assert _run(llm, prompts, sp) == ref
    hits = llm.engine.stats().prefix_cache_hits
    assert _run(llm, prompts, sp) == ref
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > hits
    assert stats.extra["spec_accepted_tokens"] == stats.extra["spec_draft_tokens"] > 0


@pytest.mark.parametrize("draft", ["self", "near"])
def test_preemption_recomputes_both_caches(models, draft):
    target = models["self"]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _plain(target, PROMPTS, sp, block_size=4)
    tight = LLM(target, block_size=4, max_num_batched_tokens=32, num_gpu_blocks_override=24,
                speculative_config=_spec(models[draft]))
    assert _run(tight, PROMPTS, sp) == ref
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.extra["spec_accepted_tokens"] > 0
    if draft == "self":
        assert stats.extra["spec_accepted_tokens"] == stats.extra["spec_draft_tokens"]


def test_restricted_requests_keep_the_draft_current(models):
    """Logprobs, min_tokens and prompt-logprobs requests speculate beside plain ones, and the draft runs on every
    request's tokens: a self-draft's drafts are all accepted (min_tokens bans only a stop token the run never emits
    here). (Penalized requests: tests/model/test_logprob_ranks.py; the rest:
    tests/model/test_constrained_speculation.py.)"""
    target = models["self"]
    sps = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=12),
           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1),
           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    ref = _plain(target, PROMPTS, sps, block_size=4)
    llm = LLM(target, block_size=4, speculative_config=_spec(target))
    assert _run(llm, PROMPTS, sps) == ref
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] == extra["spec_draft_tokens"] > 0


def test_sampled_requests_speculate_and_repeat(models):
    """Seeded sampled requests take the draft's greedy tokens as deterministic drafts (Sampler.verify_drafts keeps
    the target's distribution: tests/unit/test_speculative.py); they repeat from run to run, and the greedy
    requests beside them keep plain decoding's tokens."""
    target = models["self"]
    sps = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)] * 2
    ref = _plain(target, PROMPTS, sps, block_size=4)
    runs = []
    for _ in range(2):
        llm = LLM(target, block_size=4, speculative_config=_spec(models["near"]))
        runs.append(_run(llm, PROMPTS, sps))
        assert llm.engine.stats().extra["spec_accepted_tokens"] > 0
    assert runs[0] == runs[1]
    assert [runs[0][i] for i in (0, 2)] == [ref[i] for i in (0, 2)]
    assert all(len(t) == 40 for t in runs[0])


def test_sampled_self_draft_accepts_nearly_everything(models):
    """Drawn from q = p (the target as its own draft), a draft is accepted with probability min(1, p / q) = 1 up to
    rounding: a verification row paired with another row's q (or pass's) would reject often."""
    target = models["self"]
    # (high temperatures: the tiny models' distributions are peaked, where a wrong q would still often accept)
    sps = [SamplingParams(temperature=t, seed=s, max_tokens=40, ignore_eos=True, top_k=k)
           for t, s, k in ((2.5, 1, 0), (3.0, 2, 50), (2.0, 3, 0), (0, None, 0))]
    llm = LLM(target, block_size=4, speculative_config=_spec(target))
    _run(llm, PROMPTS, sps)
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] >= 0.99 * extra["spec_draft_tokens"] > 0


def test_stops_inside_accepted_drafts(models):
    target = models["self"]
    ref_llm = LLM(target, block_size=4)
    free = _run(ref_llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    llm = LLM(target, block_size=4, speculative_config=_spec(target))
    for sp in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[free[9]], ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)):
        assert _run(llm, PROMPTS[:1], sp) == _run(ref_llm, PROMPTS[:1], sp)


def test_blocks_hold_both_caches(models):
    """A KV block's bytes are the target's plus the draft's, so fewer blocks fit the same memory (here the CPU's
    cache bytes, with --max-num-seqs high enough not to cap the count), and the draft's cache has the target's
    blocks."""
    import gc

    target = models["self"]
    # blocks of 32 (not the default 16): 8x fewer block objects than blocks of 4 for the pool to build and gc to walk
    # in each engine's 2 GiB, and still 43690-87381 of them, far above the +-1 of rounding
    kw = dict(block_size=32, max_num_seqs=8192)
    plain = LLM(target, **kw).engine
    block_bytes, num_blocks = plain.runner.kv_block_bytes(), plain.kv.num_blocks
    del plain  # each engine's cache fills the CPU budget (2 GiB): one alive at a time
    gc.collect()
    for draft, layers in (("self", 3), ("other", 1)):
        engine = LLM(target, speculative_config=_spec(models[draft]), **kw).engine
        assert engine.runner.kv_block_bytes() == block_bytes * (3 + layers) // 3
        assert abs(engine.kv.num_blocks - num_blocks * 3 / (3 + layers)) <= 1
        caches = engine.runner.draft.kv_caches
        assert len(caches) == layers and caches[0].shape == engine.runner.kv_caches[0].shape
        del engine, caches
        gc.collect()


@pytest.mark.parametrize("max_num_seqs", [8, 4])
def test_proposal_passes_padded_like_graph_replays(models, monkeypatch, max_num_seqs):
    """The proposal passes' graph form (rows padded to the graph's batch size, the catch-up rows merged into the
    first pass or, past max_num_seqs rows, a pass of their own), computed eagerly: the self-draft still agrees
    everywhere, greedy and sampled, and the outputs are plain decoding's."""
    from voltllm.worker.draft_runner import DraftRunner

    def padded(self, n):
        return PaddedDecodePass(self, 1 << (n - 1).bit_length()) if n else None

    monkeypatch.setattr(DraftRunner, "_for_batch", padded)
    target = models["self"]
    prompts = PROMPTS + ["x y"]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 31, 27, 33, 29)]
    kw = dict(block_size=4, max_num_seqs=max_num_seqs)
    llm = LLM(target, speculative_config=_spec(target), **kw)
    assert _run(llm, prompts, sps) == _plain(target, prompts, sps, **kw)
    sampled = [SamplingParams(temperature=2.5, seed=i, max_tokens=30, ignore_eos=True) for i in range(5)]
    _run(llm, prompts, sampled)
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] >= 0.99 * extra["spec_draft_tokens"] > 0


def test_fp8_kv_cache(models):
    """The draft's cache takes the target's KV dtype (fp8 codes with scales calculated on the first step here)."""
    target = models["self"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(block_size=4, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    llm = LLM(target, speculative_config=_spec(target), **kw)
    assert llm.engine.runner.draft.kv_caches[0].dtype == torch.uint8
    assert _run(llm, PROMPTS[:2], sp) == _plain(target, PROMPTS[:2], sp, **kw)
    extra = llm.engine.stats().extra
    assert extra["spec_accepted_tokens"] == extra["spec_draft_tokens"] > 0


def test_bad_configs_are_refused(models, tmp_path):
    from voltllm.config import ConfigError

    target = models["self"]
    wide = make_model(str(tmp_path / "wide"), "llama", vocab_size=512)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(target, speculative_config=_spec(wide))
    with pytest.raises(ConfigError, match="unsupported keys for draft_model: prompt_lookup_max"):
        LLM(target, speculative_config={**_spec(target), "prompt_lookup_max": 3})
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size"):
        LLM(target, speculative_config={**_spec(target), "draft_tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="cannot load the draft model"):
        LLM(target, speculative_config=_spec(str(tmp_path / "missing")))
    # a draft of fewer positions drafts up to them (tests/model/test_dynamic_speculation.py); a speculative
    # max_model_len past them is refused
    short = make_model(str(tmp_path / "short"), "llama", max_position_embeddings=64)
    with pytest.raises(ConfigError, match="exceeds the draft model's 64 positions"):
        LLM(target, max_model_len=128, speculative_config={**_spec(short), "max_model_len": 100})


def test_hybrid_drafts_are_refused(models, tmp_path):
    """A Gated DeltaNet draft's state cannot live in the target's KV blocks (hybrid targets do speculate:
    tests/model/test_hybrid_speculation.py)."""
    from tiny_models import make_tiny_hybrid
    from voltllm.config import ConfigError

    hybrid = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", seed=0, gen_seed=1)
    if hybrid is None:
        pytest.skip("this transformers has no qwen3_5")
    with pytest.raises(ConfigError, match="draft model must be attention-only"):
        LLM(models["self"], speculative_config=_spec(hybrid))
