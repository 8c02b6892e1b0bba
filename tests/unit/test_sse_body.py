"""The streamed-response wrapper (voltllm.entrypoints.openai.serving_common.sse_body): events then [DONE]; a
failure after the status line becomes an in-band error event; nothing is sent to a client that left; the
watcher and the output streams are released however the body ends."""
import asyncio
import json

from voltllm.engine.async_llm import RequestAbortedError
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.serving_common import sse, sse_body


class _Flag:
    def __init__(self, disconnected=False):
        self.disconnected = disconnected
        self.stopped = False
        self.closed = False

    def stop(self):
        self.stopped = True

    def close(self):
        self.closed = True


def _run(fail, disconnected=False):
    watcher, stream = _Flag(disconnected), _Flag()
    finished = []

    async def events():
        try:
            yield sse({"n": 1})
            if fail is not None:
                raise fail
            yield sse({"n": 2})
        finally:
            finished.append(True)

    async def drain():
        return [e async for e in sse_body(events(), [stream], watcher, "req-1")]
    out = asyncio.run(drain())
    assert watcher.stopped and stream.closed and finished == [True]
    return out


def test_events_then_done():
    assert _run(None) == [sse({"n": 1}), sse({"n": 2}), sse("[DONE]")]


def test_failures_are_reported_in_band():
    out = _run(OpenAIError("bad thing", 400))
    assert out[0] == sse({"n": 1}) and out[-1] == sse("[DONE]")
    assert json.loads(out[1][len("data: "):])["error"]["message"] == "bad thing"
    out = _run(RuntimeError("boom"))
    err = json.loads(out[1][len("data: "):])["error"]
    assert "boom" in err["message"] and out[-1] == sse("[DONE]")
    out = _run(RequestAbortedError("engine stopped"))
    assert "engine stopped" in json.loads(out[1][len("data: "):])["error"]["message"]


def test_nothing_sent_to_a_client_that_left():
    assert _run(RequestAbortedError("aborted"), disconnected=True) == [sse({"n": 1})]
