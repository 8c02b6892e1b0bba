"""OpenTelemetry request spans (vLLM's --otlp-traces-endpoint; endpoint rule and checks: tracing_config.py).

Every finished request becomes one span named "llm_request" (kind SERVER), made where its final output is read: in the
API process (AsyncLLM's RequestStream, for every data-parallel engine) or in the offline LLM's process. Its parent is
the caller's trace when the HTTP request carried W3C `traceparent` / `tracestate` headers. It starts at the request's
arrival and ends at its finish; the request's timestamps are time.monotonic() (one clock for the API and engine
processes), turned into epoch nanoseconds with one offset taken when the tracer is made.

Attributes (vLLM's names): gen_ai.response.model, gen_ai.request.id, the sampling parameters gen_ai.request.n /
max_tokens / temperature / top_p (generation requests), gen_ai.usage.prompt_tokens / completion_tokens (summed over the
choices), and in seconds gen_ai.latency.time_in_queue (arrival to first scheduling), time_to_first_token (arrival to
the first token reaching the API process), e2e (arrival to finish) and, from the engine's timestamps,
time_in_model_prefill (first scheduling to first token), time_in_model_decode (first to last token) and
time_in_model_inference (first scheduling to last token); a phase the request never reached is left out.

Spans are exported by a BatchSpanProcessor's thread (every second, or sooner once 512 are waiting), so the event loop
only records them; shutdown() sends what is left (within 5 s) and stops the thread.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from voltllm.tracing_config import HTTP_PROTOCOL, OtlpTracesConfig

logger = logging.getLogger("voltllm")

SPAN_NAME = "llm_request"
TRACE_HEADERS = ("traceparent", "tracestate")  # the W3C Trace Context headers a span's parent is read from
SCHEDULE_DELAY_MS = 1000  # between exports (the SDK's default is 5 s: spans reach the collector sooner)
SHUTDOWN_TIMEOUT_S = 5.0  # what is left is sent within this at shutdown
EXPORT_TIMEOUT_S = 5.0  # one export, retries included


class Attr:
    """The span attributes' names (vLLM's, from OpenTelemetry's gen_ai semantic conventions)."""
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_ID = "gen_ai.request.id"
    TOP_P = "gen_ai.request.top_p"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    N = "gen_ai.request.n"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    PREFILL = "gen_ai.latency.time_in_model_prefill"
    DECODE = "gen_ai.latency.time_in_model_decode"
    INFERENCE = "gen_ai.latency.time_in_model_inference"


@dataclass(frozen=True)
class TracedRequest:
    """What a request's span tells besides its output: the caller's trace headers and, for a generation request, its
    sampling parameters (max_tokens: the effective one, what the context leaves when not given)."""
    trace_headers: Optional[Mapping[str, str]] = None
    n: Optional[int] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None


def traced_request(params: Any, prompt_len: int, max_model_len: int,
                   trace_headers: Optional[Mapping[str, str]] = None) -> TracedRequest:
    """params: the request's SamplingParams, or a pooling request's (no sampling parameters)."""
    if not hasattr(params, "temperature"):
        return TracedRequest(trace_headers)
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - prompt_len
    return TracedRequest(trace_headers, params.n, max_tokens, params.temperature, params.top_p)


_warned_untraced = threading.Event()


def trace_headers_of(headers: Optional[Mapping[str, str]], tracing: bool) -> Optional[dict[str, str]]:
    """The W3C trace headers of an HTTP request (None when it has none); with tracing off they are dropped, with a
    warning the first time (vLLM's)."""
    if headers is None:
        return None
    found = {name: headers[name] for name in TRACE_HEADERS if headers.get(name)}
    if not found:
        return None
    if not tracing:
        if not _warned_untraced.is_set():
            _warned_untraced.set()
            logger.warning("a request carries trace headers (%s), but tracing is off: start the server with "
                           "--otlp-traces-endpoint to send its spans", ", ".join(found))
        return None
    return found


class RequestTracer:
    """Makes each finished request's span and hands it to a BatchSpanProcessor over `exporter` (an OpenTelemetry
    SpanExporter)."""

    def __init__(self, model_name: str, exporter: Any, schedule_delay_ms: int = SCHEDULE_DELAY_MS):
        from opentelemetry.context import Context
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.model_name = model_name
        # (every setting given here, so that none comes from OTEL_* environment variables; no atexit hook: the owner
        # calls shutdown, as `voltllm serve` leaves with os._exit)
        processor = BatchSpanProcessor(exporter, max_queue_size=2048, schedule_delay_millis=schedule_delay_ms,
                                       max_export_batch_size=512, export_timeout_millis=30_000)
        self._provider = TracerProvider(resource=Resource({"service.name": "voltllm"}),
                                        sampler=ParentBased(ALWAYS_ON), shutdown_on_exit=False)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("voltllm")
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        self._root = Context()  # (no headers: a trace of its own, whatever context the caller runs in)
        self._epoch_ns = time.time_ns() - time.monotonic_ns()  # monotonic seconds -> epoch ns
        self._closed = False
        self._failed = False

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_ns

    def on_finished(self, out: Any, request: Optional[TracedRequest]) -> None:
        """Record the span of a finished RequestOutput / PoolingRequestOutput. Never raises: a tracing failure must
        not fail the request (it is logged once)."""
        if self._closed:
            return
        try:
            self._record(out, request or TracedRequest())
        except Exception:  # noqa: BLE001
            if not self._failed:
                self._failed = True
                logger.exception("could not record the span of request %s (later failures are not logged)",
                                 getattr(out, "request_id", "?"))

    def _record(self, out: Any, request: TracedRequest) -> None:
        m = out.metrics
        now = time.monotonic()
        arrival = m.arrival_time if m is not None else now
        finished = (m.finished_time if m is not None else None) or now
        choices = out.outputs if isinstance(out.outputs, list) else []  # (a pooling output has no choices)
        attrs: dict[str, Any] = {
            Attr.RESPONSE_MODEL: self.model_name, Attr.REQUEST_ID: out.request_id,
            Attr.PROMPT_TOKENS: len(out.prompt_token_ids or ()),
            Attr.COMPLETION_TOKENS: sum(len(c.token_ids) for c in choices),
            Attr.E2E: max(finished - arrival, 0.0)}
        for name, value in ((Attr.N, request.n), (Attr.MAX_TOKENS, request.max_tokens),
                            (Attr.TEMPERATURE, request.temperature), (Attr.TOP_P, request.top_p)):
            if value is not None:
                attrs[name] = value
        if m is not None:
            for name, start, end in ((Attr.TIME_IN_QUEUE, m.arrival_time, m.scheduled_time),
                                     (Attr.TIME_TO_FIRST_TOKEN, m.arrival_time, m.first_token_time),
                                     (Attr.PREFILL, m.scheduled_time, m.engine_first_token_time),
                                     (Attr.DECODE, m.engine_first_token_time, m.engine_last_token_time),
                                     (Attr.INFERENCE, m.scheduled_time, m.engine_last_token_time)):
                if start is not None and end is not None:
                    attrs[name] = max(end - start, 0.0)
        parent = (self._propagator.extract(dict(request.trace_headers), context=self._root) if request.trace_headers
                  else self._root)
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=self._kind, start_time=self._ns(arrival),
                                       attributes=attrs)
        span.end(end_time=self._ns(finished))

    def shutdown(self) -> None:
        """Send the spans still waiting and stop the export thread; idempotent. Waits at most SHUTDOWN_TIMEOUT_S (an
        unreachable collector would hold the SDK's shutdown for its own 30 s): what is still unsent then is dropped,
        with a warning, and the daemon threads end with the process."""
        if self._closed:
            return
        self._closed = True
        flush = threading.Thread(target=self._provider.shutdown, name="voltllm-trace-flush", daemon=True)
        flush.start()
        flush.join(SHUTDOWN_TIMEOUT_S)
        if flush.is_alive():
            logger.warning("tracing: the spans not sent within %.0f s at shutdown are dropped (is the collector "
                           "reachable?)", SHUTDOWN_TIMEOUT_S)


def make_exporter(config: OtlpTracesConfig) -> Any:
    """The OTLP span exporter config.protocol names, sending to config.target (packages checked at start:
    tracing_config.check_packages)."""
    if config.protocol == HTTP_PROTOCOL:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.target, timeout=EXPORT_TIMEOUT_S, compression=Compression.NoCompression)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
    from grpc import Compression as GrpcCompression

    return GrpcSpanExporter(endpoint=config.target, insecure=config.insecure, timeout=EXPORT_TIMEOUT_S,
                            compression=GrpcCompression.NoCompression)


def make_request_tracer(config: Optional[OtlpTracesConfig], model_name: str) -> Optional[RequestTracer]:
    """The tracer of an engine configured with --otlp-traces-endpoint (EngineConfig.otlp_traces); None when off."""
    if config is None:
        return None
    tracer = RequestTracer(model_name, make_exporter(config))
    logger.info("tracing: an llm_request span per finished request to %s (OTLP %s)", config.target,
                config.protocol)
    return tracer
