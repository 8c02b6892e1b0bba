"""Prometheus metrics for GET /metrics (names follow vLLM's, with the `voltllm:` prefix).

Each metric vLLM also exports is written a second time under vLLM's own name (`vllm:` prefix, same labels and
values; VLLM_NAMES), so dashboards and alerts built for a vLLM server read a voltllm server unchanged. voltllm's own
additions (active requests, block count, hit rate, engine liveness, HTTP counts) have no vLLM name.

Per-request timings (TTFT, inter-token latency, end-to-end) are measured in the API process as outputs
arrive, which is what a client sees. Engine state (running / waiting requests, KV usage, prefix-cache
hits, preemptions, speculative drafts scored / accepted) is the engine's latest SchedulerStats, sent with every
step's outputs.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from voltllm.engine.outputs import RequestOutput
from voltllm.engine.types import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0)


# voltllm metric families that vLLM exports under the same name with its own prefix (vLLM's v1 engine metrics), and
# vLLM's older name for the KV usage gauge (its v0 dashboards read vllm:gpu_cache_usage_perc)
VLLM_NAMES = {f"voltllm:{n}": [f"vllm:{n}"] for n in (
    "num_requests_running", "num_requests_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
    "prompt_tokens", "generation_tokens", "request_success", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens")}
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


class _EngineCollector(Collector):
    def __init__(self, model: str, stats: Callable[[], SchedulerStats], alive: Callable[[], bool],
                 active: Callable[[], int]):
        self.model = model
        self.stats = stats
        self.alive = alive
        self.active = active

    def collect(self) -> Iterable[Any]:
        s = self.stats()
        lab = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric([self.model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=lab)
            c.add_metric([self.model], value)
            return c

        yield gauge("voltllm:num_requests_running", "Requests in the engine's running batch.", s.num_running)
        yield gauge("voltllm:num_requests_waiting", "Requests waiting to be scheduled (queue length).",
                    s.num_waiting)
        yield gauge("voltllm:num_requests_active", "Requests the API server is serving (incl. ones being detokenized).",
                    self.active())
        yield gauge("voltllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_cache_usage)
        yield gauge("voltllm:kv_cache_num_blocks", "KV-cache blocks in total.", s.num_blocks)
        yield counter("voltllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("voltllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield gauge("voltllm:prefix_cache_hit_rate", "Prefix-cache hits / queries since start (tokens).", rate)
        yield counter("voltllm:num_preemptions", "Requests preempted (blocks freed, recomputed later).",
                      s.num_preemptions)
        if "spec_draft_tokens" in s.extra:  # --speculative-config
            yield counter("voltllm:spec_decode_num_draft_tokens", "Draft tokens scored by speculative steps.",
                          s.extra["spec_draft_tokens"])
            yield counter("voltllm:spec_decode_num_accepted_tokens", "Draft tokens accepted (each one a decode "
                          "step saved).", s.extra["spec_accepted_tokens"])
        yield gauge("voltllm:engine_alive", "1 while the engine process is up.", 1.0 if self.alive() else 0.0)


class ServerMetrics:
    """Implements AsyncLLM's StatObserver; render() is the /metrics body."""

    def __init__(self, model: str, stats: Callable[[], SchedulerStats], alive: Callable[[], bool],
                 active: Callable[[], int]):
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        lab = ["model_name"]
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
        self.http = Counter("voltllm:http_requests", "HTTP requests by route and status.",
                            ["method", "path", "status"], registry=r)
        r.register(_EngineCollector(model, stats, alive, active))
        self.vllm_names = CollectorRegistry(auto_describe=True)
        self.vllm_names.register(_VLLMNames(r))
        # totals for the periodic log line
        self.total_generated = 0
        self.total_prompt = 0
        self.total_finished = 0

    # StatObserver
    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self.model).observe(ttft_s)
        self.generation_tokens.labels(self.model).inc(1)
        self.total_generated += 1

    def on_tokens(self, inter_token_s: float, count: int) -> None:
        h = self.itl.labels(self.model)
        for _ in range(count):
            h.observe(inter_token_s)
        self.generation_tokens.labels(self.model).inc(count)
        self.total_generated += count

    def on_finished(self, out: Optional[RequestOutput], reason: str, e2e_s: float) -> None:
        self.requests.labels(self.model, reason).inc()
        self.e2e.labels(self.model).observe(e2e_s)
        self.total_finished += 1
        if out is not None:
            self.prompt_tokens.labels(self.model).inc(len(out.prompt_token_ids))
            self.total_prompt += len(out.prompt_token_ids)

    def on_http(self, method: str, path: str, status: int) -> None:
        self.http.labels(method, path, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_names)
