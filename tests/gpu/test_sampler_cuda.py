"""The sampler on CUDA logits never synchronises the stream (async scheduling depends on it): min_tokens bans,
greedy and seeded random rows, top-k / top-p, logprobs, penalties, logit_bias, allowed_token_ids, bad words, all under
torch's sync debug mode;
and the greedy-only batch under min_tokens that bans in the runner's own fp16 logits (logits_owned)."""
import pytest
import torch

from voltllm.sampling.params import SamplingParams
from voltllm.sampling.sampler import Sampler, SamplingRow

pytestmark = pytest.mark.gpu


def _row(out=(), gen=None, **kw):
    return SamplingRow(SamplingParams(**kw), [], list(out), gen)


def test_sample_does_not_sync_the_stream():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000, device="cuda", dtype=torch.float16)
    top = logits.float().argmax(-1).tolist()
    rows = [_row(temperature=0, min_tokens=3, stop_token_ids=[top[0], 5]),  # bans its argmax
            _row(temperature=0),
            _row(temperature=0.8, top_p=0.9, top_k=50, gen=torch.Generator(device="cuda").manual_seed(1)),
            _row(temperature=0, min_tokens=2, stop_token_ids=[top[3]], logprobs=2),
            _row(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, out=[1, 2, 2]),
            _row(temperature=0, logit_bias={17: 100.0, top[5]: -100.0}),
            _row(temperature=0, allowed_token_ids=[3, 40, 999]),
            _row(temperature=0.7, out=[8, 9], _bad_words_token_ids=((top[7],), (9, 11)),
                 gen=torch.Generator(device="cuda").manual_seed(2))]
    sampler = Sampler()
    sampler.sample(logits, rows)  # warm-up (first-call allocations, pinned pool)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler.sample(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    toks = out.tokens.tolist()
    assert toks[0] != top[0] and toks[1] == top[1] and toks[3] != top[3] and toks[5] == 17
    assert toks[6] == [3, 40, 999][int(logits[6, [3, 40, 999]].float().argmax())] and toks[7] not in (top[7], 11)
    masked = logits.float()
    masked[0, [top[0], 5]] = float("-inf")
    assert toks[0] == int(masked[0].argmax())


def test_greedy_bans_in_owned_fp16_logits_do_not_sync():
    logits = torch.randn(64, 50000, device="cuda", dtype=torch.float16)
    top = logits.float().argmax(-1)
    rows = [_row(temperature=0, min_tokens=4, stop_token_ids=[int(top[i])]) for i in range(64)]
    want = logits.float()
    want[torch.arange(64, device="cuda"), top] = float("-inf")
    want = want.argmax(-1)
    sampler = Sampler()
    sampler.sample(logits.clone(), rows, logits_owned=True)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler.sample(logits, rows, logits_owned=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.tokens, want) and logits.dtype == torch.float16
