import math

import pytest
import torch

from voltllm.sampling.params import SamplingParams
from voltllm.sampling.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p_min_p


def _row(**kw):
    gen = torch.Generator().manual_seed(kw.pop("gen_seed")) if "gen_seed" in kw else None
    out = kw.pop("out", [])
    prompt = kw.pop("prompt", [])
    return SamplingRow(SamplingParams(**kw), prompt, out, gen)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))
    keep = lambda **kw: torch.isfinite(apply_top_k_top_p_min_p(  # noqa: E731
        logits.clone(), torch.tensor([kw.get("k", -1)]), torch.tensor([kw.get("p", 1.0)]),
        torch.tensor([kw.get("m", 0.0)]))[0]).tolist()
    assert keep(k=2) == [True, True, False, False]
    assert keep(p=0.7) == [True, True, False, False]  # 0.5 < 0.7 needs the second token
    assert keep(p=0.5) == [True, False, False, False]
    assert keep(m=0.3) == [True, True, True, False]  # 0.10 < 0.3 * 0.5
    assert keep(p=0.01) == [True, False, False, False]  # the top token always survives


def test_penalties_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    row = _row(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, prompt=[0], out=[2, 2])
    got = apply_penalties(logits.clone(), [row])[0]
    exp = torch.tensor([2.0 / 2, -1.0, 0.5 / 2 - 0.5 * 2 - 0.25, 1.0])
    assert torch.allclose(got, exp)


def test_seeded_rows_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    s = Sampler()
    alone, _ = s(logits[:1].clone(), [_row(temperature=1.0, gen_seed=11)])
    batch, _ = s(logits.clone(), [_row(temperature=1.0, gen_seed=11)] + [_row(temperature=0.7)] * 3)
    assert batch[0] == alone[0]


def test_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None].repeat(4000, 1)
    toks, _ = Sampler(torch.Generator().manual_seed(0))(logits, [_row(temperature=1.0)] * 4000)
    freq = torch.bincount(torch.tensor(toks), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_greedy_logprobs_and_min_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    toks, lps = Sampler()(logits.clone(), [_row(temperature=0, logprobs=2)])
    assert toks == [1]
    ref = logits.log_softmax(-1)[0]
    assert set(lps[0]) == {1, 3} and math.isclose(lps[0][1][0], ref[1].item(), rel_tol=1e-6)
    assert [r for _, r in lps[0].values()] == [1, 2]
    row = _row(temperature=0, min_tokens=3, stop_token_ids=[1], out=[5])
    toks, _ = Sampler()(logits.clone(), [row])
    assert toks == [3]


def test_half_logits_greedy_and_masked():
    """fp16 / bf16 logits: a plain greedy batch takes their argmax as they are, a batch with min_tokens bans
    masks an fp32 copy; both give the fp32 answer and leave the caller's logits untouched."""
    torch.manual_seed(1)
    for dtype in (torch.float16, torch.bfloat16):
        logits = torch.randn(3, 40).to(dtype)
        logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index wins in both precisions
        before = logits.clone()
        greedy, _ = Sampler()(logits, [_row(temperature=0.0) for _ in range(3)])
        assert greedy == logits.float().argmax(-1).tolist() and greedy[1] == 7
        top = int(logits[0].float().argmax())
        masked, _ = Sampler()(logits, [_row(temperature=0.0, min_tokens=2, stop_token_ids=[top])]
                                      + [_row(temperature=0.0) for _ in range(2)])
        want = logits.float()
        want[0, top] = float("-inf")
        assert masked == want.argmax(-1).tolist() and masked[0] != top
        assert torch.equal(logits, before)


def test_owned_logits_take_the_bans_in_place():
    """The runner hands its fresh lm_head output over (logits_owned): a greedy batch under min_tokens then bans
    in that tensor's own dtype, no fp32 copy (the banned entries are -inf in it afterwards), with the fp32
    answer. Not owned, fp32 logits are left untouched too (float() of an fp32 tensor is no copy)."""
    torch.manual_seed(2)
    for dtype in (torch.float16, torch.float32):
        logits = torch.randn(4, 50).to(dtype)
        top = int(logits[2].float().argmax())
        rows = [_row(temperature=0.0) for _ in range(4)]
        rows[2] = _row(temperature=0.0, min_tokens=3, stop_token_ids=[top])
        want = logits.float()
        want[2, top] = float("-inf")
        before = logits.clone()
        assert Sampler()(logits, rows)[0] == want.argmax(-1).tolist()
        assert torch.equal(logits, before)
        out = Sampler().sample(logits, rows, logits_owned=True)
        assert out.tokens.tolist() == want.argmax(-1).tolist() and out.tokens[2] != top
        assert logits.dtype == dtype and logits[2, top] == float("-inf")
        before[2, top] = float("-inf")
        assert torch.equal(logits, before)  # nothing else written


def test_min_tokens_bans_several_ids_in_several_rows():
    """Rows under their min_tokens ban their stop ids and EOS (unless ignore_eos), each row only its own; a row past
    its minimum bans nothing."""
    logits = torch.zeros(3, 6)
    logits[:, 0], logits[:, 1], logits[:, 2] = 5.0, 4.0, 3.0  # preference 0 > 1 > 2 > the rest
    r0 = _row(temperature=0, min_tokens=4, stop_token_ids=[0, 1], out=[5])  # bans 0 and 1 -> 2
    r1 = _row(temperature=0, min_tokens=1, stop_token_ids=[0], out=[5, 5])  # past its minimum -> 0
    r2 = _row(temperature=0, min_tokens=9, stop_token_ids=[0])  # bans 0 -> 1
    toks, _ = Sampler()(logits.clone(), [r0, r1, r2])
    assert toks == [2, 0, 1]


def test_logit_bias_rows():
    """logit_bias adds to the fp32 logits of its own row only (greedy and sampled alike; +100 decides the token,
    -100 bans the favourite), after the min_tokens bans; half logits give the fp32 answer; the caller's logits
    are left as they were."""
    torch.manual_seed(3)
    logits = torch.randn(4, 30).to(torch.float16)
    before = logits.clone()
    fav = int(logits[1].float().argmax())
    rows = [_row(temperature=0.0, logit_bias={7: 100.0}), _row(temperature=0.0, logit_bias={fav: -100.0}),
            _row(temperature=0.0), _row(temperature=1.0, logit_bias={"11": 100})]
    toks, _ = Sampler()(logits, rows)
    want1 = logits[1].float().clone()
    want1[fav] -= 100.0
    assert toks == [7, int(want1.argmax()), int(logits[2].float().argmax()), 11]
    assert torch.equal(logits, before)
    # a bias can lift a token under min_tokens' ban only as far as -inf + bias = -inf
    banned, _ = Sampler()(logits, [_row(temperature=0.0, min_tokens=2, stop_token_ids=[5], logit_bias={5: 100.0})])
    assert banned[0] != 5


def test_logit_bias_params():
    from voltllm.sampling.params import SamplingParams, SamplingParamsError

    assert SamplingParams(logit_bias={"3": 150, 4: -2.5}).logit_bias == {3: 100.0, 4: -2.5}  # clamped to +-100
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({"x": 1}, {"-1": 1}, {"1.5": 1}, {-2: 1}, {1.0: 1}, {True: 1}, {1: float("nan")}, {1: "big"},
                {1: True}, [1, 2]):
        with pytest.raises(SamplingParamsError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("repetition_penalty", float("inf")), ("n", 0), ("n", 10 ** 23),
                                         ("seed", 2 ** 63), ("seed", -(2 ** 63) - 1)])
def test_values_the_device_cannot_take_are_refused(field, value):
    from voltllm.sampling.params import SamplingParams, SamplingParamsError

    with pytest.raises(SamplingParamsError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_limits_at_their_edges():
    from voltllm.sampling.params import MAX_N, SamplingParams

    assert SamplingParams(n=MAX_N).n == MAX_N and SamplingParams(seed=-(2 ** 63)).seed == -(2 ** 63)
    assert SamplingParams(top_k=2 ** 31 - 1).top_k == 2 ** 31 - 1
    assert SamplingParams(top_k=2 ** 31).top_k == SamplingParams(top_k=2 ** 80).top_k == -1  # all tokens


@pytest.mark.parametrize("kw,expect", [
    (dict(temperature=0), True),
    (dict(temperature=0, min_tokens=5, ignore_eos=True), True),  # nothing to ban
    (dict(temperature=0, min_tokens=5, _eos_token_ids=(2,)), False),  # EOS banned until 5 tokens
    (dict(temperature=0, min_tokens=5, stop_token_ids=[7], ignore_eos=True), False),
    (dict(temperature=0, stop_token_ids=[7], _eos_token_ids=(2,)), True),  # no min_tokens: no bans
    (dict(temperature=0, logprobs=0), False), (dict(temperature=0, logit_bias={3: 1.0}), False),
    (dict(temperature=0, repetition_penalty=1.1), False), (dict(temperature=0, presence_penalty=0.5), False),
    (dict(temperature=0.7), False),
])
def test_argmax_only_params_give_the_same_tokens(kw, expect):
    sp = SamplingParams(**kw)
    assert sp.argmax_only is expect
    if not expect:
        return
    logits = torch.randn(5, 40).half()
    rows = [SamplingRow(sp, [1, 2], [], None, 0) for _ in range(5)]
    s = Sampler()
    full, fast = s.sample(logits.clone(), rows), s.sample_argmax(logits.clone())
    assert torch.equal(full.tokens, fast.tokens) and full.num_logprobs == fast.num_logprobs
    assert full.to_host() == fast.to_host()


def _reference_position(logits_row: torch.Tensor, token: int, k: int) -> dict:
    """Plain PyTorch: the sampled token's logprob and vocabulary rank (entries with a logprob >= its own, as vLLM
    counts), then the top-k ranked 1..k."""
    lp = logits_row.float().log_softmax(-1)
    ref = {token: (lp[token].item(), int((lp >= lp[token]).sum()))}
    vals, ids = lp.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
    for r, (t, v) in enumerate(zip(ids.tolist(), vals.tolist()), 1):
        ref[t] = (v, r)
    return ref


def test_logprob_ranks_against_full_vocabulary_reference():
    """Every row that asked for logprobs gets its sampled token's rank in the whole vocabulary, also when the token
    is outside the top-k (hot temperature, logprobs 0 / 1); rows that did not ask get none; penalties and bias change
    the sampling, not the logprobs (raw, as vLLM's)."""
    torch.manual_seed(3)
    logits = torch.randn(6, 300) * 3
    rows = [_row(temperature=3.0, logprobs=1, gen_seed=1), _row(temperature=3.0, logprobs=0, gen_seed=2),
            _row(temperature=0.0, logprobs=4), _row(temperature=2.0),
            _row(temperature=2.5, logprobs=5, frequency_penalty=1.0, out=[1, 2, 2], gen_seed=4),
            _row(temperature=0.0, logprobs=2, logit_bias={7: 50.0})]
    outside = 0
    for _ in range(8):
        tokens, lps = Sampler(torch.Generator().manual_seed(5))(logits.clone(), rows)
        assert lps[3] is None
        for i, (tok, lp) in enumerate(zip(tokens, lps)):
            if lp is None:
                continue
            ref = _reference_position(logits[i], tok, rows[i].params.logprobs)
            assert list(lp) == list(ref)  # the sampled token first, then the top-k in rank order
            for t, (v, r) in lp.items():
                assert r == ref[t][1] and math.isclose(v, ref[t][0], rel_tol=1e-5, abs_tol=1e-6)
            outside += lp[tok][1] > max(rows[i].params.logprobs, 1)
        logits = logits.roll(1, dims=1)
    assert tokens[5] == 7 and lps[5][7][1] > 2  # biased into the sample, ranked by the raw logits
    assert lps[2][tokens[2]][1] == 1  # greedy: the argmax
    assert outside >= 4


def test_logprob_rank_counts_ties_as_vllm():
    """Tied logprobs: the sampled token ranks after every token tied with it (vLLM's >= count), so one outside the
    top-k never shares a rank with them."""
    logits = torch.tensor([[2.0, 2.0, 2.0, 0.0, 1.0]])
    _, lps = Sampler()(logits.clone(), [_row(temperature=0, logprobs=0, logit_bias={1: 10.0})])
    assert lps[0] == {1: (pytest.approx(logits.log_softmax(-1)[0, 1].item()), 3)}
    _, lps = Sampler()(logits.clone(), [_row(temperature=0, logprobs=1, logit_bias={4: 10.0})])
    (t, (_, r)), (top, (_, top_r)) = lps[0].items()
    assert (t, r, top_r) == (4, 4, 1) and top in (0, 1, 2)
