"""Data parallelism (--data-parallel-size N): N engines side by side behind one API server.

Each engine is an ordinary AsyncLLM (its own engine process, its own -tp ranks or -pp stages, KV cache, prefix cache
and CUDA graphs) on its own GPUs: engine k takes its tp x pp devices from the configured first one's index +
k * tp * pp (on the CPU all run there). A request goes whole to one engine, the least busy one unless another holds
the beginning of its prompt in its prefix cache (engine/dp_routing.py), and stays there: its streams, aborts and
beam-search steps are that engine's. The engines never talk to each other, so a model is served N times over, as
vLLM's data parallelism serves a dense model (vLLM spreads a MoE model's experts over its data-parallel ranks; here
each engine holds every expert, see config._check_data_parallel).

DataParallelLLM offers the part of AsyncLLM's interface the server and run-batch use; one engine's death makes the
whole unhealthy (the server then stops, as it does when its one engine dies).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import replace
from typing import Any, AsyncIterator, Mapping, Optional

import torch

from voltllm.config import ConfigError, EngineConfig
from voltllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from voltllm.engine.dp_routing import PrefixRouter, prompt_keys
from voltllm.engine.outputs import PoolingRequestOutput, RequestOutput
from voltllm.engine.request_checks import InvalidRequestError
from voltllm.engine.types import SchedulerStats

logger = logging.getLogger("voltllm")


def rank_config(config: EngineConfig, index: int) -> EngineConfig:
    """Engine `index`'s configuration: the same, on the group of GPUs that is its own (its tensor-parallel ranks or
    pipeline stages; on the CPU: the CPU), knowing its index (its global seed: ParallelConfig.global_seed)."""
    config = replace(config, parallel=replace(config.parallel, data_parallel_rank=index))
    dev = config.device.device
    if dev.type != "cuda":
        return config
    first = (dev.index or 0) + index * config.parallel.world_size
    return replace(config, device=replace(config.device, device=torch.device("cuda", first)))


def require_one_engine(config: EngineConfig, who: str) -> None:
    """`who` (the offline LLM, the in-process bench) drives one engine in its own process: refuse more."""
    dp = config.parallel.data_parallel_size
    if dp > 1:
        raise ConfigError(f"--data-parallel-size {dp}: {who} runs one engine; data-parallel engines are served by "
                          "`voltllm serve` and `voltllm run-batch` (measure them with `voltllm bench --base-url`)")


def make_async_engine(config: EngineConfig, log_level: int = logging.INFO) -> Any:
    """The server's engine handle: an AsyncLLM, or a DataParallelLLM of --data-parallel-size of them."""
    if config.parallel.data_parallel_size > 1:
        return DataParallelLLM(config, log_level=log_level)
    return AsyncLLM(config, log_level=log_level)


class DataParallelLLM:
    def __init__(self, config: EngineConfig, tokenizer: Any = None, log_level: int = logging.INFO):
        n = config.parallel.data_parallel_size
        if n < 2:
            raise ValueError(f"data parallelism needs at least 2 engines, got {n}")
        self.config = config
        self.tokenizer = tokenizer
        self.engines = [AsyncLLM(rank_config(config, k), tokenizer, log_level=log_level, engine_index=k)
                        for k in range(n)]
        self._observer: Any = None
        self._tracer: Any = None
        self.router = PrefixRouter(n)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, timeout: Optional[float] = None) -> None:
        """Start every engine at once (their weights load in parallel, one tokenizer is loaded for all)."""
        try:
            for e in self.engines:  # the engines load their weights while the tokenizer loads here
                e._spawn()
            if self.tokenizer is None:
                from voltllm.model.loader import load_tokenizer

                mc = self.config.model
                self.tokenizer = await asyncio.to_thread(load_tokenizer, mc.tokenizer, mc.trust_remote_code)
            for e in self.engines:
                e.tokenizer = self.tokenizer
            starts = [asyncio.ensure_future(e.finish_start(timeout)) for e in self.engines]
            try:
                await asyncio.gather(*starts)
            except BaseException:  # one engine could not start: the others stop waiting, then all stop
                for t in starts:
                    t.cancel()
                await asyncio.gather(*starts, return_exceptions=True)
                raise
        except BaseException:
            self.shutdown()
            raise
        # --max-model-len auto fits each engine to its own card's KV cache: every engine takes the shortest, so a
        # request is accepted or refused the same whichever engine it reaches
        shortest = self.max_model_len
        for e in self.engines:
            e.max_model_len = e.frontend.max_model_len = shortest
        for e in self.engines:
            info = e.engine_info
            logger.info("data-parallel engine %d on %s: pid %s, %s KV blocks", e.engine_index, e.config.device.device,
                        info.get("pid"), info.get("num_blocks"))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Every engine asked to stop first, then each shut down (waited for, then forced): their stops overlap."""
        for e in self.engines:
            e.ask_to_stop()
        for e in self.engines:
            e.shutdown(timeout)

    @property
    def observer(self) -> Any:
        return self._observer

    @observer.setter
    def observer(self, obs: Any) -> None:
        """A metrics observer with for_engine(k) (ServerMetrics) labels each engine's requests by its index."""
        self._observer = obs
        for e in self.engines:
            e.observer = obs.for_engine(e.engine_index) if hasattr(obs, "for_engine") else obs

    @property
    def tracer(self) -> Any:
        return self._tracer

    @tracer.setter
    def tracer(self, tracer: Any) -> None:
        """--otlp-traces-endpoint: one tracing.RequestTracer records every engine's requests (their spans tell no
        engine apart, as vLLM's)."""
        self._tracer = tracer
        for e in self.engines:
            e.tracer = tracer

    # -- state ----------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return all(e.is_healthy for e in self.engines)

    @property
    def dead(self) -> Optional[str]:
        for e in self.engines:
            if e.dead:
                return f"data-parallel engine {e.engine_index}: {e.dead}"
        return None

    @property
    def proc(self) -> Any:
        """The first engine process that has exited, else engine 0's (the server's watchdog reads its exit code)."""
        for e in self.engines:
            if e.proc is not None and not e.proc.is_alive():
                return e.proc
        return self.engines[0].proc

    @property
    def max_model_len(self) -> int:
        """The shortest of the engines' (--max-model-len auto fits each to its own KV cache)."""
        return min(e.max_model_len for e in self.engines)

    @property
    def vocab_size(self) -> int:
        return self.engines[0].vocab_size

    @property
    def engine_info(self) -> dict:
        """Engine 0's start-up facts, with the KV blocks of all engines summed and each engine's pid."""
        info = dict(self.engines[0].engine_info)
        info["num_blocks"] = sum(int(e.engine_info.get("num_blocks") or 0) for e in self.engines)
        info["pids"] = [e.engine_info.get("pid") for e in self.engines]
        info["data_parallel_size"] = len(self.engines)
        return info

    @property
    def stats(self) -> SchedulerStats:
        """The engines' latest stats together: counts summed, KV use as the share of all blocks in use."""
        parts = [e.stats for e in self.engines]
        blocks = sum(s.num_blocks for s in parts)
        used = sum(s.kv_cache_usage * s.num_blocks for s in parts)
        extra: dict = {}
        for s in parts:
            for k, v in s.extra.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "max_lora":
                    extra[k] = extra.get(k, 0) + v
                elif k.endswith("_per_pos"):  # (speculation's counts by draft position: summed position-wise)
                    prev = extra.get(k, [])
                    extra[k] = [a + b for a, b in itertools.zip_longest(prev, v, fillvalue=0)]
                elif isinstance(v, list):
                    extra[k] = sorted(set(extra.get(k, [])) | set(v))
                else:
                    extra.setdefault(k, v)
        return SchedulerStats(num_running=sum(s.num_running for s in parts),
                              num_waiting=sum(s.num_waiting for s in parts),
                              kv_cache_usage=used / blocks if blocks else 0.0,
                              prefix_cache_queries=sum(s.prefix_cache_queries for s in parts),
                              prefix_cache_hits=sum(s.prefix_cache_hits for s in parts),
                              num_preemptions=sum(s.num_preemptions for s in parts), num_blocks=blocks,
                              step_counter=sum(s.step_counter for s in parts), extra=extra)

    def engine_samples(self) -> list[tuple[SchedulerStats, bool, int]]:
        """Each engine's (stats, alive, requests in flight), by index: /metrics labels them `engine`."""
        return [(e.stats, e.is_healthy, e.num_active_requests) for e in self.engines]

    @property
    def num_active_requests(self) -> int:
        return sum(e.num_active_requests for e in self.engines)

    # -- requests -------------------------------------------------------------------------------
    def _pick(self, request_id: str, prompt: Any, cache_salt: Optional[str] = None,
              lora_request: Optional[Any] = None) -> AsyncLLM:
        """The engine for a new request (engine/dp_routing.py: the least busy, or the one holding the prompt's
        beginning). Raises for a request id one engine already serves, and when an engine has died (the server is
        going down)."""
        if (why := self.dead) is not None:
            raise EngineDeadError(why)
        for e in self.engines:
            if e.serves(request_id):
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
        adapter = getattr(lora_request, "lora_name", None)
        keys = prompt_keys(prompt, cache_salt, adapter)
        return self.engines[self.router.choose(keys, [e.num_active_requests for e in self.engines])]

    def add_request(self, request_id: str, prompt: Any, params: Any, cache_salt: Optional[str] = None,
                    priority: int = 0, lora_request: Optional[Any] = None,
                    multi_modal: Optional[Any] = None, trace_headers: Optional[Mapping[str, str]] = None
                    ) -> RequestStream:
        engine = self._pick(request_id, prompt, cache_salt, lora_request)
        return engine.add_request(request_id, prompt, params, cache_salt, priority, lora_request, multi_modal,
                                  trace_headers=trace_headers)

    def add_pooling_request(self, request_id: str, prompt: Any, params: Any = None, cache_salt: Optional[str] = None,
                            priority: int = 0, trace_headers: Optional[Mapping[str, str]] = None) -> RequestStream:
        return self._pick(request_id, prompt, cache_salt).add_pooling_request(request_id, prompt, params, cache_salt,
                                                                              priority, trace_headers)

    def beam_search(self, request_id: str, prompt: Any, params: Any, cache_salt: Optional[str] = None,
                    **kwargs: Any) -> Any:
        """The whole search on one engine: its steps' prompts share that engine's prefix cache."""
        engine = self._pick(request_id, prompt, cache_salt, kwargs.get("lora_request"))
        return engine.beam_search(request_id, prompt, params, cache_salt, **kwargs)

    async def generate(self, prompt: Any, params: Any, request_id: str, cache_salt: Optional[str] = None,
                       priority: int = 0, lora_request: Optional[Any] = None,
                       trace_headers: Optional[Mapping[str, str]] = None) -> AsyncIterator[RequestOutput]:
        engine = self._pick(request_id, prompt, cache_salt, lora_request)
        async for out in engine.generate(prompt, params, request_id, cache_salt, priority, lora_request,
                                         trace_headers):
            yield out

    async def encode(self, prompt: Any, params: Any, request_id: str, cache_salt: Optional[str] = None,
                     priority: int = 0, trace_headers: Optional[Mapping[str, str]] = None
                     ) -> AsyncIterator[PoolingRequestOutput]:
        async for out in self._pick(request_id, prompt, cache_salt).encode(prompt, params, request_id, cache_salt,
                                                                            priority, trace_headers):
            yield out

    def abort(self, request_id: str, reason: Optional[str] = None) -> None:
        """Abort a request on whichever engine serves it (a no-op on the others, as for unknown ids)."""
        for e in self.engines:
            e.abort(request_id, reason)

    def abort_all(self) -> None:
        for e in self.engines:
            e.abort_all()

    def remove_lora(self, lora_int_id: int) -> None:
        """Every engine removes the adapter (each read it on its own first request with it, if any)."""
        for e in self.engines:
            e.remove_lora(lora_int_id)

    async def start_profile(self) -> None:
        """Every engine's profiler starts (each writes its own trace, named with its index)."""
        await asyncio.gather(*(e.start_profile() for e in self.engines))

    async def stop_profile(self) -> list[str]:
        return [f for files in await asyncio.gather(*(e.stop_profile() for e in self.engines)) for f in files]

    async def sleep(self, level: int = 1) -> None:
        """Every engine sleeps (AsyncLLM.sleep)."""
        await asyncio.gather(*(e.sleep(level) for e in self.engines))

    async def wake_up(self, tags: Optional[list] = None) -> None:
        await asyncio.gather(*(e.wake_up(tags) for e in self.engines))

    @property
    def sleeping(self) -> bool:
        """Some engine sleeps (all do, unless one failed to wake up)."""
        return any(e.sleeping for e in self.engines)

    async def acceleration_report(self, timeout: float = 30.0) -> dict:
        """Engine 0's report (the engines run one configuration) with each engine's verdict under "engines"; "ok"
        only if every engine's is, and a route disabled on any engine's GPU is listed with that engine's index."""
        reports = await asyncio.gather(*(e.acceleration_report(timeout) for e in self.engines))
        for r in reports:
            if "routes" not in r:  # an engine could not build its report: that answer is the answer
                return r
        out = dict(reports[0])
        out["ok"] = all(r["ok"] for r in reports)
        out["disabled_expected"] = [{**d, "engine": k} for k, r in enumerate(reports) for d in r["disabled_expected"]]
        out["engines"] = [{"engine": k, "device": r["configuration"]["device"], "ok": r["ok"]}
                          for k, r in enumerate(reports)]
        return out
