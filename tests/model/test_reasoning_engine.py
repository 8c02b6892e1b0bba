"""thinking_token_budget and structured outputs after the reasoning, offline on a tiny random qwen3 whose tokenizer
has "<think>" / "</think>" as single tokens (and one where they are several BPE tokens): the budget's exact count
and forced end, free reasoning then output that follows the schema, a first token that opens the reasoning or
starts the grammar; async scheduling on and off, n-gram speculation."""
import pytest

from structured_cases import SCHEMA, check_schema_output
from tiny_models import make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

THINK = ("<think>", "</think>")


@pytest.fixture(scope="module")
def think_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("think")), "qwen3", max_position_embeddings=256,
                      added_tokens=THINK)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, think_path):
    return LLM(think_path, block_size=4, max_num_batched_tokens=64, async_scheduling=request.param,
               reasoning_parser="qwen3")


def _ids(llm, text):
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def _greedy(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 24, "ignore_eos": True, **kw})


def _out(llm, prompt, params):
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]


def _check_clean(llm):
    assert len(llm.engine.reasoning) == 0 and len(llm.engine.grammars) == 0
    llm.engine.check_integrity()


def test_budget_cuts_the_reasoning_at_exactly_n_tokens(llm):
    s, e = (llm.get_tokenizer().convert_tokens_to_ids(t) for t in THINK)
    prompt = _ids(llm, "What is the capital of France?") + [s]  # the template opened the reasoning
    # (the bias keeps the random model from ending its reasoning itself; the forced end overrides it)
    free = _out(llm, prompt, _greedy(logit_bias={e: -100})).token_ids
    assert e not in free
    for n in (0, 1, 5, 8):
        out = _out(llm, prompt, _greedy(thinking_token_budget=n, logit_bias={e: -100})).token_ids
        assert out[:n] == free[:n] and out[n] == e, (n, out)
    # the reasoning already in the prompt counts: 3 tokens of it leave 2 of a budget of 5
    out = _out(llm, prompt + free[:3], _greedy(thinking_token_budget=5, logit_bias={e: -100})).token_ids
    assert out[:2] == free[3:5] and out[2] == e
    # -1 is no cap (vLLM's)
    assert _out(llm, prompt, _greedy(thinking_token_budget=-1, logit_bias={e: -100})).token_ids == free
    _check_clean(llm)


def test_budget_requests_batched_with_plain_ones_and_n_children(llm):
    s, e = (llm.get_tokenizer().convert_tokens_to_ids(t) for t in THINK)
    prompts = [_ids(llm, p) + [s] for p in ("Hello world!", "def add(a, b):", "0123456789 0123")]
    budgets = [3, None, 6]
    params = [_greedy(thinking_token_budget=b, logit_bias={e: -100}) for b in budgets]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, b, o in zip(prompts, budgets, outs):
        free = _out(llm, p, _greedy(logit_bias={e: -100})).token_ids
        if b is None:
            assert o.outputs[0].token_ids == free
        else:
            assert o.outputs[0].token_ids[b] == e and o.outputs[0].token_ids[:b] == free[:b]
    sampled = llm.generate({"prompt_token_ids": prompts[0]},
                           SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True,
                                          thinking_token_budget=4, logit_bias={e: -100}), use_tqdm=False)[0]
    for c in sampled.outputs:
        assert c.token_ids[4] == e and e not in c.token_ids[:4]
    _check_clean(llm)


def test_structured_output_after_a_budgeted_reasoning(llm):
    s, e = (llm.get_tokenizer().convert_tokens_to_ids(t) for t in THINK)
    prompt = _ids(llm, "The quick brown fox") + [s]
    free = _out(llm, prompt, _greedy(logit_bias={e: -100})).token_ids
    out = _out(llm, prompt, _greedy(max_tokens=80, thinking_token_budget=6, structured_outputs={"json": SCHEMA},
                                    logit_bias={e: -100}))
    assert out.token_ids[:6] == free[:6] and out.token_ids[6] == e  # free reasoning: no grammar inside it
    assert out.finish_reason == "stop"
    check_schema_output(llm.get_tokenizer().decode(out.token_ids[7:], skip_special_tokens=True))
    _check_clean(llm)


def test_a_natural_end_starts_the_grammar(llm):
    s, e = (llm.get_tokenizer().convert_tokens_to_ids(t) for t in THINK)
    prompt = _ids(llm, "Hello world!") + [s]
    # a nudge to end the reasoning: the grammar's mask forbids </think> afterwards, whatever the bias
    out = _out(llm, prompt, _greedy(max_tokens=80, structured_outputs={"json": SCHEMA}, logit_bias={e: 100}))
    assert out.token_ids[0] == e and out.finish_reason == "stop"
    check_schema_output(llm.get_tokenizer().decode(out.token_ids[1:], skip_special_tokens=True))
    _check_clean(llm)


def test_the_first_token_may_open_the_reasoning_or_start_the_grammar(llm):
    s, e = (llm.get_tokenizer().convert_tokens_to_ids(t) for t in THINK)
    prompt = _ids(llm, "What is the capital of France?")  # not inside reasoning (Qwen3: the model opens it)
    # biased towards <think>: the first token opens the reasoning, which then runs free (the bias writes more
    # <think>s: text inside it) up to its budget, then the schema
    opened = _out(llm, prompt, _greedy(max_tokens=80, thinking_token_budget=3, logit_bias={s: 100},
                                       structured_outputs={"json": SCHEMA}))
    assert opened.token_ids[:5] == [s, s, s, s, e], opened.token_ids
    check_schema_output(llm.get_tokenizer().decode(opened.token_ids[5:], skip_special_tokens=True))
    # a model that does not think gets the grammar from its first token (vLLM would leave it unconstrained)
    plain = _out(llm, prompt, _greedy(max_tokens=80, logit_bias={s: -100}, structured_outputs={"json": SCHEMA}))
    check_schema_output(plain.text)
    _check_clean(llm)


def test_enable_in_reasoning_constrains_from_the_first_token(think_path):
    llm = LLM(think_path, block_size=4, reasoning_parser="qwen3",
              structured_outputs_config={"enable_in_reasoning": True})
    s = llm.get_tokenizer().convert_tokens_to_ids("<think>")
    out = _out(llm, _ids(llm, "Hello world!") + [s], _greedy(max_tokens=80, structured_outputs={"json": SCHEMA}))
    check_schema_output(out.text)  # (the JSON written inside the reasoning: today's behaviour, on request)
    with pytest.raises(ValueError, match="enable_in_reasoning"):
        _out(llm, [s], _greedy(thinking_token_budget=2, structured_outputs={"json": SCHEMA}))


def test_multi_token_delimiters_from_reasoning_config(tmp_path):
    """A tokenizer without the tags as tokens: --reasoning-config's strings are several BPE tokens each, forced one
    by one."""
    path = make_model(str(tmp_path / "bpe"), "qwen3", max_position_embeddings=256)
    llm = LLM(path, block_size=4, reasoning_config={"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"})
    start, end = _ids(llm, "<think>"), _ids(llm, "</think>")
    assert len(start) > 1 and len(end) > 1
    prompt = _ids(llm, "Hello world!") + start
    free = _out(llm, prompt, _greedy()).token_ids
    assert end[-1] not in free[:4]  # (no end of its own, whole or in part, before the budget)
    out = _out(llm, prompt, _greedy(thinking_token_budget=4)).token_ids
    assert out[:4] == free[:4] and out[4:4 + len(end)] == end
    # a budget request on an engine without reasoning delimiters is refused, naming the flags
    with pytest.raises(ValueError, match="--reasoning-parser"):
        _out(LLM(path, block_size=4), prompt, _greedy(thinking_token_budget=4))


def test_ngram_speculation_keeps_budgets_and_grammars_exact(think_path, monkeypatch):
    """Drafts that would cross a budget or run past the end of the reasoning into the grammar are not taken: with
    oracle n-gram drafts (a plain run's own tokens, every fifth one wrong: tests/spec_oracle.py), most are accepted,
    and the outputs equal plain decoding's."""
    from spec_oracle import oracle_drafts
    from voltllm.engine.speculative import NgramIndex

    plain = LLM(think_path, block_size=4, reasoning_parser="qwen3")
    spec = LLM(think_path, block_size=4, reasoning_parser="qwen3",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    s, e = (plain.get_tokenizer().convert_tokens_to_ids(t) for t in THINK)
    vocab = len(plain.get_tokenizer())
    cases = [(_ids(plain, text) + [s], _greedy(max_tokens=40, thinking_token_budget=n, logit_bias={e: -100}))
             for text, n in (("The quick brown fox", 5), ("0123456789 0123", 11), ("def add(a, b):", 14))]
    cases += [(_ids(plain, "Hello world!") + [s], _greedy(max_tokens=80, thinking_token_budget=9,
                                                          structured_outputs={"json": SCHEMA}, logit_bias={e: -100})),
              (_ids(plain, "What is the capital of France?") + [s],  # (this one ends its reasoning by itself)
               _greedy(max_tokens=80, structured_outputs={"json": SCHEMA}))]
    full = []
    for p, params in cases:
        want = _out(plain, p, params)
        full.append((p, list(p) + list(want.token_ids), want.token_ids))
    assert e in full[-1][2][1:6]  # (a natural end a few tokens in: oracle drafts would run past it)

    def propose(self, tokens, k):
        for p, whole, _ in full:
            if tokens[:len(p)] == p:
                return oracle_drafts(whole, len(tokens), k, vocab)
        return []

    monkeypatch.setattr(NgramIndex, "propose", propose)
    for (p, params), (_, _, want) in zip(cases, full):
        assert _out(spec, p, params).token_ids == want, params
    sched = spec.engine.scheduler
    assert sched.num_accepted_tokens > sched.num_draft_tokens / 2  # (most drafts taken: a real test of the limits)
    _check_clean(spec)
