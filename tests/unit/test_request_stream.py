"""The API process's per-request stream (AsyncLLM's RequestStream) and the frontend's update / build split: the
engine's news is recorded every step (Frontend.update) but a request's cumulative RequestOutput is built only when
its consumer reads it, so a consumer that lags skips the outputs in between instead of paying for each."""
import asyncio
import tempfile
from types import SimpleNamespace

from tiny_models import make_tokenizer
from voltllm.engine.async_llm import RequestStream
from voltllm.engine.frontend import Frontend
from voltllm.engine.types import EngineCoreOutput
from voltllm.sampling.params import SamplingParams


def test_lagging_consumer_builds_only_the_newest_output():
    tok = make_tokenizer(tempfile.mkdtemp())
    fe = Frontend(tok, "/nonexistent", 4096)
    cid = fe.make_requests("r", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=8, temperature=0))[0].request_id
    builds = []

    def build(state):
        builds.append(state.request_id)
        return fe.build(state)

    engine = SimpleNamespace(_streams={}, observer=None, abort=lambda rid: None)
    stream = RequestStream(engine, "r")
    engine._streams["r"] = stream
    for tokens in ([40], [41], [42]):  # three engine steps before the consumer looks
        touched, _ = fe.update([EngineCoreOutput(cid, tokens, first_token_time=1.0)])
        stream._put(lambda st=touched[0]: build(st))
    assert builds == []  # nothing built while nobody reads

    async def read():
        return await stream.__anext__()

    out = asyncio.run(read())
    assert builds == ["r"] and out.outputs[0].token_ids == [40, 41, 42] and not out.finished
    touched, _ = fe.update([EngineCoreOutput(cid, [43], finish_reason="length")])
    assert touched[0].finished and "r" not in fe.states  # forgotten at update time, still buildable
    stream._put(lambda st=touched[0]: build(st))
    last = asyncio.run(read())
    assert last.finished and last.outputs[0].token_ids == [40, 41, 42, 43] and stream.finished
    assert "r" not in engine._streams and builds == ["r", "r"]


def test_engine_timestamps_reach_the_request_metrics():
    """The engine's scheduling and token times (for GET /metrics' queue / prefill / decode phases) are folded over
    a request's choices: the earliest scheduling and first token, the latest token."""
    fe = Frontend(None, "/nonexistent", 4096)
    a, b = (r.request_id for r in fe.make_requests("r", [5, 6], SamplingParams(max_tokens=2, n=2, detokenize=False)))
    fe.update([EngineCoreOutput(a, [1], first_token_time=3.0, last_token_time=3.0, scheduled_time=2.0),
               EngineCoreOutput(b, [1], first_token_time=3.5, last_token_time=3.5, scheduled_time=2.5)])
    fe.update([EngineCoreOutput(b, [2], "length", first_token_time=3.5, last_token_time=4.5, scheduled_time=2.5)])
    touched, _ = fe.update([EngineCoreOutput(a, [2], "length", first_token_time=3.0, last_token_time=4.0,
                                             scheduled_time=2.0)])
    m = fe.build(touched[0]).metrics
    assert (m.scheduled_time, m.engine_first_token_time, m.engine_last_token_time) == (2.0, 3.0, 4.5)
