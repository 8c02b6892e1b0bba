"""Structured outputs offline on a tiny random model: whatever the weights choose, the output follows the constraint
(JSON schema, regex, choice, EBNF grammar, JSON object, structural tag), with async scheduling on and off, beside
unconstrained requests (whose greedy output is their output alone), with n > 1, preemption, speculation and
aborts."""
import json

import pytest

from structured_cases import (CHOICES, GRAMMAR, GRAMMAR_RE, LEGACY_TAG, LONG_REGEX, REGEX, SCHEMA,
                              check_json_object_output, check_regex_output, check_schema_output, check_tagged_output,
                              structural_tag)
from tiny_models import make_model
from voltllm import LLM, SamplingParams, StructuredOutputsParams
from voltllm.engine.types import EngineCoreRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "What is the capital of France?", "Hello world! Voltllm", "0123456789 0123",
           "def add(a, b):"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, tiny_path):
    return LLM(tiny_path, block_size=4, max_num_batched_tokens=64, async_scheduling=request.param)


def _params(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 80, **kw})


def _closing_bias(llm):
    """A nudge towards '"' and '}': any JSON object is allowed, and a random model left alone may write one key for
    ever."""
    tok = llm.get_tokenizer()
    return {tok.convert_tokens_to_ids('"'): 2.0, tok.convert_tokens_to_ids("}"): 2.0}


def test_constrained_and_plain_requests_in_one_batch(llm):
    plain = _params(max_tokens=24, ignore_eos=True)
    so = StructuredOutputsParams
    params = [_params(structured_outputs=so(json=SCHEMA)), plain,
              _params(temperature=1.0, seed=3, structured_outputs=so(regex=REGEX)),
              _params(structured_outputs=so(json_object=True), logit_bias=_closing_bias(llm)),
              _params(temperature=0.8, seed=5, logprobs=2, structured_outputs=so(grammar=GRAMMAR)),
              _params(structured_outputs=so(choice=CHOICES)), plain]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    check_schema_output(outs[0].text)
    check_regex_output(outs[2].text)
    check_json_object_output(outs[3].text)
    assert outs[3].text != "{}"  # (a key and a value, with this prompt and bias)
    check_regex_output(outs[4].text, GRAMMAR_RE)
    assert outs[5].text in CHOICES
    for o in (outs[0], outs[2], outs[3], outs[4], outs[5]):
        assert o.finish_reason == "stop", o
    # logprobs are reported after the mask: the chosen token's is finite, disallowed tokens' are -inf
    assert all(lp[t].logprob > float("-inf") for lp, t in zip(outs[4].logprobs, outs[4].token_ids))
    # the unconstrained rows are exactly what they are alone
    for i in (1, 6):
        alone = llm.generate(prompts[i], plain)[0].outputs[0]
        assert outs[i].token_ids == alone.token_ids
    assert len(llm.engine.grammars) == 0
    llm.engine.check_integrity()


def test_the_mask_changes_what_the_model_says(llm):
    """The constraint binds: the unconstrained greedy text of the same prompt is not a choice."""
    free = llm.generate(PROMPTS[0], _params(max_tokens=4))[0].outputs[0].text
    assert free not in CHOICES
    assert llm.generate(PROMPTS[0], _params(structured_outputs={"choice": CHOICES}))[0].outputs[0].text in CHOICES


def test_a_finished_grammar_ends_the_request_even_without_eos(llm):
    # ignore_eos: the matcher ends it on the EOS the finished grammar allows; min_tokens banning that EOS leaves no
    # allowed token: the request ends (stop) rather than run on outside its grammar
    for kw in ({"ignore_eos": True}, {"min_tokens": 6}):
        out = llm.generate(PROMPTS[2], _params(max_tokens=20, structured_outputs={"choice": CHOICES}, **kw))[0]
        assert out.outputs[0].text in CHOICES and out.outputs[0].finish_reason == "stop", (kw, out.outputs[0])
    assert len(llm.engine.grammars) == 0


def test_structural_tag_leaves_free_text_free_and_constrains_each_tag(llm):
    """Until the trigger the model writes what it would unconstrained; from it on, "<f>" + JSON of the tag's schema
    + "</f>"; then free text again, up to the next trigger."""
    trigger = llm.get_tokenizer().convert_tokens_to_ids("<")
    bias = {trigger: 3.0}  # the trigger now and then (this prompt and weights: after a few free tokens)
    free = llm.generate(PROMPTS[2], _params(max_tokens=40, logit_bias=bias))[0].outputs[0].text
    out = llm.generate(PROMPTS[2], _params(max_tokens=40, logit_bias=bias,
                                           structured_outputs={"structural_tag": structural_tag()}))[0].outputs[0]
    before = out.text.split("<")[0]
    assert before and free.startswith(before + "<") and not free.startswith(before + "<f>"), (free, out.text)
    assert len(check_tagged_output(out.text, complete=False)) >= 1 and out.text.count("</f>") >= 1, out.text
    assert out.text.split("</f>")[1].strip(), out.text  # free text after the tag's end
    # vLLM's older form, as JSON text, with no trigger in this text: token for token the unconstrained output
    plain = llm.generate(PROMPTS[0], _params(max_tokens=30))[0].outputs[0]
    legacy = llm.generate(PROMPTS[0], _params(max_tokens=30, structured_outputs={
        "structural_tag": json.dumps(LEGACY_TAG)}))[0].outputs[0]
    assert "<" not in plain.text and legacy.token_ids == plain.token_ids
    # at_least_one + stop_after_first: one tag from the first token, then the grammar ends the request
    forced = llm.generate(PROMPTS[1], _params(structured_outputs=StructuredOutputsParams(
        structural_tag=structural_tag(at_least_one=True, stop_after_first=True))))[0].outputs[0]
    assert forced.text.startswith("<f>") and forced.text.endswith("</f>") and forced.finish_reason == "stop"
    assert len(check_tagged_output(forced.text)) == 1
    assert len(llm.engine.grammars) == 0
    llm.engine.check_integrity()


def test_structural_tag_tokens_resolve_against_the_vocabulary(llm):
    """A token format named by its text is built by the engine's compile (the API process has no vocabulary); one the
    vocabulary lacks fails that request with a 400-kind error, and the engine goes on."""
    from voltllm.engine.request_checks import InvalidRequestError

    def tag(token):
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "token", "token": token}, {"type": "const_string", "value": "ok"}]}}

    out = llm.generate(PROMPTS[0], _params(structured_outputs={"structural_tag": tag("<")}))[0].outputs[0]
    assert out.text == "<ok" and out.token_ids[0] == llm.get_tokenizer().convert_tokens_to_ids("<")
    with pytest.raises(InvalidRequestError, match='invalid structural tag: Token string "<nope>" not found'):
        llm.generate(PROMPTS[0], _params(structured_outputs={"structural_tag": tag("<nope>")}))
    assert not llm.engine.has_unfinished_requests() and len(llm.engine.grammars) == 0
    llm.engine.check_integrity()


def test_n_children_each_follow_their_own_matcher(llm):
    p = _params(temperature=1.0, seed=11, n=4, structured_outputs=StructuredOutputsParams(regex=REGEX))
    texts = [c.text for c in llm.generate(PROMPTS[1], p)[0].outputs]
    for t in texts:
        check_regex_output(t)
    assert len(set(texts)) > 1  # four different draws, each its own matcher
    assert len(llm.engine.grammars) == 0


def test_max_tokens_cuts_a_constrained_request_with_length(llm):
    out = llm.generate(PROMPTS[2], _params(max_tokens=3, structured_outputs={"json": SCHEMA}))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith('{"')
    assert len(llm.engine.grammars) == 0


def test_aborted_constrained_request_frees_its_matcher(llm):
    engine = llm.engine
    sp = _params(max_tokens=60, structured_outputs={"regex": LONG_REGEX}).clone(
        _eos_token_ids=(llm.get_tokenizer().eos_token_id,))
    for i in range(3):
        engine.add_request(EngineCoreRequest(f"abort-{i}", llm.get_tokenizer().encode(PROMPTS[i]), sp))
    assert len(engine.grammars) == 3
    for _ in range(4):
        engine.step()
    engine.abort_requests(["abort-0", "abort-1"])
    assert len(engine.grammars) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.grammars) == 0
    engine.check_integrity()


def test_preempted_constrained_requests_keep_their_output(tiny_path):
    params = [_params(temperature=0.9, seed=i, structured_outputs={"regex": LONG_REGEX}) for i in range(5)]
    free = LLM(tiny_path, block_size=4, max_num_batched_tokens=32).generate(PROMPTS, params)
    tight = LLM(tiny_path, block_size=4, max_num_batched_tokens=32, num_gpu_blocks_override=24)
    squeezed = tight.generate(PROMPTS, params)
    assert tight.engine.stats().num_preemptions > 0
    for a, b in zip(free, squeezed):
        check_regex_output(b.outputs[0].text, LONG_REGEX)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(tight.engine.grammars) == 0
    tight.engine.check_integrity()


def test_speculation_skips_constrained_requests(tiny_path):
    plain = _params(max_tokens=30, ignore_eos=True)
    expected = LLM(tiny_path, block_size=4).generate(PROMPTS[:2], plain)
    spec = LLM(tiny_path, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                            "prompt_lookup_min": 1})
    params = [plain, _params(structured_outputs={"json": SCHEMA}), plain, _params(structured_outputs={"regex": REGEX})]
    outs = spec.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]], params)
    assert outs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == expected[1].outputs[0].token_ids
    check_schema_output(outs[1].outputs[0].text)
    check_regex_output(outs[3].outputs[0].text)
    assert spec.engine.stats().extra["spec_draft_tokens"] > 0  # the plain requests did speculate


def test_constrained_steps_launch_their_forward_before_the_step_in_flight_returns(llm):
    """Async scheduling: a step launched while the previous one is in flight overlaps it. A step with a constrained
    request keeps that for its forward: it launches the forward, then collects the step in flight (its tokens
    advance the matchers), fills the masks and only then launches the sampling. Recorded through the runner's
    calls, in order."""
    if not llm.engine.async_scheduling:
        pytest.skip("async scheduling only")
    engine = llm.engine
    runner = engine.runner
    events = []
    names = ("launch_forward", "launch_sampling", "collect")
    real = {name: getattr(runner, name) for name in names}
    masks = engine.grammars.masks
    constrained = _params(max_tokens=12, structured_outputs={"regex": LONG_REGEX})
    llm.generate(PROMPTS[1], constrained.clone(max_tokens=1))  # (compiled now: no step waits for it below)

    def spy(name):
        def call(*args):
            events.append((name, None if name == "collect" else engine._inflight is not None))
            return real[name](*args)
        return call

    for name in names:
        setattr(runner, name, spy(name))
    engine.grammars.masks = lambda scheduled: events.append(("masks", engine._inflight is not None)) or masks(scheduled)
    try:
        llm.generate(PROMPTS[:2], _params(max_tokens=12, ignore_eos=True))
        forwards = [inflight for name, inflight in events if name == "launch_forward"]
        assert forwards[0] is False and all(forwards[1:]), events  # plain steps: as before
        assert "masks" not in dict(events)
        events.clear()
        llm.generate(PROMPTS[:2], [_params(max_tokens=12, ignore_eos=True), constrained])
    finally:
        for name in names:
            delattr(runner, name)
        engine.grammars.masks = masks
    # the first step has nothing in flight: its masks come first (the synchronous form)
    assert events[:3] == [("masks", False), ("launch_forward", False), ("launch_sampling", False)], events
    steps, step = [], []
    for e in events[1:]:  # one list of events per launched step, from its forward on
        if e[0] == "launch_forward" and step:
            steps.append(step)
            step = []
        step.append(e)
    steps.append(step)
    assert len(steps) >= 12
    for step in steps[1:-1]:
        # the forward with the previous step in flight, then that step's tokens, the masks, the sampling
        assert step[:4] == [("launch_forward", True), ("collect", None), ("masks", False),
                            ("launch_sampling", False)], steps


def test_async_constrained_steps_equal_sync(tiny_path):
    """The forward-first form of constrained steps (async scheduling) gives exactly the synchronous outputs: greedy and
    seeded rows, constrained and not, mixed with penalties (those steps still wait first), grammar ends, max_tokens
    cuts, and aborts mid-way."""
    so = StructuredOutputsParams
    make = {mode: LLM(tiny_path, block_size=4, max_num_batched_tokens=64, async_scheduling=mode == "async")
            for mode in ("async", "sync")}
    plain = _params(max_tokens=24, ignore_eos=True)
    params = [_params(structured_outputs=so(json=SCHEMA)), plain,
              _params(temperature=1.0, seed=3, structured_outputs=so(regex=REGEX)),
              _params(structured_outputs=so(json_object=True), logit_bias=_closing_bias(make["sync"])),
              _params(temperature=0.8, seed=5, logprobs=2, structured_outputs=so(grammar=GRAMMAR)),
              _params(structured_outputs=so(choice=CHOICES)),
              _params(max_tokens=20, ignore_eos=True, structured_outputs=so(choice=CHOICES)),
              _params(max_tokens=3, structured_outputs=so(json=SCHEMA)),
              _params(max_tokens=30, structured_outputs=so(regex=LONG_REGEX)),
              plain.clone(repetition_penalty=1.3)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = {mode: [o.outputs[0] for o in llm.generate(prompts, params)] for mode, llm in make.items()}
    for a, b in zip(outs["async"], outs["sync"]):
        assert (a.token_ids, a.finish_reason, a.logprobs) == (b.token_ids, b.finish_reason, b.logprobs)
    assert [o.finish_reason for o in outs["sync"]][5:8] == ["stop", "stop", "length"]
    # aborts: the constrained request aborted mid-way takes nothing from the others
    tokens = {}
    for mode, llm in make.items():
        engine = llm.engine
        tok = llm.get_tokenizer()
        got = tokens[mode] = {}
        for i, j in enumerate([8, 0, 2, 1]):  # (the runs above' prompts and params)
            sp = params[j].clone(_eos_token_ids=(tok.eos_token_id,))
            engine.add_request(EngineCoreRequest(f"r{i}", tok.encode(prompts[j]), sp))
        n = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            n += 1
            if n == 4:
                engine.abort_requests(["r0"])
        assert len(engine.grammars) == 0
        engine.check_integrity()
    for rid, expected in (("r1", outs["sync"][0]), ("r2", outs["sync"][2]), ("r3", outs["sync"][1])):
        assert tokens["async"][rid] == tokens["sync"][rid] == expected.token_ids, rid
    assert len(tokens["async"]["r0"]) < 30 and len(tokens["sync"]["r0"]) < 30


def test_refused_without_a_tokenizer_and_the_engine_goes_on(tiny_path):
    from voltllm.engine.core import InvalidRequestError

    llm = LLM(tiny_path, block_size=4, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate([[5, 6, 7]], _params(structured_outputs={"regex": REGEX}))
    assert len(llm.generate([[5, 6, 7]], _params(max_tokens=3))[0].outputs[0].token_ids) == 3
    assert len(llm.engine.grammars) == 0
