"""LLM.beam_search on a tiny random llama against a plain beam search written here over transformers' full next-token
logprobs of the same model: the same best sequences in the same order, the same scores, EOS handling (a common token
declared an EOS id in generation_config.json), length_penalty's effect on the ranking, and the refusals."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from beam_reference import Reference
from tiny_models import make_model
from voltllm import LLM, BeamSearchParams
from voltllm.engine.beam_search import beam_search_score

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "What is the capital of France?", "def add(a, b):"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "llama", max_position_embeddings=128)


@pytest.fixture(scope="module")
def ref(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(tiny_path, block_size=4, max_num_seqs=16)


def _ids(llm, prompt: str) -> list[int]:
    return llm.get_tokenizer().encode(prompt)


def _check_same(llm, got, want, eos: set[int], num_prompt: int, length_penalty: float = 1.0):
    assert [s.tokens for s in got.sequences] == [w[0] for w in want]
    for seq, (tokens, cum) in zip(got.sequences, want):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
        assert beam_search_score(seq.tokens, seq.cum_logprob, eos, length_penalty) == pytest.approx(
            cum / (len(tokens) - (tokens[-1] in eos)) ** length_penalty, abs=1e-4)
        assert seq.finish_reason == ("stop" if tokens[-1] in eos else "length")
        assert seq.stop_reason == (tokens[-1] if tokens[-1] in eos else None)
        assert len(seq.logprobs) == len(tokens) - num_prompt  # one dict per generated token
        assert all(t in pos for t, pos in zip(tokens[num_prompt:], seq.logprobs))
        assert seq.text == llm.get_tokenizer().decode(tokens[:-1] if tokens[-1] in eos else tokens)


@pytest.mark.parametrize("width,max_tokens", [(1, 6), (3, 5), (4, 4)])
def test_matches_the_reference(llm, ref, width, max_tokens):
    eos = set(llm.frontend.eos_ids)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    reference = Reference(ref)
    for prompt, out in zip(PROMPTS, outs):
        ids = _ids(llm, prompt)
        want = reference.search(ids, width, max_tokens, eos)
        _check_same(llm, out, want, eos, len(ids))
        assert all(len(s.logprobs) == max_tokens and len(s.logprobs[0]) >= 2 * width for s in out.sequences)


def test_prefix_cache_serves_the_steps(llm):
    before = llm.engine.stats().prefix_cache_hits
    llm.beam_search([PROMPTS[1] * 2], BeamSearchParams(beam_width=2, max_tokens=6))
    # each later step finds at least one block (4 tokens) of its beam's earlier tokens in the cache
    assert llm.engine.stats().prefix_cache_hits - before >= 5 * 2 * 4


def test_concurrency_limit_and_prompt_forms_give_the_same_answer(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    whole = llm.beam_search(PROMPTS, params)
    forms = [PROMPTS[0], {"prompt": PROMPTS[1]}, {"prompt_token_ids": _ids(llm, PROMPTS[2])}]
    limited = llm.beam_search(forms, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in limited] == [[s.tokens for s in o.sequences] for o in whole]
    bars = []

    class Bar:  # a tqdm-like factory
        def __init__(self, **kw):
            self.kw, self.n, self.closed = kw, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    llm.beam_search(PROMPTS[:2], params, use_tqdm=Bar, concurrency_limit=1)
    assert bars[0].kw["total"] == bars[0].n == 8 and bars[0].closed  # a tick per step of each batch of prompts


@pytest.fixture(scope="module")
def eos_model(tiny_path, ref, tmp_path_factory):
    """The tiny model with a token its beams often meet declared an EOS id (generation_config.json), so that some
    beams end early: (path, the EOS ids)."""
    reference = Reference(ref)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    counts: dict[int, int] = {}
    for prompt in PROMPTS:
        for tokens, _ in reference.search(tok.encode(prompt), 3, 4, {tok.eos_token_id}):
            for t in tokens[len(tok.encode(prompt)) + 1:]:
                counts[t] = counts.get(t, 0) + 1
    common = max(counts, key=counts.get)
    path = str(tmp_path_factory.mktemp("tiny_eos"))
    for name in os.listdir(tiny_path):
        shutil.copy(os.path.join(tiny_path, name), path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.eos_token_id, common]}, f)
    return path, {tok.eos_token_id, common}


@pytest.fixture(scope="module")
def eos_llm(eos_model):
    return LLM(eos_model[0], block_size=4, max_num_seqs=16)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 3.0])
def test_eos_beams_end_and_length_penalty_ranks(eos_llm, ref, eos_model, length_penalty):
    _, eos = eos_model
    assert set(eos_llm.frontend.eos_ids) == eos
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=length_penalty)
    outs = eos_llm.beam_search(PROMPTS, params)
    reference = Reference(ref)
    ended = 0
    for prompt, out in zip(PROMPTS, outs):
        ids = _ids(eos_llm, prompt)
        want = reference.search(ids, 3, 6, eos, length_penalty)
        _check_same(eos_llm, out, want, eos, len(ids), length_penalty)
        ended += sum(s.finish_reason == "stop" for s in out.sequences)
    if length_penalty == 0.0:
        assert ended  # the raw cumulative logprob favours the short beams: some of the best ended on the EOS


def test_length_penalty_changes_the_ranking(eos_llm):
    def ranked(length_penalty: float) -> list[list[int]]:
        outs = eos_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6,
                                                             length_penalty=length_penalty))
        return [[len(s.tokens) for s in o.sequences] for o in outs]

    short, long = ranked(0.0), ranked(3.0)
    assert short != long
    # raw cumulative logprob favours the short beams first, a large penalty exponent the long ones
    assert sum(r[0] for r in short) < sum(r[0] for r in long)


def test_ignore_eos_and_include_stop_str(eos_llm, ref, eos_model):
    _, eos = eos_model
    out = eos_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    reference = Reference(ref)
    for prompt, o in zip(PROMPTS, out):
        want = reference.search(_ids(eos_llm, prompt), 3, 5, eos, ignore_eos=True)
        assert [s.tokens for s in o.sequences] == [w[0] for w in want]
        assert all(s.finish_reason == "length" and len(s.tokens) == len(w[0]) for s, w in zip(o.sequences, want))
    tok = eos_llm.get_tokenizer()
    for include in (False, True):
        outs = eos_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6,
                                                             include_stop_str_in_output=include))
        stopped = [s for o in outs for s in o.sequences if s.finish_reason == "stop"]
        assert stopped
        for s in stopped:  # the tokens keep the EOS (vLLM's offline shape); its text only when asked
            assert s.tokens[-1] in eos
            assert s.text == tok.decode(s.tokens if include else s.tokens[:-1])


def test_refusals(llm, tiny_path):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.beam_search(["x " * 100], BeamSearchParams(beam_width=2, max_tokens=100))
    with pytest.raises(ValueError, match="lora_request: LoRA is not enabled"):  # (with it: test_lora_beam_search.py)
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS, {"beam_width": 2})
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    capped = LLM(tiny_path, block_size=4, max_logprobs=4)
    with pytest.raises(ValueError, match="max_logprobs"):
        capped.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=2))
    assert len(capped.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences) == 2
