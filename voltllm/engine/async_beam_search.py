"""The server's beam search (engine/beam_search.py) on AsyncLLM: a task runs the steps, each step's live beams being
one-token requests of AsyncLLM's own (so the engine batches them, and the prefix cache keeps each beam's earlier
tokens); a BeamSearchStream hands the answer over once, at the end, as a request stream hands over a finished output.
Aborting the search (AsyncLLM.abort: a client gone, shutdown) cancels the task, whose step requests are then aborted
in the engine like any request whose stream closes.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Optional

from voltllm.engine.beam_search import BeamSearch, BeamSearchParams, answer
from voltllm.engine.outputs import RequestOutput
from voltllm.sampling.params import SamplingParams

if TYPE_CHECKING:
    from voltllm.engine.async_llm import AsyncLLM, RequestStream


class BeamSearchStream:
    """Async iterator of one beam search's output: a single finished RequestOutput (the best beams) when the search
    ends; close() aborts the search if it has not ended."""

    def __init__(self, engine: "AsyncLLM", request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.finished = False
        self.closed = False
        self._output: Optional[RequestOutput] = None
        self._error: Optional[BaseException] = None
        self._event = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        self.lora_int_id: Optional[int] = None  # its adapter's: an unload waits for the search (AsyncLLM.remove_lora)

    def start(self, search: Callable[[], Awaitable[RequestOutput]]) -> None:
        self._task = asyncio.ensure_future(self._run(search))

    async def _run(self, search: Callable[[], Awaitable[RequestOutput]]) -> None:
        try:
            self._output = await search()
        except asyncio.CancelledError:
            raise  # (cancel() has set the error)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._error = e
        finally:
            if self.engine._beam_searches.get(self.request_id) is self:
                del self.engine._beam_searches[self.request_id]
            self.engine._beam_search_ended()
            self._event.set()

    def cancel(self, error: BaseException) -> None:
        """End the search with `error` (AsyncLLM.abort): its task stops, closing its step requests."""
        if self._output is None and self._error is None:
            self._error = error
        if self._task is not None:
            self._task.cancel()
        self._event.set()

    def __aiter__(self) -> "BeamSearchStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            await self._event.wait()
        except BaseException:  # cancelled (client gone, shutdown): stop the search
            self.close()
            raise
        if self._error is not None or self._output is None:
            err = self._error or RuntimeError("the beam search ended without output")
            self.close()
            raise err
        self.finished = True
        return self._output

    def close(self) -> None:
        if self.finished or self.closed:
            return
        self.closed = True
        self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


async def _final(stream: "RequestStream") -> RequestOutput:
    from voltllm.engine.async_llm import RequestAbortedError

    last = None
    async for out in stream:
        last = out
    if last is None or not last.outputs or not last.outputs[0].logprobs:
        raise RequestAbortedError(f"a beam-search step of {stream.request_id} ended without a token")
    return last


async def run_beam_search(engine: "AsyncLLM", request_id: str, prompt_text: Optional[str], prompt_ids: list[int],
                          params: BeamSearchParams, step_logprobs: int, cache_salt: Optional[str],
                          skip_special_tokens: bool, num_logprobs: Optional[int], priority: int = 0,
                          lora_request: Optional[Any] = None,
                          trace_headers: Optional[Mapping[str, str]] = None) -> RequestOutput:
    """Step the search to its end: each live beam one request of one token with `step_logprobs` logprobs (at the
    search's priority, with its adapter: the prefix cache then keys the beams' blocks by it, as any request's); the
    step's requests are closed (aborted where unfinished) however the step ends."""
    search = BeamSearch(prompt_ids, params, engine.frontend.eos_ids)
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=step_logprobs,
                                 detokenize=False)
    cached = 0
    while not search.done:
        streams: list[Any] = []
        try:
            for i, beam in enumerate(search.live):
                streams.append(engine.add_request(f"{request_id}-beam{search.steps}-{i}",
                                                  {"prompt_token_ids": beam.tokens}, step_params, cache_salt,
                                                  priority, lora_request, trace_headers=trace_headers))
            finals = [await _final(s) for s in streams]
        finally:
            for s in streams:
                s.close()
        if search.steps == 0:
            cached = finals[0].num_cached_tokens  # the prompt's prefix-cache hits
        search.advance([f.outputs[0].logprobs[0] for f in finals])
    return answer(search, request_id, prompt_text, engine.tokenizer, skip_special_tokens, num_logprobs, cached)
