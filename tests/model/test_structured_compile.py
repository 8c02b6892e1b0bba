"""Grammar compiles off the engine loop (structured/matchers.py, EngineCore, engine_proc): while a constrained
request's grammar compiles in the background thread, the other requests keep producing tokens; once compiled, the
constrained request's output is what it would have been; an abort while it compiles frees everything, a compile
that fails fails that request only, and nothing busy-spins meanwhile. Compiles are held pending by a gate (a
threading.Event in front of the real compile), never by timing."""
import os
import pickle
import threading

import pytest

from structured_cases import LONG_REGEX, REGEX, check_regex_output
from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.engine.request_checks import InvalidRequestError
from voltllm.structured.matchers import GrammarMatchers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "What is the capital of France?", "Hello world! Voltllm"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, tiny_path):
    return LLM(tiny_path, block_size=4, max_num_batched_tokens=64, async_scheduling=request.param)


class Gate:
    """Holds the grammar compiles of `grammars` until `release` is set (then runs the real compile, or raises
    `fail`)."""

    def __init__(self, grammars: GrammarMatchers, fail: BaseException = None):
        self.grammars = grammars
        self.release = threading.Event()
        self.started = threading.Event()
        self.keys = []
        build = grammars._build

        def gated(key):
            self.keys.append(key)
            self.started.set()
            assert self.release.wait(60), "the test never released the compile"
            if fail is not None:
                raise fail
            return build(key)

        grammars._build = gated

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release.set()
        del self.grammars._build


def _plain(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 30, "ignore_eos": True, **kw})


def _constrained(regex=LONG_REGEX, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 60, "structured_outputs": {"regex": regex}, **kw})


def _add(llm, rid, prompt, sp):
    (req,) = llm.frontend.make_requests(rid, prompt, sp)
    llm.frontend.forget(rid)  # (the engine is driven directly here)
    llm.engine.add_request(req)


def _step(engine, tokens, finished):
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finished[out.request_id] = out.finish_reason


def _forget_compiled(llm):
    llm.engine.grammars._compiled.clear()


def test_other_requests_stream_while_a_grammar_compiles(llm):
    engine = llm.engine
    regex = LONG_REGEX + "!"  # a key of this test's own
    plain_alone = llm.generate(PROMPTS[0], _plain())[0].outputs[0].token_ids
    constrained_alone = llm.generate(PROMPTS[1], _constrained(regex))[0].outputs[0]
    check_regex_output(constrained_alone.text, regex)
    _forget_compiled(llm)
    tokens, finished = {}, {}
    with Gate(engine.grammars) as gate:
        _add(llm, "plain", PROMPTS[0], _plain())
        for _ in range(2):
            _step(engine, tokens, finished)
        _add(llm, "so", PROMPTS[1], _constrained(regex))
        assert "so" in engine.scheduler.waiting_for_grammar and len(engine.grammars) == 1
        assert gate.started.wait(30)
        before = len(tokens.get("plain", []))
        for _ in range(8):
            _step(engine, tokens, finished)
        assert len(tokens["plain"]) - before == 8  # a token every step while the compile is held
        assert "so" not in tokens and engine.scheduler.requests["so"].num_computed_tokens == 0
        engine.check_integrity()
        gate.release.set()
        while engine.has_unfinished_requests():
            _step(engine, tokens, finished)
    assert gate.keys == [("regex", regex)]
    assert tokens["plain"] == plain_alone
    assert tokens["so"] == constrained_alone.token_ids and finished["so"] == constrained_alone.finish_reason
    assert len(engine.grammars) == 0 and not engine.grammars.compiling
    engine.check_integrity()
    # the compiled grammar is cached: the next request with it gets its matcher at once, without the thread
    with Gate(engine.grammars) as gate:
        _add(llm, "again", PROMPTS[1], _constrained(regex))
        assert "again" in engine.grammars.live and not engine.grammars.compiling
        while engine.has_unfinished_requests():
            _step(engine, tokens, finished)
    assert not gate.keys and tokens["again"] == constrained_alone.token_ids


def test_requests_sharing_a_pending_compile_wait_for_one_compile(llm):
    engine = llm.engine
    regex = REGEX + "-shared"
    _forget_compiled(llm)
    tokens, finished = {}, {}
    with Gate(engine.grammars) as gate:
        for i in range(3):
            _add(llm, f"s{i}", PROMPTS[i], _constrained(regex))
        assert len(engine.grammars.compiling) == 1 and len(engine.grammars.waiting) == 3
        gate.release.set()
        while engine.has_unfinished_requests():
            _step(engine, tokens, finished)
    assert gate.keys == [("regex", regex)]
    for i in range(3):
        assert finished[f"s{i}"] == "stop"
    engine.check_integrity()


def test_abort_while_compiling_frees_everything(llm):
    engine = llm.engine
    regex_a, regex_b = REGEX + "-abort-a", REGEX + "-abort-b"
    _forget_compiled(llm)
    tokens, finished = {}, {}
    with Gate(engine.grammars) as gate:
        _add(llm, "a1", PROMPTS[0], _constrained(regex_a))
        _add(llm, "a2", PROMPTS[1], _constrained(regex_a))
        _add(llm, "b", PROMPTS[2], _constrained(regex_b))  # queued behind a's compile (one compile thread)
        _add(llm, "plain", PROMPTS[0], _plain(max_tokens=6))
        assert gate.started.wait(30)
        fut_a, fut_b = engine.grammars.compiling[("regex", regex_a)], engine.grammars.compiling[("regex", regex_b)]
        _step(engine, tokens, finished)
        engine.abort_requests(["a1"])
        assert ("regex", regex_a) in engine.grammars.compiling  # a2 still waits for it
        engine.abort_requests(["a2", "b"])
        assert not engine.grammars.compiling and not engine.grammars.waiting
        assert not engine.scheduler.waiting_for_grammar and len(engine.grammars) == 0
        assert fut_b.cancelled()  # never started; a's compile is running and ends in its thread, unused
        engine.check_integrity()
        gate.release.set()
        fut_a.exception(timeout=30)
        while engine.has_unfinished_requests():
            _step(engine, tokens, finished)
        _step(engine, tokens, finished)  # (the abort notices of the last step)
    assert finished == {"a1": "abort", "a2": "abort", "b": "abort", "plain": "length"}
    assert tokens["a1"] == tokens["a2"] == tokens["b"] == [] and len(tokens["plain"]) == 6
    assert len(engine.grammars) == 0 and ("regex", regex_a) not in engine.grammars._compiled
    engine.check_integrity()
    # the aborted compile's key compiles again for a new request
    out = llm.generate(PROMPTS[0], _constrained(regex_a))[0].outputs[0]
    check_regex_output(out.text, regex_a)


@pytest.mark.parametrize("error", [InvalidRequestError("structured outputs: no such rule", "structured_outputs"),
                                   RuntimeError("xgrammar fell over")], ids=["invalid", "unexpected"])
def test_a_failed_compile_fails_that_request_only(llm, error):
    engine = llm.engine
    regex = REGEX + "-fails"
    _forget_compiled(llm)
    tokens, finished = {}, {}
    plain_alone = llm.generate(PROMPTS[0], _plain(max_tokens=10))[0].outputs[0].token_ids
    with Gate(engine.grammars, fail=error) as gate:
        _add(llm, "plain", PROMPTS[0], _plain(max_tokens=10))
        _add(llm, "bad", PROMPTS[1], _constrained(regex))
        _step(engine, tokens, finished)
        assert engine.take_request_errors() == []
        gate.release.set()
        errors = []
        while engine.has_unfinished_requests():
            _step(engine, tokens, finished)
            errors += engine.take_request_errors()
    assert [rid for rid, _ in errors] == ["bad"]
    message = errors[0][1]
    assert ("no such rule" in message) if isinstance(error, InvalidRequestError) else (
        "RuntimeError: xgrammar fell over" in message and "regex" in message)
    assert "bad" not in tokens and "bad" not in finished  # no output: the error is its only report
    assert tokens["plain"] == plain_alone and finished["plain"] == "length"
    assert len(engine.grammars) == 0 and ("regex", regex) not in engine.grammars._compiled
    engine.check_integrity()
    # offline: generate raises the error (the other prompts of the call are aborted); the engine goes on
    with Gate(engine.grammars, fail=error) as gate:
        gate.release.set()
        with pytest.raises(InvalidRequestError, match="no such rule|xgrammar fell over"):
            llm.generate(PROMPTS[:2], [_plain(), _constrained(regex)])
    assert not engine.has_unfinished_requests() and len(engine.grammars) == 0
    engine.check_integrity()
    assert llm.generate(PROMPTS[0], _plain(max_tokens=10))[0].outputs[0].token_ids == plain_alone


def test_a_tokenizer_xgrammar_cannot_read_fails_in_the_background_then_up_front(llm):
    """The first constrained request finds it out in the compile thread (its error); later ones are refused when
    they arrive (a 400 over HTTP), without another tokenizer load."""
    engine = llm.engine
    loads, loading = [], threading.Event()
    # object(): no get_vocab; the load waits until both requests are in
    mine = GrammarMatchers(lambda: loading.wait(30) and (loads.append(1) or object()), engine.vocab_size)
    saved = engine.grammars
    engine.grammars = engine.scheduler.grammars = mine
    try:
        _add(llm, "first", PROMPTS[0], _constrained())
        _add(llm, "second", PROMPTS[1], _constrained(REGEX))  # queued behind the first compile
        loading.set()
        tokens, finished, errors = {}, {}, []
        while engine.has_unfinished_requests():
            _step(engine, tokens, finished)
            errors += engine.take_request_errors()
        assert sorted(rid for rid, _ in errors) == ["first", "second"]
        assert all("not available with this tokenizer" in m for _, m in errors)
        with pytest.raises(InvalidRequestError, match="not available with this tokenizer"):
            _add(llm, "third", PROMPTS[2], _constrained())
        assert loads == [1] and len(mine) == 0
        engine.check_integrity()
    finally:
        engine.grammars = engine.scheduler.grammars = saved
        mine.shutdown()


def test_a_step_with_only_compiling_requests_waits_for_the_compile(llm):
    """In process (the offline LLM steps in a loop): such a step waits on the compile (up to grammar_wait_s) rather
    than return at once, and launches nothing."""
    engine = llm.engine
    _forget_compiled(llm)
    waits, launches = [], []
    wait, execute = engine.grammars.wait, engine.runner.execute_async
    engine.grammars.wait = lambda timeout: waits.append(timeout)
    engine.runner.execute_async = lambda sched: launches.append(sched) or execute(sched)
    try:
        with Gate(engine.grammars) as gate:
            _add(llm, "so", PROMPTS[0], _constrained(REGEX))
            for _ in range(3):
                assert engine.step() == []
            assert waits == [engine.grammar_wait_s] * 3 and not launches
            gate.release.set()
            engine.grammars.compiling[("regex", REGEX)].result(timeout=30)
            tokens, finished = {}, {}
            while engine.has_unfinished_requests():
                _step(engine, tokens, finished)
        assert finished == {"so": "stop"} and len(waits) == 3 and launches
    finally:
        engine.grammars.wait, engine.runner.execute_async = wait, execute
    # the real wait returns when the compile ends
    with Gate(engine.grammars) as gate:
        _forget_compiled(llm)
        _add(llm, "so2", PROMPTS[0], _constrained(REGEX))
        gate.release.set()
        engine.grammars.wait(60)
        assert engine.grammars.compiling[("regex", REGEX)].done()
        engine.abort_requests(["so2"])
        engine.step()
    engine.check_integrity()


def test_the_engine_process_loop_sleeps_while_a_grammar_compiles(llm):
    """engine_proc's loop, in a thread over inproc sockets: while only a compiling request remains it blocks on its
    input and the compile's wake fd (a handful of steps, not a spin), wakes when the compile ends, and reports a
    failed compile as ("error", [id], message)."""
    import zmq

    from voltllm.engine.engine_proc import _loop

    engine = llm.engine
    _forget_compiled(llm)
    expected = llm.generate(PROMPTS[1], _constrained(REGEX))[0].outputs[0].token_ids
    _forget_compiled(llm)
    ctx = zmq.Context()
    to_engine, inp = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    out, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_engine.bind("inproc://in")
    inp.connect("inproc://in")
    from_engine.bind("inproc://out")
    out.connect("inproc://out")
    steps = []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()
    loop = threading.Thread(target=_loop, args=(engine, inp, out, os.getppid()), daemon=True)
    wait_s = engine.grammar_wait_s

    def send(*msg):
        to_engine.send(pickle.dumps(msg))

    def recv():
        assert from_engine.poll(30_000), "the engine loop sent nothing"
        return pickle.loads(from_engine.recv())

    def request(rid, sp):
        (req,) = llm.frontend.make_requests(rid, PROMPTS[1], sp)
        llm.frontend.forget(rid)
        return req

    try:
        with Gate(engine.grammars) as gate:
            loop.start()
            send("add", [request("so", _constrained(REGEX))])
            assert gate.started.wait(30)
            threading.Event().wait(0.6)  # the loop's idle poll is 200 ms: a few wake-ups, not thousands
            assert len(steps) <= 8, len(steps)
            gate.release.set()
            tokens = []
            while True:
                msg = recv()
                assert msg[0] == "outputs", msg
                if any(o.request_id == "so" for o in msg[1]):
                    (o,) = msg[1]
                    tokens += o.new_token_ids
                    if o.finished:
                        break
            assert tokens == expected
        _forget_compiled(llm)
        with Gate(engine.grammars, fail=RuntimeError("boom")) as gate:
            gate.release.set()
            send("add", [request("bad", _constrained(REGEX))])
            msg = recv()
            while msg[0] == "outputs" and not msg[1]:
                msg = recv()
            assert msg[0] == "error" and msg[1] == ["bad"] and "RuntimeError: boom" in msg[2], msg
        send("check")
        while (msg := recv())[0] != "check":
            pass
        assert msg == ("check", None)
        send("shutdown")
        loop.join(30)
        assert not loop.is_alive()
    finally:
        engine.step = step
        engine.grammar_wait_s = wait_s
        for s in (to_engine, inp, out, from_engine):
            s.close(0)
        ctx.term()
    assert not engine.has_unfinished_requests() and len(engine.grammars) == 0
    engine.check_integrity()
