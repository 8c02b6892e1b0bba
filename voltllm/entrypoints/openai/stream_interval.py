"""vLLM's stream interval (--stream-interval N, a request's stream_interval): a streamed request's outputs are passed
on every N new tokens instead of every token, so that fewer, larger SSE chunks are sent; the first output and the
last (and the one where a choice finishes) go at once. Outputs are cumulative (async_llm.RequestStream), so the ones
skipped lose nothing: the next one carries their tokens."""
from __future__ import annotations

from typing import Any, Optional

from voltllm.entrypoints.openai.errors import bad_request


def stream_interval(server: int, req: Any) -> int:
    """The tokens per chunk of a request: its stream_interval, raised to the server's --stream-interval (vLLM's rule:
    a request can only ask for larger chunks); 1 for a request that does not stream."""
    asked = getattr(req, "stream_interval", None)
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
        raise bad_request(f"stream_interval must be an integer >= 1, got {asked!r}", "stream_interval")
    if not getattr(req, "stream", False):
        return 1
    return max(server, asked or 1)


class IntervalStream:
    """A request's output stream that passes an output on when some choice has `interval` tokens more than at the
    last one passed on, when a choice finishes, and the first output."""

    def __init__(self, stream: Any, interval: int):
        self.stream, self.interval = stream, interval
        self._passed: Optional[dict[int, tuple[int, bool]]] = None  # choice -> (tokens, finished) last passed on

    def __aiter__(self) -> "IntervalStream":
        return self

    async def __anext__(self) -> Any:
        while True:
            out = await self.stream.__anext__()
            now = {c.index: (len(c.token_ids), c.finish_reason is not None) for c in out.outputs}
            if self._due(now) or out.finished:
                self._passed = now
                return out

    def _due(self, now: dict[int, tuple[int, bool]]) -> bool:
        if self._passed is None:
            return True
        for index, (tokens, done) in now.items():
            before, was_done = self._passed.get(index, (0, False))
            if (done and not was_done) or tokens - before >= self.interval:
                return True
        return False

    def close(self) -> None:
        self.stream.close()
