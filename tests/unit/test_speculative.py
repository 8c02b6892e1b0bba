"""Speculative decoding's pieces (engine/speculative.py): --speculative-config parsing (n-gram and draft model), the
n-gram index and its proposals, greedy acceptance, which requests may speculate, speculative sampling with
deterministic and drawn drafts, the draft model's vocabulary checks."""
from types import SimpleNamespace

import pytest

from voltllm.engine.speculative import (NgramIndex, SpeculativeConfig, SpeculativeConfigError, accept_drafts,
                                        accept_sampled, spec_allowed)


def test_config():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 4, 2)
    assert SpeculativeConfig.from_dict({"method": "[ngram]", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 6}).prompt_lookup_max == 6
    for bad, msg in [({"method": "eagle", "num_speculative_tokens": 3}, "needs \"model\""),
                     ({"method": "medusa", "num_speculative_tokens": 3}, "not built yet"),
                     ({"method": "ngram"}, "num_speculative_tokens"),
                     ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
                       "prompt_lookup_max": 3}, "exceeds"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
                      "unsupported keys")]:
        with pytest.raises(SpeculativeConfigError, match=msg):
            SpeculativeConfig.from_dict(bad)


def test_dynamic_draft_schedule():
    """vLLM's num_speculative_tokens_per_batch_size (or speculative_token_schedule): drafts per step by batch size,
    the range before a gap (or past the last) holding, capped at num_speculative_tokens; checked as vLLM checks it."""
    base = {"method": "ngram", "num_speculative_tokens": 4}
    c = SpeculativeConfig.from_dict({**base, "num_speculative_tokens_per_batch_size": [[17, 32, 2], [1, 16, 6],
                                                                                         [64, 128, 0]]})
    assert c.draft_schedule == ((1, 16, 6), (17, 32, 2), (64, 128, 0))
    assert [c.drafts_for_batch(b) for b in (1, 16, 17, 32, 33, 63, 64, 128, 500)] == [4, 4, 2, 2, 2, 2, 0, 0, 0]
    assert SpeculativeConfig.from_dict(base).drafts_for_batch(300) == 4 and not SpeculativeConfig.from_dict(
        base).draft_schedule
    newer = SpeculativeConfig.from_dict({**base, "speculative_token_schedule": [[1, 8, 3], [9, 9, 1]]})
    assert [newer.drafts_for_batch(b) for b in (8, 9, 10)] == [3, 1, 1]
    key = "num_speculative_tokens_per_batch_size"
    for schedule, msg in [([], "non-empty list"), ("1,2,3", "non-empty list"), ([[2, 8, 1]], "start at 1"),
                          ([[1, 8, 1], [8, 9, 0]], "overlap at 8"), ([[1, 8, -1]], ">= 0"),
                          ([[1, 0, 1]], "first <= last"), ([[1, 8]], "three integers"), ([[1, 8, 1.5]], "three"),
                          ([[1, 8, 1, 4096, 2]], "context length")]:
        with pytest.raises(SpeculativeConfigError, match=msg):
            SpeculativeConfig.from_dict({**base, key: schedule})
    with pytest.raises(SpeculativeConfigError, match="not both"):
        SpeculativeConfig.from_dict({**base, key: [[1, 2, 1]], "speculative_token_schedule": [[1, 2, 1]]})
    assert SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
                                        key: [[1, 4, 2], [5, 99, 0]]}).drafts_for_batch(5) == 0


def _brute(tokens, lo, hi, k):
    """The most recent earlier occurrence of the longest suffix of length hi..lo, by scanning."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_ngram_index_matches_a_scan_as_tokens_grow():
    import random

    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(40)]
    index = NgramIndex(2, 4)
    for _ in range(200):
        assert index.propose(tokens, 3) == _brute(tokens, 2, 4, 3)
        tokens.append(rng.randrange(6))


def test_proposals():
    index = NgramIndex(1, 3)
    assert index.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # "1 2" was followed by 3 4 1
    assert NgramIndex(2, 3).propose([1, 2, 3, 9, 2], 2) == []  # no earlier "9 2", "2" alone is below min
    assert NgramIndex(1, 3).propose([5], 2) == []
    assert NgramIndex(1, 2).propose([7, 7, 7], 4) == [7]  # the latest "7 7" ended one before the last


def test_accept_drafts():
    assert accept_drafts([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_drafts([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_drafts([5], [4, 4]) == [4]


def test_spec_allowed():
    from voltllm.sampling.params import SamplingParams

    def req(**kw):
        base = dict(sampling_params=SamplingParams(temperature=0.7), num_pending=0, needs_host_history=False,
                    max_tokens=10, num_output_tokens=7)
        return SimpleNamespace(**{**base, **kw})

    assert spec_allowed(req(), 5) == 2  # room for 2 drafts and the model's next token; sampled requests too
    assert spec_allowed(req(num_pending=1), 5) == 0
    # penalties and bad words: the verification applies them (Sampler.verify_drafts: the drafts before each row)
    assert spec_allowed(req(sampling_params=SamplingParams(repetition_penalty=1.2)), 5) == 2
    assert spec_allowed(req(sampling_params=SamplingParams(bad_words=["x y"])), 5) == 2
    assert spec_allowed(req(sampling_params=SamplingParams(prompt_logprobs=1)), 5) == 2  # (the prompt steps')
    assert spec_allowed(req(sampling_params=SamplingParams(logprobs=2)), 5) == 2  # (the verification's: SpecLogprobs)
    # min_tokens' stop bans and allowed_token_ids: the verification applies them to each row
    assert spec_allowed(req(sampling_params=SamplingParams(min_tokens=8)), 5) == 2
    assert spec_allowed(req(sampling_params=SamplingParams(allowed_token_ids=[1, 2])), 5) == 2


def test_accept_sampled():
    assert accept_sampled([5, 6], [True, True, False], [1, 2, 3]) == [5, 6, 3]
    assert accept_sampled([5, 6], [True, False, False], [1, 2, 3]) == [5, 2]
    assert accept_sampled([], [False], [4]) == [4]


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                    dict(temperature=1.3, top_p=0.8, min_p=0.02), dict(temperature=0.0)])
def test_verified_tokens_keep_the_distribution(params):
    """One logits row with a draft, verified 40,000 times: the emitted token (the draft when accepted, else the
    replacement) is distributed as the processed distribution p, whichever draft is proposed (likely or not)."""
    import torch

    from voltllm.sampling.params import SamplingParams
    from voltllm.sampling.sampler import Sampler, SamplingRow, _shaped_probs

    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    sp = SamplingParams(**params)
    row = SamplingRow(sp, [], (), None, 0)
    want = (_shaped_probs(logits, [row])[0] if not sp.greedy
            else torch.nn.functional.one_hot(logits.argmax(-1), 12)[0].float())
    sampler = Sampler(torch.Generator().manual_seed(1))
    n = 40_000
    for draft in (int(want.argmax()), int(want.argmin())):
        out = sampler.verify_drafts(logits.expand(n, 12), [row] * n, [draft] * n)
        tokens, accepted = out.tokens, out.accepted
        emitted = torch.where(accepted, torch.full_like(tokens, draft), tokens)
        got = torch.bincount(emitted, minlength=12).float() / n
        assert float((got - want).abs().sum()) / 2 < 0.015, (draft, got, want)
        assert abs(float(accepted.float().mean()) - float(want[draft])) < 0.015
    bonus = sampler.verify_drafts(logits.expand(n, 12), [row] * n, [-1] * n)  # rows after the last draft
    assert not bonus.accepted.any()
    got = torch.bincount(bonus.tokens, minlength=12).float() / n
    assert float((got - want).abs().sum()) / 2 < 0.015


def test_engine_config(monkeypatch):
    from voltllm.config import ConfigError, _resolve_speculative

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert _resolve_speculative(None, SimpleNamespace(model_type="qwen3")) is None
    assert _resolve_speculative(spec, SimpleNamespace(model_type="qwen3")).num_speculative_tokens == 3
    assert _resolve_speculative(spec, SimpleNamespace(model_type="qwen3_next")).num_speculative_tokens == 3
    draft = _resolve_speculative({"model": "d", "num_speculative_tokens": 2}, SimpleNamespace(model_type="qwen3_5"))
    assert draft.uses_draft_model
    dflash = {"method": "dflash", "model": "d", "num_speculative_tokens": 2}
    assert _resolve_speculative(dflash, SimpleNamespace(model_type="qwen3_next")).uses_dflash
    monkeypatch.setattr("voltllm.config.HYBRID_SPEC_METHODS", ("draft_model",))  # a method not built for hybrids
    with pytest.raises(ConfigError, match="not built for hybrid targets"):
        _resolve_speculative(spec, SimpleNamespace(model_type="qwen3_next"))
    assert _resolve_speculative(spec, SimpleNamespace(model_type="qwen3")).method == "ngram"
    with pytest.raises(ConfigError, match="not built yet"):
        _resolve_speculative({"method": "medusa", "num_speculative_tokens": 3}, SimpleNamespace(model_type="qwen3"))
    monkeypatch.undo()
    eagle3 = {"method": "eagle3", "model": "h", "num_speculative_tokens": 3}
    assert _resolve_speculative(eagle3, SimpleNamespace(model_type="qwen3")).uses_eagle3
    assert _resolve_speculative(eagle3, SimpleNamespace(model_type="qwen3_next")).uses_eagle3


def test_metrics_export_the_counters():
    from prometheus_client import generate_latest

    from voltllm.engine.types import SchedulerStats
    from voltllm.entrypoints.openai.metrics import ServerMetrics

    from voltllm.entrypoints.openai.cli_serve import spec_summary

    extra = {"spec_draft_tokens": 40, "spec_accepted_tokens": 9, "spec_drafts": 12,
             "spec_drafted_per_pos": [12, 12, 10, 6], "spec_accepted_per_pos": [6, 2, 1, 0]}
    stats = SchedulerStats(extra=extra)
    text = generate_latest(ServerMetrics("m", lambda: stats, lambda: True, lambda: 0,
                                         max_model_len=64).registry).decode()
    assert 'voltllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0' in text
    assert 'voltllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0' in text
    assert 'voltllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0' in text
    assert 'voltllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0' in text
    assert spec_summary(extra) == (", drafts accepted 22.5% (mean acceptance length 1.75, per position 0.50, 0.17, "
                                   "0.10, 0.00)")
    assert spec_summary({"spec_draft_tokens": 0}) == ""
    plain = generate_latest(ServerMetrics("m", SchedulerStats, lambda: True, lambda: 0,
                                          max_model_len=64).registry).decode()
    assert "spec_decode" not in plain


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                    dict(temperature=1.3, top_p=0.8, min_p=0.02)])
def test_drafts_drawn_from_a_draft_model_keep_the_distribution(params):
    """A draft model's draft d ~ q (Sampler.draw_drafts, the draft's logits processed like the target's), verified
    against the target's p 40,000 times: the emitted token is distributed as p, and a draft is accepted as often as
    speculative sampling promises, sum over x of min(p(x), q(x)). Deterministic (n-gram) drafts in the same call
    keep their own rule."""
    import torch

    from voltllm.sampling.params import SamplingParams
    from voltllm.sampling.sampler import Sampler, SamplingRow, _shaped_probs

    torch.manual_seed(0)
    target, draft = torch.randn(1, 12) * 2, torch.randn(1, 12) * 2
    sp = SamplingParams(**params)
    row = SamplingRow(sp, [], (), None, 0)
    p, q = _shaped_probs(target, [row])[0], _shaped_probs(draft, [row])[0]
    sampler = Sampler(torch.Generator().manual_seed(1))
    n = 40_000
    d, q_rows = sampler.draw_drafts(draft.expand(n, 12), [row] * n)
    assert torch.allclose(q_rows[0], q)
    got_q = torch.bincount(d, minlength=12).float() / n
    assert float((got_q - q).abs().sum()) / 2 < 0.015  # the drafts follow q
    # half the rows carry drawn drafts, the other half one deterministic draft (the target's least likely token)
    fixed = int(p.argmin())
    drafts = [int(x) if i % 2 == 0 else fixed for i, x in enumerate(d.tolist())]
    drawn = [i % 2 == 0 for i in range(n)]
    out = sampler.verify_drafts(target.expand(n, 12), [row] * n, drafts, q_rows, drawn)
    emitted = torch.where(out.accepted, torch.tensor(drafts), out.tokens)
    for half, accept_rate in ((slice(0, n, 2), float(torch.minimum(p, q).sum())), (slice(1, n, 2), float(p[fixed]))):
        got = torch.bincount(emitted[half], minlength=12).float() / (n // 2)
        assert float((got - p).abs().sum()) / 2 < 0.02, (half, got, p)
        assert abs(float(out.accepted[half].float().mean()) - accept_rate) < 0.015


def test_draft_config():
    c = SpeculativeConfig.from_dict({"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 4})
    assert (c.method, c.model, c.num_speculative_tokens, c.uses_draft_model) == ("draft_model", "Qwen/Qwen3-0.6B", 4,
                                                                                 True)
    assert SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
                                        "draft_tensor_parallel_size": 1}).model == "m"
    assert c.with_draft("/local/m", SimpleNamespace(vocab_size=3)).model == "/local/m"
    for bad, msg in [({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
                     ({"model": "m"}, "num_speculative_tokens"),
                     ({"model": "m", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, "unsupported keys"),
                     ({"model": "m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0}, "positive"),
                     ({"method": "eagle", "model": "m", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
                      "unsupported keys for eagle"),
                     ({"method": "ngram", "model": "m", "num_speculative_tokens": 2}, "unsupported keys for ngram")]:
        with pytest.raises(SpeculativeConfigError, match=msg):
            SpeculativeConfig.from_dict(bad)


def test_draft_tensor_parallel_size():
    """1 or the target's size (EngineArgs checks it): MTP, DFlash and the EAGLE heads split like the target unless 1, a
    draft model only when given the target's size; drafter_split follows -tp / -pp and the key."""
    par = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)
    for method, extra in (("mtp", {}), ("dflash", {"model": "m"}), ("eagle", {"model": "m"}),
                          ("eagle3", {"model": "m"})):
        base = {"method": method, "num_speculative_tokens": 2, **extra}
        assert SpeculativeConfig.from_dict(base).draft_tensor_parallel_size is None
        assert SpeculativeConfig.from_dict(base).drafter_split(par)
        assert SpeculativeConfig.from_dict({**base, "draft_tensor_parallel_size": 2}).drafter_split(par)
        assert not SpeculativeConfig.from_dict({**base, "draft_tensor_parallel_size": 1}).drafter_split(par)
        assert not SpeculativeConfig.from_dict(base).drafter_split(SimpleNamespace(tensor_parallel_size=1,
                                                                                   pipeline_parallel_size=1))
        assert not SpeculativeConfig.from_dict(base).drafter_split(SimpleNamespace(tensor_parallel_size=2,
                                                                                   pipeline_parallel_size=2))
        for bad in (0, "2", True, 1.5):
            with pytest.raises(SpeculativeConfigError, match="positive integer"):
                SpeculativeConfig.from_dict({**base, "draft_tensor_parallel_size": bad})
    draft = {"method": "draft_model", "model": "m", "num_speculative_tokens": 2}
    assert not SpeculativeConfig.from_dict(draft).drafter_split(par)
    assert not SpeculativeConfig.from_dict({**draft, "draft_tensor_parallel_size": 1}).drafter_split(par)
    assert SpeculativeConfig.from_dict({**draft, "draft_tensor_parallel_size": 2}).drafter_split(par)
    with pytest.raises(SpeculativeConfigError, match="positive integer"):
        SpeculativeConfig.from_dict({**draft, "draft_tensor_parallel_size": -1})


def test_drafter_keys():
    """vLLM's drafter keys: how drafts are drawn, eager drafter, and KV dtype / attention backend where they name
    what the drafter here does (the seed system's DFlash config parses)."""
    seed = {"method": "dflash", "model": "m", "num_speculative_tokens": 7, "kv_cache_dtype": "auto",
            "attention_backend": "FLASH_ATTN_V100", "draft_sample_method": "probabilistic", "enforce_eager": False}
    c = SpeculativeConfig.from_dict(seed)
    assert (c.method, c.draft_sample_method, c.draft_enforce_eager) == ("dflash", "probabilistic", False)
    c = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "greedy",
                                     "enforce_eager": True, "draft_kv_cache_dtype": "auto"})
    assert (c.method, c.draft_sample_method, c.draft_enforce_eager) == ("mtp", "greedy", True)
    for alias in ("qwen3_next_mtp", "qwen3_5_mtp"):  # vLLM's model-named spellings of the same method
        assert SpeculativeConfig.from_dict({"method": alias, "num_speculative_tokens": 1}).method == "mtp"
    assert SpeculativeConfig.from_dict({"model": "m", "num_speculative_tokens": 2}).draft_sample_method == \
        "probabilistic"
    assert not SpeculativeConfig.from_dict({"model": "m", "num_speculative_tokens": 2,
                                            "enforce_eager": None}).draft_enforce_eager
    base = {"method": "mtp", "num_speculative_tokens": 2}
    for extra, msg in [({"draft_sample_method": "topk"}, "draft_sample_method 'topk'"),
                       ({"enforce_eager": "yes"}, "enforce_eager must be true or false"),
                       ({"kv_cache_dtype": "fp8"}, "only \"auto\" is built"),
                       ({"draft_kv_cache_dtype": "fp8_e4m3"}, "draft_kv_cache_dtype"),
                       ({"attention_backend": "FLASHINFER"}, "attention_backend 'FLASHINFER'")]:
        with pytest.raises(SpeculativeConfigError, match=msg):
            SpeculativeConfig.from_dict({**base, **extra})
    with pytest.raises(SpeculativeConfigError, match="unsupported keys for ngram"):  # n-grams have no drafter
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "greedy"})


def test_draft_vocabulary_checks():
    from voltllm.engine.draft_model import check_vocabularies

    check_vocabularies(5, 5, {"a": 0, "b": 1}, {"a": 0, "b": 1})
    check_vocabularies(5, 5, None, {"a": 0})  # no tokenizer on one side: the sizes alone
    with pytest.raises(SpeculativeConfigError, match="vocabulary"):
        check_vocabularies(5, 6, None, None)
    with pytest.raises(SpeculativeConfigError, match="tokenizer differs.*first id 1"):
        check_vocabularies(5, 5, {"a": 0, "b": 1, "c": 2}, {"a": 0, "c": 1, "b": 2})
