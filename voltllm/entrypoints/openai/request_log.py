"""The request log (--enable-log-requests): one line per request with its sizes and prompt, cut to --max-log-len
characters (or token ids) as vLLM's; with --enable-log-outputs, one line per finished choice with its generated text
(cut the same way), written when the engine's final output for the request passes by, and for a streamed response
(--enable-log-deltas, on by default as in vLLM) one line per output that adds text to a choice, with that text."""
from __future__ import annotations

import logging
from typing import Any, Optional, Union

from voltllm.engine.outputs import RequestOutput

logger = logging.getLogger("voltllm")


def shown(value: Union[str, list[int]], max_len: Optional[int]) -> str:
    """A prompt or output for the log: text as its repr, token ids as a list; at most max_len characters / ids."""
    cut = value if max_len is None else value[:max_len]
    return repr(cut) if isinstance(cut, str) else str(list(cut))


def log_outputs(out: RequestOutput, max_len: Optional[int]) -> None:
    for c in out.outputs:
        logger.info("Generated response %s (choice %d): output: %s, %d tokens, finish_reason: %s", out.request_id,
                    c.index, shown(c.text, max_len), len(c.token_ids), c.finish_reason)


class OutputLoggingStream:
    """A request's output stream (async_llm.RequestStream) that logs the generated text once the request finishes,
    streamed or not (--enable-log-outputs); deltas: also each output's new text per choice (a streamed response)."""

    def __init__(self, stream: Any, max_len: Optional[int], deltas: bool = False):
        self.stream, self.max_len, self.deltas = stream, max_len, deltas
        self.logged: dict[int, int] = {}  # choice index -> characters of its text already logged as deltas

    def __aiter__(self) -> "OutputLoggingStream":
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.stream.__anext__()
        if self.deltas:
            for c in out.outputs:
                start = self.logged.get(c.index, 0)
                if len(c.text) > start:
                    self.logged[c.index] = len(c.text)
                    logger.info("Generated response %s (choice %d, streaming delta): output: %s", out.request_id,
                                c.index, shown(c.text[start:], self.max_len))
        if out.finished:
            log_outputs(out, self.max_len)
        return out

    def close(self) -> None:
        self.stream.close()
