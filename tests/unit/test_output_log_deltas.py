"""--enable-log-deltas: a streamed response's log gets each output's new text per choice (cut to --max-log-len), then
the finished choices' whole texts; without it (or not streamed) only the latter."""
from __future__ import annotations

import asyncio
import logging

from voltllm.engine.outputs import CompletionOutput, RequestOutput
from voltllm.entrypoints.openai.request_log import OutputLoggingStream


class _Stream:
    def __init__(self, outs):
        self.outs = list(outs)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.outs:
            raise StopAsyncIteration
        return self.outs.pop(0)

    def close(self):
        pass


def _out(texts, finished=False):
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1],
                         outputs=[CompletionOutput(index=i, text=t, token_ids=[0] * len(t),
                                                   finish_reason="length" if finished else None)
                                  for i, t in enumerate(texts)], finished=finished)


def _logged(caplog, deltas: bool, max_len=None) -> list[str]:
    outs = [_out(["He", ""]), _out(["Hello", "a"]), _out(["Hello", "ab"]), _out(["Hello wor", "abc"], True)]

    async def drain():
        return [o async for o in OutputLoggingStream(_Stream(outs), max_len, deltas)]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="voltllm"):
        assert len(asyncio.run(drain())) == 4
    return [r.getMessage() for r in caplog.records]


def test_deltas_then_the_whole_texts(caplog):
    lines = _logged(caplog, True, max_len=3)
    assert lines == ["Generated response r (choice 0, streaming delta): output: 'He'",
                     "Generated response r (choice 0, streaming delta): output: 'llo'",
                     "Generated response r (choice 1, streaming delta): output: 'a'",
                     "Generated response r (choice 1, streaming delta): output: 'b'",
                     "Generated response r (choice 0, streaming delta): output: ' wo'",
                     "Generated response r (choice 1, streaming delta): output: 'c'",
                     "Generated response r (choice 0): output: 'Hel', 9 tokens, finish_reason: length",
                     "Generated response r (choice 1): output: 'abc', 3 tokens, finish_reason: length"]


def test_without_deltas_only_the_whole_texts(caplog):
    assert [line.split(":")[0] for line in _logged(caplog, False)] == ["Generated response r (choice 0)",
                                                                      "Generated response r (choice 1)"]
