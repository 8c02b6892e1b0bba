"""Prometheus metrics for GET /metrics (names follow vLLM's, with the `voltllm:` prefix).

Each metric vLLM also exports is written a second time under vLLM's own name (`vllm:` prefix, same labels and
values; VLLM_NAMES), so dashboards and alerts built for a vLLM server read a voltllm server unchanged. voltllm's own
additions (active requests, block count, hit rate, engine liveness, HTTP counts) have no vLLM name.

Per-request timings (TTFT, inter-token latency, end-to-end) are measured in the API process as outputs
arrive, which is what a client sees. A finished request's phases, as vLLM splits them, come from the engine's
timestamps (RequestMetrics): queue = first scheduled - arrival, prefill = first token - first scheduled,
decode = last token - first token, inference = last token - first scheduled. Engine state (running / waiting
requests, KV usage, prefix-cache hits, preemptions, speculative drafts scored / accepted) is the engine's latest
SchedulerStats, sent with every step's outputs; those also carry the token counts of the steps since the last ones
(iteration_tokens_total). A generation request's n and max_tokens are observed when it is admitted.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from voltllm.engine.outputs import RequestOutput
from voltllm.engine.types import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
# vLLM's request-latency buckets: e2e and the phases (queue, prefill, decode, inference)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
# vLLM's per-output-token buckets (time_per_output_token, request_time_per_output_token)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
# KV block residency (--kv-cache-metrics): milliseconds to an hour
_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
                      120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
# vLLM's `engine` label: the engine's index among --data-parallel-size engines (0 with one engine)
ENGINE_INDEX = "0"


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for per-request token counts, up to max_model_len)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


# voltllm metric families that vLLM exports under the same name with its own prefix (vLLM's v1 engine metrics), and
# vLLM's older name for the KV usage gauge (its v0 dashboards read vllm:gpu_cache_usage_perc)
VLLM_NAMES = {f"voltllm:{n}": [f"vllm:{n}"] for n in (
    "num_requests_running", "num_requests_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
    "prompt_tokens", "generation_tokens", "request_success", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_drafts", "spec_decode_num_accepted_tokens_per_pos",
    "time_per_output_token_seconds", "request_time_per_output_token_seconds",
    "request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_inference_time_seconds", "lora_requests_info", "iteration_tokens_total", "request_params_n",
    "request_params_max_tokens", "cache_config_info", "external_prefix_cache_queries",
    "external_prefix_cache_hits", "estimated_flops_per_gpu", "estimated_read_bytes_per_gpu",
    "estimated_write_bytes_per_gpu", "kv_block_lifetime_seconds", "kv_block_idle_before_evict_seconds",
    "kv_block_reuse_gap_seconds")}
VLLM_NAMES["voltllm:kv_cache_usage_perc"] = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]


class _VLLMNames(Collector):
    """The families of `source` that have a vLLM name, again under that name (samples renamed, values shared)."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self) -> Iterable[Any]:
        for family in self.source.collect():
            for alias in VLLM_NAMES.get(family.name, ()):
                copy = Metric(alias, family.documentation, family.type, family.unit)
                copy.samples = [s._replace(name=alias + s.name[len(family.name):]) for s in family.samples]
                yield copy


# vLLM's buckets for the tokens of one engine step, and for a request's n
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)

# one engine's state for /metrics: its latest SchedulerStats, whether it is up, the API server's requests on it
EngineSample = tuple[SchedulerStats, bool, int]


class _EngineCollector(Collector):
    def __init__(self, model: str, engines: Callable[[], Sequence[EngineSample]], cache_config: Any = None):
        self.model = model
        self.engines = engines
        self.cache_config = cache_config  # (voltllm.config.CacheConfig: vLLM's cache_config_info labels)

    def collect(self) -> Iterable[Any]:
        samples = list(self.engines())
        lab = ["model_name", "engine"]
        families: dict[str, Any] = {}

        def add(kind: Any, name: str, doc: str, index: int, value: float, **more: str) -> None:
            if name not in families:
                families[name] = kind(name, doc, labels=lab + list(more))
            families[name].add_metric([self.model, str(index), *more.values()], value)

        for i, (s, alive, active) in enumerate(samples):
            add(GaugeMetricFamily, "voltllm:num_requests_running", "Requests in the engine's running batch.", i,
                s.num_running)
            add(GaugeMetricFamily, "voltllm:num_requests_waiting", "Requests waiting to be scheduled (queue length).",
                i, s.num_waiting)
            add(GaugeMetricFamily, "voltllm:num_requests_active", "Requests the API server is serving (incl. ones "
                "being detokenized).", i, active)
            add(GaugeMetricFamily, "voltllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", i,
                s.kv_cache_usage)
            add(GaugeMetricFamily, "voltllm:kv_cache_num_blocks", "KV-cache blocks in total.", i, s.num_blocks)
            add(CounterMetricFamily, "voltllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                i, s.prefix_cache_queries)
            add(CounterMetricFamily, "voltllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", i,
                s.prefix_cache_hits)
            rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
            add(GaugeMetricFamily, "voltllm:prefix_cache_hit_rate", "Prefix-cache hits / queries since start "
                "(tokens).", i, rate)
            if "external_prefix_cache_queries" in s.extra:  # --kv-offloading-size: the CPU tier (vLLM's KV connector)
                add(CounterMetricFamily, "voltllm:external_prefix_cache_queries", "Prompt tokens of the requests "
                    "admitted with the CPU tier of the prefix cache on (--kv-offloading-size).", i,
                    s.extra["external_prefix_cache_queries"])
                add(CounterMetricFamily, "voltllm:external_prefix_cache_hits", "Prompt tokens found in the CPU tier "
                    "of the prefix cache and copied back to the GPU.", i, s.extra["external_prefix_cache_hits"])
            add(CounterMetricFamily, "voltllm:num_preemptions", "Requests preempted (blocks freed, recomputed "
                "later).", i, s.num_preemptions)
            if "spec_draft_tokens" in s.extra:  # --speculative-config
                add(CounterMetricFamily, "voltllm:spec_decode_num_draft_tokens", "Draft tokens scored by "
                    "speculative steps.", i, s.extra["spec_draft_tokens"])
                add(CounterMetricFamily, "voltllm:spec_decode_num_accepted_tokens", "Draft tokens accepted (each "
                    "one a decode step saved).", i, s.extra["spec_accepted_tokens"])
                add(CounterMetricFamily, "voltllm:spec_decode_num_drafts", "Verifications of a request's drafts "
                    "(mean acceptance length: 1 + accepted tokens / drafts).", i, s.extra.get("spec_drafts", 0))
                for pos, n in enumerate(s.extra.get("spec_accepted_per_pos", ())):
                    add(CounterMetricFamily, "voltllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                        "accepted at each draft position (0: the first draft).", i, n, position=str(pos))
            if "estimated_flops_per_gpu" in s.extra:  # --enable-mfu-metrics (perf_metrics.py)
                for key, what in (("estimated_flops_per_gpu", "FLOPs"), ("estimated_read_bytes_per_gpu", "bytes read"),
                                  ("estimated_write_bytes_per_gpu", "bytes written")):
                    add(CounterMetricFamily, f"voltllm:{key}", f"Estimated {what} per GPU of the steps run "
                        "(--enable-mfu-metrics: the loaded model's cost applied to each step's tokens).", i,
                        s.extra[key])
            add(GaugeMetricFamily, "voltllm:engine_alive", "1 while the engine process is up.", i,
                1.0 if alive else 0.0)
        yield from families.values()
        c = self.cache_config
        if c is not None:  # vLLM's info gauge: the cache configuration as labels, value 1
            names = ["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization", "num_gpu_blocks",
                     "num_gpu_blocks_override", "kv_offloading_size", "kv_offloading_backend", "engine"]
            info = GaugeMetricFamily("voltllm:cache_config_info", "Information of the engine's cache configuration.",
                                     labels=names)
            offload = getattr(c, "kv_offloading_size", None)
            for i, (s, _, _) in enumerate(samples):
                info.add_metric([str(c.block_size), str(c.kv_cache_dtype), str(c.enable_prefix_caching),
                                 str(c.gpu_memory_utilization), str(s.num_blocks), str(c.num_gpu_blocks_override),
                                 str(offload), str(getattr(c, "kv_offloading_backend", None) if offload else None),
                                 str(i)], 1.0)
            yield info
        lora = [s.extra for s, _, _ in samples if "max_lora" in s.extra]
        if lora:  # --enable-lora: vLLM's info gauge (no engine label: the adapters of every engine's requests)
            info = GaugeMetricFamily("voltllm:lora_requests_info", "Running stats on LoRA requests: the adapters of "
                                     "the running and waiting requests (comma-separated names).",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            waiting = sorted({n for e in lora for n in e["lora_waiting"]})
            running = sorted({n for e in lora for n in e["lora_running"]})
            info.add_metric([str(lora[0]["max_lora"]), ",".join(waiting), ",".join(running)], time.time())
            yield info


class ServerMetrics:
    """Implements AsyncLLM's StatObserver; render() is the /metrics body.

    Every family with a `model_name` label also carries vLLM's `engine` label (ENGINE_INDEX)."""

    def __init__(self, model: str, stats: Callable[[], SchedulerStats], alive: Callable[[], bool],
                 active: Callable[[], int], *, max_model_len: int,
                 engines: Optional[Callable[[], Sequence[EngineSample]]] = None, num_engines: int = 1,
                 cache_config: Any = None):
        """max_model_len: the top of the token-count histograms' buckets (as vLLM's). With --data-parallel-size,
        engines gives each engine's sample (DataParallelLLM.engine_samples) in place of stats / alive / active, and
        for_engine(k) the observer of engine k's requests."""
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        lab = ["model_name", "engine"]
        tokens = one_two_five_buckets(max_model_len)
        self.requests = Counter("voltllm:request_success", "Finished requests, by finish reason.",
                                lab + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("voltllm:prompt_tokens", "Prompt tokens of finished requests.", lab, registry=r)
        self.generation_tokens = Counter("voltllm:generation_tokens", "Generated tokens.", lab, registry=r)
        self.ttft = Histogram("voltllm:time_to_first_token_seconds", "Time to first token (API side).", lab,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("voltllm:inter_token_latency_seconds", "Time between output tokens (API side).", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("voltllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", lab,
                             buckets=_E2E_BUCKETS, registry=r)
        # vLLM's older name for the inter-token latency, with its own buckets: one sample per output token
        self.tpot = Histogram("voltllm:time_per_output_token_seconds", "Time per output token (API side; the "
                              "inter-token latency).", lab, buckets=_TPOT_BUCKETS, registry=r)
        self.request_tpot = Histogram("voltllm:request_time_per_output_token_seconds", "A finished request's mean "
                                      "time per output token after the first, (e2e - TTFT) / (tokens - 1); 0 for "
                                      "one token.", lab, buckets=_TPOT_BUCKETS, registry=r)
        self.request_prompt = Histogram("voltllm:request_prompt_tokens", "Prompt tokens of a finished request.", lab,
                                        buckets=tokens, registry=r)
        self.request_generation = Histogram("voltllm:request_generation_tokens", "Tokens generated for one "
                                            "choice of a finished request.", lab, buckets=tokens, registry=r)
        self.request_max_generation = Histogram("voltllm:request_max_num_generation_tokens", "Most tokens "
                                                "generated by one choice of a finished request.", lab,
                                                buckets=tokens, registry=r)
        phase = {name: Histogram(f"voltllm:request_{name}_time_seconds", doc, lab, buckets=_E2E_BUCKETS,
                                 registry=r) for name, doc in (
            ("queue", "Time a finished request waited before its first scheduling (WAITING phase)."),
            ("prefill", "Time from a finished request's first scheduling to its first token (PREFILL phase)."),
            ("decode", "Time from a finished request's first token to its last (DECODE phase)."),
            ("inference", "Time from a finished request's first scheduling to its last token (RUNNING phase)."))}
        self.phases = phase
        self.iteration_tokens = Histogram("voltllm:iteration_tokens_total", "Tokens scheduled in each engine step.",
                                          lab, buckets=_ITERATION_BUCKETS, registry=r)
        # --kv-cache-metrics (cache/residency.py): a sampled share of the KV blocks
        self.kv_blocks = {key: Histogram(f"voltllm:kv_block_{name}_seconds", doc, lab, buckets=_RESIDENCY_BUCKETS,
                                         registry=r) for key, name, doc in (
            ("lifetime", "lifetime", "Sampled KV blocks' time from being taken (allocated, or taken back by a prefix "
                                     "hit) to the release of their last reference."),
            ("idle_before_evict", "idle_before_evict", "Sampled KV blocks' time from their release to the eviction "
                                                       "of their cached content."),
            ("reuse_gap", "reuse_gap", "Sampled KV blocks' time from their previous access to a prefix-cache hit "
                                       "on them."))}
        self.params_n = Histogram("voltllm:request_params_n", "The n of each generation request.", lab,
                                  buckets=_N_BUCKETS, registry=r)
        self.params_max_tokens = Histogram("voltllm:request_params_max_tokens", "The max_tokens of each generation "
                                           "request (when not given: what its context leaves).", lab, buckets=tokens,
                                           registry=r)
        # as vLLM, every per-model family shows from the start (a histogram at 0 counts), not from its first sample
        for family in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.tpot,
                       self.request_tpot, self.request_prompt, self.request_generation, self.request_max_generation,
                       *phase.values(), self.iteration_tokens, self.params_n, self.params_max_tokens):
            for k in range(num_engines):
                family.labels(model, str(k))
        self.http = Counter("voltllm:http_requests", "HTTP requests by route and status.",
                            ["method", "path", "status"], registry=r)
        r.register(_EngineCollector(model, engines or (lambda: [(stats(), alive(), active())]), cache_config))
        self.vllm_names = CollectorRegistry(auto_describe=True)
        self.vllm_names.register(_VLLMNames(r))
        # totals for the periodic log line
        self.total_generated = 0
        self.total_prompt = 0
        self.total_finished = 0

    # StatObserver (of engine 0's requests; for_engine(k): engine k's)
    def on_first_token(self, ttft_s: float, engine: str = ENGINE_INDEX) -> None:
        self.ttft.labels(self.model, engine).observe(ttft_s)
        self.generation_tokens.labels(self.model, engine).inc(1)
        self.total_generated += 1

    def on_tokens(self, inter_token_s: float, count: int, engine: str = ENGINE_INDEX) -> None:
        itl = self.itl.labels(self.model, engine)
        tpot = self.tpot.labels(self.model, engine)
        for _ in range(count):
            itl.observe(inter_token_s)
            tpot.observe(inter_token_s)
        self.generation_tokens.labels(self.model, engine).inc(count)
        self.total_generated += count

    def on_finished(self, out: Optional[RequestOutput], reason: str, e2e_s: float, engine: str = ENGINE_INDEX) -> None:
        self.requests.labels(self.model, engine, reason).inc()
        self.e2e.labels(self.model, engine).observe(e2e_s)
        self.total_finished += 1
        if out is not None:
            self.prompt_tokens.labels(self.model, engine).inc(len(out.prompt_token_ids))
            self.total_prompt += len(out.prompt_token_ids)
            self._observe_request(out, e2e_s, engine)

    def on_request_params(self, n: int, max_tokens: int, engine: str = ENGINE_INDEX) -> None:
        self.params_n.labels(self.model, engine).observe(n)
        self.params_max_tokens.labels(self.model, engine).observe(max_tokens)

    def on_iteration_tokens(self, counts: list[int], engine: str = ENGINE_INDEX) -> None:
        hist = self.iteration_tokens.labels(self.model, engine)
        for c in counts:
            hist.observe(c)

    def on_kv_block_samples(self, samples: dict, engine: str = ENGINE_INDEX) -> None:
        for key, values in samples.items():
            hist = self.kv_blocks[key].labels(self.model, engine)
            for v in values:
                hist.observe(v)

    def for_engine(self, index: int) -> "_EngineObserver":
        return _EngineObserver(self, str(index))

    def _observe_request(self, out: RequestOutput, e2e_s: float, engine: str) -> None:
        """The per-request histograms: token counts, mean time per output token, and the phases whose
        timestamps the request reached (one aborted while waiting has no prefill, for instance)."""
        lab = (self.model, engine)
        self.request_prompt.labels(*lab).observe(len(out.prompt_token_ids))
        # (a pooling request's output has no choices: its embedding is its one result, no generated tokens)
        counts = ([len(c.token_ids) for c in out.outputs] if isinstance(out.outputs, list) else []) or [0]
        for n in counts:
            self.request_generation.labels(*lab).observe(n)
        longest = max(counts)
        self.request_max_generation.labels(*lab).observe(longest)
        m = out.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            tpot = max(e2e_s - ttft, 0.0) / (longest - 1) if longest > 1 else 0.0
            self.request_tpot.labels(*lab).observe(tpot)
        spans = {"queue": (m.arrival_time, m.scheduled_time),
                 "prefill": (m.scheduled_time, m.engine_first_token_time),
                 "decode": (m.engine_first_token_time, m.engine_last_token_time),
                 "inference": (m.scheduled_time, m.engine_last_token_time)}
        for name, (start, end) in spans.items():
            if start is not None and end is not None:
                self.phases[name].labels(*lab).observe(max(end - start, 0.0))

    def on_http(self, method: str, path: str, status: int) -> None:
        self.http.labels(method, path, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_names)


class _EngineObserver:
    """The StatObserver of one data-parallel engine's requests: ServerMetrics' samples labelled with its index."""

    def __init__(self, metrics: ServerMetrics, engine: str):
        self.metrics = metrics
        self.engine = engine

    def on_first_token(self, ttft_s: float) -> None:
        self.metrics.on_first_token(ttft_s, self.engine)

    def on_tokens(self, inter_token_s: float, count: int) -> None:
        self.metrics.on_tokens(inter_token_s, count, self.engine)

    def on_finished(self, out: Optional[RequestOutput], reason: str, e2e_s: float) -> None:
        self.metrics.on_finished(out, reason, e2e_s, self.engine)

    def on_request_params(self, n: int, max_tokens: int) -> None:
        self.metrics.on_request_params(n, max_tokens, self.engine)

    def on_iteration_tokens(self, counts: list[int]) -> None:
        self.metrics.on_iteration_tokens(counts, self.engine)

    def on_kv_block_samples(self, samples: dict) -> None:
        self.metrics.on_kv_block_samples(samples, self.engine)


def engine_metrics(model: str, engine: Any) -> ServerMetrics:
    """The server's metrics for `engine` (an AsyncLLM, or a DataParallelLLM: samples and observers per engine),
    set as its observer."""
    many = getattr(engine, "engines", None)
    metrics = ServerMetrics(model, lambda: engine.stats, lambda: engine.is_healthy,
                            lambda: engine.num_active_requests, max_model_len=engine.max_model_len,
                            engines=engine.engine_samples if many else None, num_engines=len(many) if many else 1,
                            cache_config=getattr(getattr(engine, "config", None), "cache", None))
    engine.observer = metrics
    return metrics
