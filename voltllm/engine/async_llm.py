"""AsyncLLM: the API server's handle on an EngineCore that runs in its own process.

The engine process (voltllm.engine.engine_proc) owns the model and the KV cache and steps while it has
work. This side owns the text: Frontend tokenizes, fans out n > 1, detokenizes and checks stop strings.
An asyncio task reads engine outputs as they come and hands each parent request its latest cumulative
RequestOutput (a stream that falls behind skips to the newest one: outputs are cumulative, so nothing is
lost). Closing or cancelling a stream before it finishes aborts the request in the engine, which frees
its blocks.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Protocol

from voltllm.config import EngineConfig
from voltllm.engine.async_beam_search import BeamSearchStream, run_beam_search
from voltllm.engine.beam_search import BeamSearchParams
from voltllm.engine.frontend import Frontend, PromptType
from voltllm.engine.outputs import PoolingRequestOutput, RequestOutput
from voltllm.engine.request_checks import (InvalidRequestError, check_priority, check_vocab, context_length_message,
                                           runner_mismatch)
from voltllm.engine.types import EngineCoreRequest, SchedulerStats
from voltllm.pooling.params import PoolingParams
from voltllm.sampling.params import SamplingParams
from voltllm.tracing import TracedRequest, traced_request

logger = logging.getLogger("voltllm")


class EngineDeadError(RuntimeError):
    """The engine process is gone; no request can be served."""


class EngineStartError(RuntimeError):
    """The engine process could not start (its message says why)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (client gone, shutdown) before it finished."""


class EngineSleepingError(EngineDeadError):
    """The engine is sleeping (--enable-sleep-mode): it takes no request until woken up. An EngineDeadError, so that
    every route answers it as it answers an engine that is not available (503)."""


class StatObserver(Protocol):
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_tokens(self, inter_token_s: float, count: int) -> None: ...
    def on_finished(self, out: Optional[RequestOutput], reason: str, e2e_s: float) -> None: ...
    # (optional) a generation request admitted with its n and its max_tokens (the effective one when not given)
    def on_request_params(self, n: int, max_tokens: int) -> None: ...
    # (optional) the tokens of each engine step since the last outputs
    def on_iteration_tokens(self, counts: list[int]) -> None: ...
    # (optional) --kv-cache-metrics' block residency samples since the last outputs
    def on_kv_block_samples(self, samples: dict) -> None: ...


class RequestStream:
    """Async iterator of one request's cumulative RequestOutputs; close() aborts it if unfinished."""

    def __init__(self, engine: "AsyncLLM", request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.arrival = time.monotonic()
        self._latest: Optional[Callable[[], RequestOutput]] = None  # builds the newest output
        self._error: Optional[BaseException] = None
        self._event = asyncio.Event()
        self.finished = False
        self.closed = False
        self._num_tokens = 0
        self._first_token_time: Optional[float] = None
        self._last_token_time: Optional[float] = None
        self._last_output: Optional[RequestOutput] = None
        self.traced: Optional[TracedRequest] = None  # set while the engine traces (--otlp-traces-endpoint)

    def _put(self, build: Callable[[], RequestOutput]) -> None:
        """The request has news: `build()` makes its cumulative output, called only when the consumer reads
        (a consumer that lags behind the engine skips the outputs in between without their being built)."""
        self._latest = build
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._event.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            while self._latest is None and self._error is None:
                self._event.clear()
                await self._event.wait()
        except BaseException:  # cancelled (client gone, shutdown): free the engine's blocks
            self.close()
            raise
        if self._latest is not None:
            build, self._latest = self._latest, None
            out = build()
            self._observe(out)
            if out.finished:
                self.finished = True
                self.engine._streams.pop(self.request_id, None)
            return out
        err = self._error
        self.close()
        raise err  # type: ignore[misc]

    def _observe(self, out: Any) -> None:
        """out: a RequestOutput, or a pooling request's PoolingRequestOutput (no tokens; "stop" when it has its
        embedding)."""
        self._last_output = out
        obs = self.engine.observer
        now = time.monotonic()
        choices = out.outputs if isinstance(out, RequestOutput) else []
        n = sum(len(c.token_ids) for c in choices)
        if n > self._num_tokens:
            if self._first_token_time is None:
                self._first_token_time = now
                if obs:
                    obs.on_first_token(now - self.arrival)
                if n - self._num_tokens > 1 and obs:
                    obs.on_tokens(0.0, n - self._num_tokens - 1)
            elif obs:
                k = n - self._num_tokens
                obs.on_tokens((now - (self._last_token_time or now)) / k, k)
            self._last_token_time = now
            self._num_tokens = n
        if out.finished and obs:
            reasons = ([c.finish_reason or "abort" for c in choices] if isinstance(out, RequestOutput)
                       else ["stop" if out.outputs is not None else "abort"])
            obs.on_finished(out, reasons[0] if len(set(reasons)) == 1 else "mixed", now - self.arrival)
        if out.finished and self.traced is not None and self.engine.tracer is not None:
            self.engine.tracer.on_finished(out, self.traced)

    def close(self) -> None:
        """Stop listening; abort the request in the engine unless it already finished."""
        if self.finished or self.closed:
            return
        self.closed = True
        self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncLLM:
    def __init__(self, config: EngineConfig, tokenizer: Any = None, observer: Optional[StatObserver] = None,
                 log_level: int = logging.INFO, engine_index: int = 0):
        """engine_index: this engine's place among --data-parallel-size engines (engine/data_parallel.py)."""
        self.config = config
        self.engine_index = engine_index
        self.tokenizer = tokenizer
        self.observer = observer
        # --otlp-traces-endpoint: the tracing.RequestTracer that records each finished request's span (set by the
        # server, which owns it; None: off)
        self.tracer: Optional[Any] = None
        self.log_level = log_level
        self.max_model_len = config.model.max_model_len
        hf = config.model.hf_config
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf  # multimodal configs nest it
        self.vocab_size = int(text.vocab_size)
        self.frontend: Optional[Frontend] = None
        self.stats = SchedulerStats()
        self.engine_info: dict = {}
        self.proc: Optional[multiprocessing.process.BaseProcess] = None
        self.dead: Optional[str] = None  # why the engine is gone
        self._streams: dict[str, RequestStream] = {}
        self._beam_searches: dict[str, BeamSearchStream] = {}  # by request id (their steps' requests: _streams)
        self._removals_after_searches: set[int] = set()  # unloaded adapters' ids waiting for beam searches to end
        self._ctx = None
        self._actx = None
        self._in = None
        self._out = None
        self._ipc_dir: Optional[str] = None
        self._task: Optional[asyncio.Task] = None
        self._closed = False
        self._report_waiters: list[asyncio.Future] = []  # acceleration_report() calls, answered in order
        # --enable-sleep-mode: set when a sleep is sent (new requests are refused from then on), cleared when the
        # engine answers a wake_up with every part awake; sleep() / wake_up() calls are answered in order
        self.sleeping = False
        self._sleep_waiters: list[asyncio.Future] = []
        self._profile_waiters: list[asyncio.Future] = []  # start_profile / stop_profile answers, in order

    # -- lifecycle ------------------------------------------------------------------------------
    def _spawn(self) -> None:
        import zmq
        import zmq.asyncio

        from voltllm.engine.engine_proc import run_engine_core

        self._ipc_dir = tempfile.mkdtemp(prefix="voltllm-ipc-")  # 0700: only this user can connect
        in_addr = f"ipc://{self._ipc_dir}/input"
        out_addr = f"ipc://{self._ipc_dir}/output"
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.bind(in_addr)
        self._actx = zmq.asyncio.Context()
        self._out = self._actx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.bind(out_addr)
        mp = multiprocessing.get_context("spawn")
        # daemon: multiprocessing terminates it at interpreter exit even if shutdown() was never called
        dp = self.config.parallel.data_parallel_size
        name = "voltllm-engine" if dp == 1 else f"voltllm-engine-{self.engine_index}"
        self.proc = mp.Process(target=run_engine_core, name=name, daemon=True,
                               args=(self.config, in_addr, out_addr, os.getpid(), self.log_level))
        self.proc.start()
        logger.info("%s process started (pid %d); loading weights there", name.replace("voltllm-", ""), self.proc.pid)

    async def start(self, timeout: Optional[float] = None) -> None:
        """Spawn the engine process, load the tokenizer meanwhile, and wait until the engine is ready."""
        self._spawn()
        await self.finish_start(timeout)

    async def finish_start(self, timeout: Optional[float] = None) -> None:
        """start() after the spawn (data parallelism spawns every engine first): the tokenizer (unless given) and the
        engine's ready message; on failure the engine is shut down."""
        tok_task = None
        if self.tokenizer is None:
            from voltllm.model.loader import load_tokenizer

            mc = self.config.model
            tok_task = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, mc.tokenizer, mc.trust_remote_code))
        try:
            await self._wait_ready(timeout)
            if tok_task is not None:
                self.tokenizer = await tok_task
        except BaseException:
            if tok_task is not None:
                tok_task.cancel()
            self.shutdown()
            raise
        mc = self.config.model
        self.frontend = Frontend(self.tokenizer, mc.model, self.max_model_len, pooler=mc.pooler,
                                 model_name=mc.served_model_name, reasoning=self.config.reasoning,
                                 prompt_embeds_width=mc.prompt_embeds_width,
                                 block_size=self.config.cache.block_size)
        self._task = asyncio.ensure_future(self._output_loop())

    async def _wait_ready(self, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if await self._out.poll(500):
                msg = pickle.loads(await self._out.recv())
                if msg[0] == "connected":  # both sockets are connected: their files are no longer needed
                    self._remove_ipc_dir()
                    continue
                if msg[0] == "ready":
                    self.engine_info = msg[1]
                    # (the block count from the start: /metrics' kv_cache_num_blocks and cache_config_info labels)
                    self.stats = SchedulerStats(num_blocks=int(msg[1].get("num_blocks") or 0))
                    # --max-model-len auto: the engine fitted the length to its KV cache
                    self.max_model_len = int(msg[1].get("max_model_len", self.max_model_len))
                    return
                if msg[0] == "startup_error":
                    raise EngineStartError(f"the engine could not start: {msg[1]}")
                logger.warning("unexpected engine message before ready: %r", msg[0])
                continue
            if not self.proc.is_alive():
                raise EngineStartError(f"the engine process exited during startup (exit code {self.proc.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartError(f"the engine was not ready within {timeout:.0f} s")

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._out.poll(1000):
                    if not self.proc.is_alive():
                        self._on_dead(f"the engine process exited (exit code {self.proc.exitcode})")
                        return
                    continue
                self._handle(pickle.loads(await self._out.recv()))
                if self.dead:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not leave requests hanging
            logger.exception("engine output loop failed")
            self._on_dead(f"engine output loop failed: {e}")

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outputs":
            _, outputs, stats = msg
            self.stats = stats
            if stats.iteration_tokens and hasattr(self.observer, "on_iteration_tokens"):
                self.observer.on_iteration_tokens(stats.iteration_tokens)
            if stats.kv_block_samples and hasattr(self.observer, "on_kv_block_samples"):
                self.observer.on_kv_block_samples(stats.kv_block_samples)
            touched, to_abort = self.frontend.update(outputs)
            if to_abort:
                self._send(("abort", to_abort))
            for state in touched:
                st = self._streams.get(state.request_id)
                if st is not None:
                    st._put(functools.partial(self.frontend.build, state))
        elif kind == "error":
            _, child_ids, message, *why = msg
            error = EngineSleepingError if why == ["sleeping"] else InvalidRequestError
            parents = {self.frontend.child_to_parent.get(c) for c in child_ids} - {None}
            for pid in parents:
                others = [c for c in self.frontend.child_ids(pid) if c not in child_ids]
                if others:
                    self._send(("abort", others))
                self.frontend.forget(pid)
                st = self._streams.pop(pid, None)
                if st is not None:
                    st._fail(error(message))
        elif kind == "report":
            if self._report_waiters:
                fut = self._report_waiters.pop(0)
                if not fut.done():
                    fut.set_result(msg[1])
        elif kind == "sleep_mode":
            _, error, sleeping = msg
            fut = self._sleep_waiters.pop(0) if self._sleep_waiters else None
            # while another sleep / wake-up call is on its way, admission stays closed: an "awake" answer followed by
            # a queued sleep must not let requests through that the engine would meet asleep
            self.sleeping = sleeping or (self.sleeping and bool(self._sleep_waiters))
            if fut is not None and not fut.done():
                fut.set_result(error)
        elif kind == "profile":
            fut = self._profile_waiters.pop(0) if self._profile_waiters else None
            if fut is not None and not fut.done():
                fut.set_result(msg[1:])
        elif kind == "fatal":
            self._on_dead(f"the engine failed: {msg[1].strip().splitlines()[-1]}")
        else:
            logger.warning("unexpected engine message %r", kind)

    def _on_dead(self, why: str) -> None:
        if self.dead is None:
            logger.error("%s", why)
        self.dead = why
        for fut in self._report_waiters:
            if not fut.done():
                fut.set_exception(EngineDeadError(why))
        self._report_waiters.clear()
        for waiters in (self._sleep_waiters, self._profile_waiters):
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(EngineDeadError(why))
            waiters.clear()
        for rid, st in list(self._streams.items()):
            st._fail(EngineDeadError(why))
        self._streams.clear()

    def _send(self, msg: tuple) -> None:
        import zmq

        if self.dead or self._in is None or self._closed:
            return
        try:
            self._in.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._on_dead(f"cannot reach the engine process: {e}")

    @property
    def is_healthy(self) -> bool:
        return (not self._closed and self.dead is None and self.proc is not None and self.proc.is_alive()
                and self._task is not None and not self._task.done())

    def ask_to_stop(self) -> None:
        """Send a ready engine the polite stop without waiting for it (data parallelism asks every engine first, then
        shuts each down, so their stops overlap)."""
        if not self._closed and self.proc is not None and self.proc.is_alive() and self.engine_info:
            import zmq

            try:
                self._in.send(pickle.dumps(("shutdown",)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (politely, then by force) and release sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for st in list(self._streams.values()):
            st._fail(RequestAbortedError("the server is shutting down"))
        self._streams.clear()
        for bs in list(self._beam_searches.values()):
            bs.cancel(RequestAbortedError("the server is shutting down"))
        self._beam_searches.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.proc is not None:
            if self.proc.is_alive() and not self.engine_info:
                self.proc.terminate()  # still loading: it would not read a polite message until done
                self.proc.join(timeout)
            if self.proc.is_alive():
                import zmq

                try:
                    self._in.send(pickle.dumps(("shutdown",)), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                self.proc.join(timeout)
            if self.proc.is_alive():
                logger.warning("engine process did not stop; terminating it")
                self.proc.terminate()
                self.proc.join(2.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(2.0)
        for sock in (self._in, self._out):
            if sock is not None:
                sock.close(0)
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        self._remove_ipc_dir()  # (if the engine never connected)

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    # -- requests -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the server is shutting down")
        if self.dead:
            raise EngineDeadError(self.dead)
        if self.frontend is None:
            raise EngineDeadError("the engine is not started")

    def _check_awake(self) -> None:
        self._check_alive()
        if self.sleeping:
            raise EngineSleepingError("the engine is sleeping (--enable-sleep-mode): POST /wake_up wakes it")

    def _validate(self, req: EngineCoreRequest) -> None:
        """The engine core's own admission checks, done here so that a bad request is a 400 at once."""
        if (req.pooling_params is not None) != (self.config.model.runner == "pooling"):
            raise InvalidRequestError(runner_mismatch(self.config.model.runner))
        if req.pooling_params is not None:
            self._check_pooling_prompt(req.prompt_token_ids)
        else:
            self._check_prompt(req.prompt_token_ids, req.sampling_params)
        check_priority(req.priority, self.config.scheduler.policy)

    def _check_pooling_prompt(self, ids: list[int]) -> None:
        n = len(ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n > self.max_model_len:  # (an embedding needs no room for a generated token)
            raise InvalidRequestError(context_length_message(self.max_model_len, n, None) + " (or set "
                                      "truncate_prompt_tokens).", "input")
        check_vocab(ids, None, self.vocab_size)

    def _check_prompt(self, ids: list[int], sp: SamplingParams) -> None:
        n = len(ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        # (max_tokens None: up to the context, which needs room for one token at least)
        wanted = sp.max_tokens if sp.max_tokens is not None else 1
        if n >= self.max_model_len or n + wanted > self.max_model_len:
            raise InvalidRequestError(context_length_message(self.max_model_len, n, wanted),
                                      "prompt" if n >= self.max_model_len else "max_tokens")
        check_vocab(ids, sp, self.vocab_size)

    def serves(self, request_id: str) -> bool:
        """Whether a request or beam search of this id is in flight here."""
        return request_id in self._streams or request_id in self._beam_searches

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    cache_salt: Optional[str] = None, priority: int = 0,
                    lora_request: Optional[Any] = None, multi_modal: Optional[Any] = None,
                    trace_headers: Optional[Mapping[str, str]] = None) -> RequestStream:
        """Validate and submit one request; raises ValueError subclasses for bad input (HTTP 400). priority: under
        --scheduling-policy priority, lower is served first (else it must be 0). lora_request: the adapter it runs
        with (voltllm.lora.request.LoRARequest; --enable-lora). multi_modal: the prompt's images
        (voltllm.multimodal.inputs.MultiModalPrompt; the prompt's ids have their placeholders expanded).
        trace_headers: the HTTP request's W3C trace headers, its span's parent when tracing (tracing.py)."""
        self._check_awake()
        if self.serves(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self._check_lora(lora_request)
        if multi_modal is not None:
            self._check_images(multi_modal)
            multi_modal = multi_modal.for_tower(self.config.model.dtype)  # (sent to the engine process: fewer bytes)
        reqs = self.frontend.make_requests(request_id, prompt, params, cache_salt, priority, lora_request,
                                           multi_modal)
        try:
            self._validate(reqs[0])
        except BaseException:
            self.frontend.forget(request_id)
            raise
        stream = RequestStream(self, request_id)
        n_prompt = len(reqs[0].prompt_token_ids)
        if self.tracer is not None:
            stream.traced = traced_request(params, n_prompt, self.max_model_len, trace_headers)
        self._streams[request_id] = stream
        self._send(("add", reqs))
        if hasattr(self.observer, "on_request_params"):
            self.observer.on_request_params(params.n, params.max_tokens if params.max_tokens is not None
                                            else self.max_model_len - n_prompt)
        return stream

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: Optional[PoolingParams] = None,
                            cache_salt: Optional[str] = None, priority: int = 0,
                            trace_headers: Optional[Mapping[str, str]] = None) -> RequestStream:
        """Validate and submit one embedding request (pooling engines); its stream yields one PoolingRequestOutput.
        Raises ValueError subclasses for bad input (HTTP 400). priority, trace_headers: as add_request's."""
        self._check_awake()
        if self.serves(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = self.frontend.make_pooling_request(request_id, prompt, params, cache_salt, priority)
        try:
            self._validate(req)
        except BaseException:
            self.frontend.forget(request_id)
            raise
        stream = RequestStream(self, request_id)
        if self.tracer is not None:
            stream.traced = TracedRequest(trace_headers)
        self._streams[request_id] = stream
        self._send(("add", [req]))
        return stream

    async def encode(self, prompt: PromptType, params: Optional[PoolingParams], request_id: str,
                     cache_salt: Optional[str] = None, priority: int = 0,
                     trace_headers: Optional[Mapping[str, str]] = None) -> AsyncIterator[PoolingRequestOutput]:
        stream = self.add_pooling_request(request_id, prompt, params, cache_salt, priority, trace_headers)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       cache_salt: Optional[str] = None, priority: int = 0,
                       lora_request: Optional[Any] = None,
                       trace_headers: Optional[Mapping[str, str]] = None) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(request_id, prompt, params, cache_salt, priority, lora_request,
                                  trace_headers=trace_headers)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _check_images(self, multi_modal: Any) -> None:
        from voltllm.multimodal.support import image_input_refusal

        why = image_input_refusal(self.config)
        if why is not None:
            raise InvalidRequestError(why, "messages")

    def _check_lora(self, lora_request: Optional[Any]) -> None:
        if lora_request is not None and self.config.lora is None:
            raise InvalidRequestError("a LoRA adapter was asked for, but LoRA is not enabled (--enable-lora)", "model")

    def beam_search(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                    cache_salt: Optional[str] = None, *, skip_special_tokens: bool = True,
                    num_logprobs: Optional[int] = None, priority: int = 0,
                    lora_request: Optional[Any] = None,
                    trace_headers: Optional[Mapping[str, str]] = None) -> BeamSearchStream:
        """Validate and start a beam search (engine/beam_search.py); its stream gives one output, the best
        params.beam_width beams as choices, when it ends. num_logprobs: each choice's logprobs (the chosen token and
        that many top ones per token), None for none. priority, lora_request, trace_headers: its steps' (as
        add_request's: each step request is traced, in the caller's trace). Raises ValueError subclasses for bad input
        (HTTP 400)."""
        self._check_awake()
        check_priority(priority, self.config.scheduler.policy)
        self._check_lora(lora_request)
        if self.serves(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self.frontend.tokenize(prompt)
        # the steps' logprobs: the candidates, or more when the answer shows more
        step_logprobs = min(max(params.num_candidates, num_logprobs or 0), self.vocab_size)
        self._check_prompt(ids, SamplingParams(max_tokens=params.max_tokens, logprobs=step_logprobs))
        stream = BeamSearchStream(self, request_id)
        stream.lora_int_id = lora_request.lora_int_id if lora_request is not None else None
        self._beam_searches[request_id] = stream
        stream.start(functools.partial(run_beam_search, self, request_id, text, ids, params, step_logprobs,
                                       cache_salt, skip_special_tokens, num_logprobs, priority, lora_request,
                                       trace_headers))
        return stream

    def abort(self, request_id: str, reason: Optional[str] = None) -> None:
        """Abort a parent request (all its children) or a beam search (its step's requests); a no-op for unknown or
        finished requests."""
        bs = self._beam_searches.pop(request_id, None)
        if bs is not None:
            bs.cancel(RequestAbortedError(reason or f"request {request_id} was aborted"))
            return
        st = self._streams.pop(request_id, None)
        if self.frontend is not None:
            cids = self.frontend.child_ids(request_id)
            if cids:
                self._send(("abort", cids))
            self.frontend.forget(request_id)
        if st is not None and not st.finished:
            st._fail(RequestAbortedError(reason or f"request {request_id} was aborted"))
            if self.observer:
                self.observer.on_finished(st._last_output, "abort", time.monotonic() - st.arrival)

    def abort_all(self) -> None:
        """Abort every request in flight (server shutdown): their streams end with RequestAbortedError."""
        for rid in [*self._beam_searches, *self._streams]:
            self.abort(rid, "the server is shutting down")

    def remove_lora(self, lora_int_id: int) -> None:
        """The engine removes the adapter of that id (EngineCore.remove_lora): the requests already sent with it finish
        with it (this message comes after them), then it leaves the engine's CPU memory and GPU slot. A beam search
        running with it sends its step requests one step at a time, so the message waits until such searches end
        (else each later step would read the adapter again, from whatever its path holds by then)."""
        if any(bs.lora_int_id == lora_int_id for bs in self._beam_searches.values()):
            self._removals_after_searches.add(lora_int_id)
            return
        self._send(("remove_lora", lora_int_id))

    def _beam_search_ended(self) -> None:
        """Send the adapter removals that waited for beam searches which have all ended now."""
        for lora_id in list(self._removals_after_searches):
            if not any(bs.lora_int_id == lora_id for bs in self._beam_searches.values()):
                self._removals_after_searches.discard(lora_id)
                self._send(("remove_lora", lora_id))

    async def acceleration_report(self, timeout: float = 30.0) -> dict:
        """The engine's acceleration report (voltllm.acceleration.build_report on the loaded engine)."""
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._report_waiters.append(fut)
        self._send(("report",))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"the engine did not answer the report request within {timeout:.0f} s") from None

    # -- profiling (--profiler-config) --------------------------------------------------------------
    async def start_profile(self) -> None:
        """vLLM's: the engine's profiler runs until stop_profile. ValueError (profiling.ProfilerError): profiling is
        off, or it already runs."""
        await self._profile_call("start")

    async def stop_profile(self) -> list[str]:
        """The trace files of the steps since start_profile (written in the engine process; a long run takes a while
        to write). ValueError: not running."""
        return await self._profile_call("stop")

    async def _profile_call(self, what: str) -> list[str]:
        from voltllm.profiling import ProfilerError

        self._check_alive()  # (with profiling off, the engine's answer says so)
        fut = asyncio.get_running_loop().create_future()
        self._profile_waiters.append(fut)
        self._send(("profile", what))
        error, files = await asyncio.shield(fut)
        if error is not None:
            raise ProfilerError(error)
        return files

    # -- sleep mode (--enable-sleep-mode) ----------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """vLLM's: the engine frees the GPU memory of its weights (level 1: kept in CPU memory; level 2: discarded,
        reloaded at wake-up) and of its KV cache. The requests in flight are aborted (their streams fail with
        RequestAbortedError, vLLM's default "abort" mode); new ones are refused with EngineSleepingError until
        wake_up. ValueError: a bad level, or sleep mode off."""
        from voltllm.worker.sleep_mode import check_level

        self._check_alive()
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the server with --enable-sleep-mode")
        check_level(level)
        was_sleeping, self.sleeping = self.sleeping, True
        if not was_sleeping:
            for rid in [*self._beam_searches, *self._streams]:
                self.abort(rid, f"request {rid} was aborted: the engine was put to sleep")
        try:
            await self._sleep_mode_call(("sleep", level))
        except ValueError:
            self.sleeping = was_sleeping
            raise

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Restore what sleep freed: tags None (all), or ["weights"] / ["kv_cache"]; requests are taken again once
        every part is awake. ValueError: a bad tag, or sleep mode off."""
        from voltllm.worker.sleep_mode import check_tags

        self._check_alive()
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the server with --enable-sleep-mode")
        check_tags(tags)
        await self._sleep_mode_call(("wake_up", list(tags) if tags is not None else None))

    async def _sleep_mode_call(self, msg: tuple) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._sleep_waiters.append(fut)
        self._send(msg)
        error = await asyncio.shield(fut)  # (a sleep waits for the step in flight; a level-2 wake-up reloads weights)
        if error is not None:
            kind, message = error
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)

    @property
    def num_active_requests(self) -> int:
        """Requests in flight: each beam search, and each of its step's requests."""
        return len(self._streams) + len(self._beam_searches)
