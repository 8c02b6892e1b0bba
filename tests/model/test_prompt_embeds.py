"""--enable-prompt-embeds (vLLM's): a prompt given as embedding rows. Reference: the same prompt as token ids, whose
rows are the model's own embedding of them: greedy tokens and their logprobs must agree (dense, hybrid, chunked
prefill, prefix-cache hits keyed by the rows' content, preemption, -tp 2); other rows must change the output; bad input
is refused with what is wrong."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_model, make_tiny_hybrid
from voltllm import SamplingParams

IDS = [5, 17, 3, 60, 22, 9, 41, 8, 13, 77, 4, 30, 19, 2, 55, 61, 7, 12, 90, 33, 14]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


def _llm(path, **kw):
    from voltllm.entrypoints.llm import LLM

    kw.setdefault("max_num_seqs", 2)
    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, enable_prompt_embeds=True, **kw)


def _rows(llm, ids) -> torch.Tensor:
    """The model's own input embeddings of ids (what the engine computes for a token-id prompt)."""
    embed = llm.engine.runner.model.embed_tokens
    with torch.no_grad():
        return embed(torch.tensor(ids)).detach().clone()


def _same(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert x.keys() == y.keys()
        for k in x:
            assert abs(x[k].logprob - y[k].logprob) < 1e-4


def test_embeddings_of_the_ids_give_the_ids_output(tmp_path):
    llm = _llm(make_model(str(tmp_path / "tiny"), "llama"), block_size=4, enable_prefix_caching=False)
    want = llm.generate({"prompt_token_ids": IDS}, GREEDY, use_tqdm=False)[0]
    rows = _rows(llm, IDS)
    got = llm.generate({"prompt_embeds": rows}, GREEDY, use_tqdm=False)[0]
    _same(got, want)
    assert got.prompt_token_ids == [0] * len(IDS)  # placeholders, one per row
    assert got.outputs[0].text == want.outputs[0].text
    batched = llm.generate({"prompt_embeds": rows[None]}, GREEDY, use_tqdm=False)[0]  # a batch of one: squeezed
    _same(batched, want)
    other = rows.clone()
    other[3] = _rows(llm, [70])[0]
    changed = llm.generate({"prompt_embeds": other}, GREEDY, use_tqdm=False)[0]
    assert [lp[t].logprob for lp, t in zip(changed.outputs[0].logprobs, changed.outputs[0].token_ids)] != \
        [lp[t].logprob for lp, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]


def test_chunked_prompts_in_one_batch_with_token_prompts(tmp_path):
    """Prompt chunks of 8 tokens per step (several steps per prompt), an embeddings prompt beside two id prompts
    and a second embeddings prompt in fp16 rows (converted to the model's dtype)."""
    llm = _llm(make_model(str(tmp_path / "tiny"), "llama"), block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
               enable_prefix_caching=False)
    other = [9, 1, 44, 23, 5]
    want = llm.generate([{"prompt_token_ids": IDS}, {"prompt_token_ids": other}], GREEDY, use_tqdm=False)
    got = llm.generate([{"prompt_token_ids": IDS}, {"prompt_embeds": _rows(llm, IDS)},
                        {"prompt_embeds": _rows(llm, other).half().float()}, {"prompt_token_ids": other}],
                       GREEDY, use_tqdm=False)
    _same(got[0], want[0])
    _same(got[1], want[0])
    assert got[2].outputs[0].token_ids == want[1].outputs[0].token_ids  # (fp16 rows: close, not equal, logprobs)
    _same(got[3], want[1])


def test_prefix_cache_hits_follow_the_rows(tmp_path):
    llm = _llm(make_model(str(tmp_path / "tiny"), "llama"), block_size=4)
    rows = _rows(llm, IDS)
    first = llm.generate({"prompt_embeds": rows}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": rows.clone()}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 20  # (the last token is always computed)
    _same(again, first)
    # the same ids as a token prompt, and rows differing from row 16 on: hits only where the content agrees
    assert llm.generate({"prompt_token_ids": IDS}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    half = rows.clone()
    half[16:] = _rows(llm, IDS[:5])
    assert llm.generate({"prompt_embeds": half}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 16
    # rows differing from row 4 on (inside the first 16 rows): the first block of 4 still hits (spans never cross
    # a block)
    quarter = rows.clone()
    quarter[4:] += 0.5
    assert llm.generate({"prompt_embeds": quarter}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 4


def test_a_hybrid_model(tmp_path):
    path = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", seed=0, gen_seed=0)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    llm = _llm(path, skip_tokenizer_init=True, block_size=16, mamba_block_size=16)
    want = llm.generate({"prompt_token_ids": IDS}, GREEDY, use_tqdm=False)[0]
    _same(llm.generate({"prompt_embeds": _rows(llm, IDS)}, GREEDY, use_tqdm=False)[0], want)


def test_preempted_requests_recompute_from_their_rows(tmp_path):
    """Too few blocks for both requests' outputs: one is preempted and computes its prompt again later."""
    llm = _llm(make_model(str(tmp_path / "tiny"), "llama"), block_size=4, num_gpu_blocks_override=12,
               enable_prefix_caching=False)
    long = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": IDS[:10]}] * 2, long, use_tqdm=False)]
    rows = _rows(llm, IDS[:10])
    got = llm.generate([{"prompt_embeds": rows}, {"prompt_embeds": rows}], long, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("value,message", [
    ("text", "prompt_embeds must be a torch tensor, got str"),
    (torch.zeros(2, 3, 64), "must be [tokens, hidden_size], got shape [2, 3, 64]"),
    (torch.zeros(4, 7), "prompt_embeds rows have 7 values; this model's hidden size is 64"),
    (torch.zeros(0, 64), "prompt_embeds has no rows"),
    (torch.zeros(4, 64, dtype=torch.int64), "must be float16, bfloat16 or float32, got torch.int64"),
    (torch.full((4, 64), float("nan")), "prompt_embeds holds inf or NaN values"),
])
def test_bad_rows_are_refused(tmp_path, value, message):
    from voltllm.engine.frontend import InvalidPromptError

    llm = _llm(make_model(str(tmp_path / "tiny"), "llama", hidden_size=64))
    with pytest.raises(InvalidPromptError, match=message.replace("[", r"\[").replace("]", r"\]")):
        llm.generate({"prompt_embeds": value}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_refused_without_the_flag_and_for_prompt_logprobs(tmp_path):
    from voltllm.engine.frontend import InvalidPromptError
    from voltllm.entrypoints.llm import LLM

    path = make_model(str(tmp_path / "tiny"), "llama")
    off = LLM(path, device="cpu", dtype="float32", enforce_eager=True)
    with pytest.raises(InvalidPromptError, match="prompt_embeds need the engine started with --enable-prompt-embeds"):
        off.generate({"prompt_embeds": torch.zeros(3, off.engine.config.model.prompt_embeds_width or 1)},
                     use_tqdm=False)
    on = _llm(path)
    with pytest.raises(InvalidPromptError, match="prompt_logprobs are not computed for prompt_embeds"):
        on.generate({"prompt_embeds": _rows(on, IDS)}, SamplingParams(max_tokens=2, prompt_logprobs=1),
                    use_tqdm=False)


def test_two_tensor_parallel_ranks(tmp_path):
    """Rank 0 broadcasts the rows of each step's prompt tokens after the input ids (chunked prompts of 7 tokens)."""
    path = make_model(str(tmp_path / "tiny"), "llama")
    one = _llm(path, block_size=4, max_num_batched_tokens=7)
    two = _llm(path, block_size=4, max_num_batched_tokens=7, tensor_parallel_size=2)
    try:
        want = one.generate([{"prompt_token_ids": IDS}, {"prompt_token_ids": IDS[:9]}], GREEDY, use_tqdm=False)
        got = two.generate([{"prompt_embeds": _rows(one, IDS)}, {"prompt_token_ids": IDS[:9]}], GREEDY,
                           use_tqdm=False)
        for a, b in zip(got, want):
            _same(a, b)
    finally:
        two.engine.shutdown()


def test_two_pipeline_stages(tmp_path):
    """The first stage takes the rows; the second receives the broadcast and starts from hidden states."""
    path = make_model(str(tmp_path / "tiny"), "llama", num_hidden_layers=4)
    one = _llm(path, block_size=4, max_num_batched_tokens=7)
    two = _llm(path, block_size=4, max_num_batched_tokens=7, pipeline_parallel_size=2)
    try:
        want = one.generate({"prompt_token_ids": IDS}, GREEDY, use_tqdm=False)[0]
        _same(two.generate({"prompt_embeds": _rows(one, IDS)}, GREEDY, use_tqdm=False)[0], want)
    finally:
        two.engine.shutdown()


def test_a_prompt_dicts_cache_salt_keys_its_blocks(tmp_path):
    """vLLM's prompt dicts (token ids, embeddings) carry an optional cache_salt: the same prompt under another salt
    shares no block, under the same salt it hits."""
    llm = _llm(make_model(str(tmp_path / "tiny"), "llama"), block_size=4)
    rows = _rows(llm, IDS)
    for prompt in ({"prompt_token_ids": IDS}, {"prompt_embeds": rows}):
        first = llm.generate({**prompt, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)[0]
        other = llm.generate({**prompt, "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)[0]
        same = llm.generate({**prompt, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)[0]
        assert (first.num_cached_tokens, other.num_cached_tokens, same.num_cached_tokens) == (0, 0, 20)
        _same(same, first)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt_token_ids": IDS, "cache_salt": ""}, GREEDY, use_tqdm=False)


def test_sampling_params_truncate_prompt_tokens(tmp_path):
    """vLLM's SamplingParams.truncate_prompt_tokens offline: the last k tokens (or rows) answer as that prompt alone;
    -1 keeps what the context holds; 0 or below -1 are refused; extra_args is carried and changes nothing."""
    from voltllm.sampling.params import SamplingParamsError

    llm = _llm(make_model(str(tmp_path / "tiny"), "llama"), block_size=4, enable_prefix_caching=False)
    cut = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, truncate_prompt_tokens=7,
                         extra_args={"note": "kept"})
    want = llm.generate({"prompt_token_ids": IDS[-7:]}, GREEDY, use_tqdm=False)[0]
    for prompt in ({"prompt_token_ids": IDS}, {"prompt_embeds": _rows(llm, IDS)}):
        got = llm.generate(prompt, cut, use_tqdm=False)[0]
        assert len(got.prompt_token_ids) == 7
        _same(got, want)
    whole = llm.generate({"prompt_token_ids": IDS}, GREEDY.clone(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(whole.prompt_token_ids) == len(IDS)
    for bad in (0, -2, 1.5):
        with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens must be an integer >= 1"):
            SamplingParams(truncate_prompt_tokens=bad)
