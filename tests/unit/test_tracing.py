"""--otlp-traces-endpoint (voltllm/tracing.py, voltllm/tracing_config.py): spans built from request outputs into an
in-memory exporter, the endpoint's exporter rule, the refusals, trace headers from HTTP requests to the engine's
streams (one engine and data-parallel ones). The server's spans at a collector: tests/server/test_server_flags.py."""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="needs opentelemetry-sdk (the test extra)")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from voltllm import tracing  # noqa: E402
from voltllm.config import ConfigError, EngineArgs  # noqa: E402
from voltllm.engine.outputs import CompletionOutput, PoolingRequestOutput, RequestMetrics, RequestOutput  # noqa: E402
from voltllm.sampling.params import SamplingParams  # noqa: E402
from voltllm.tracing import RequestTracer, TracedRequest, trace_headers_of, traced_request  # noqa: E402
from voltllm.tracing_config import GRPC_PROTOCOL, HTTP_PROTOCOL, parse_endpoint, resolve_otlp_traces  # noqa: E402

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _output(now: float, **metrics) -> RequestOutput:
    times = dict(first_token_time=now - 0.5, last_token_time=now - 0.1, finished_time=now, scheduled_time=now - 0.875,
                 engine_first_token_time=now - 0.625, engine_last_token_time=now - 0.25)
    times.update(metrics)
    choices = [CompletionOutput(index=0, text="ab", token_ids=[4, 5], cumulative_logprob=None, logprobs=None,
                                finish_reason="stop"),
               CompletionOutput(index=1, text="c", token_ids=[6], cumulative_logprob=None, logprobs=None,
                                finish_reason="length")]
    return RequestOutput("chatcmpl-1", "p", [1, 2, 3], choices, True, metrics=RequestMetrics(now - 1.0, **times))


def _spans(record) -> list:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer("tiny", exporter, schedule_delay_ms=60_000)  # (sent by shutdown's flush)
    record(tracer)
    tracer.shutdown()
    return list(exporter.get_finished_spans())


def test_span_of_a_finished_request():
    now = time.monotonic()
    wall_before = time.time_ns()
    out = _output(now)
    (span,) = _spans(lambda t: t.on_finished(out, TracedRequest({"traceparent": TRACEPARENT, "tracestate": "k=v"},
                                                                 2, 16, 0.0, 0.9)))
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    assert dict(span.attributes) == pytest.approx({
        "gen_ai.response.model": "tiny", "gen_ai.request.id": "chatcmpl-1", "gen_ai.request.n": 2,
        "gen_ai.request.max_tokens": 16, "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 0.9,
        "gen_ai.usage.prompt_tokens": 3, "gen_ai.usage.completion_tokens": 3,  # (both choices)
        "gen_ai.latency.e2e": 1.0, "gen_ai.latency.time_in_queue": 0.125, "gen_ai.latency.time_to_first_token": 0.5,
        "gen_ai.latency.time_in_model_prefill": 0.25, "gen_ai.latency.time_in_model_decode": 0.375,
        "gen_ai.latency.time_in_model_inference": 0.625}, abs=1e-6)
    # arrival to finish, on the wall clock: the request arrived a second before `now`
    assert (span.end_time - span.start_time) == pytest.approx(1e9, abs=1e3)
    assert abs(span.end_time - wall_before) < 50e6
    # the caller's trace: its id, the caller's span as parent, its trace state
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID and span.parent.is_remote
    assert span.context.trace_state.get("k") == "v"
    assert span.resource.attributes["service.name"] == "voltllm"


def test_span_without_headers_is_a_trace_of_its_own():
    now = time.monotonic()
    spans = _spans(lambda t: (t.on_finished(_output(now), TracedRequest()), t.on_finished(_output(now), None)))
    assert [s.parent for s in spans] == [None, None]
    assert spans[0].context.trace_id != spans[1].context.trace_id
    assert "gen_ai.request.n" not in spans[0].attributes


def test_phases_not_reached_are_left_out():
    """A request aborted in the engine before it was scheduled: no queue or model times, no first token."""
    now = time.monotonic()
    out = _output(now, first_token_time=None, scheduled_time=None, engine_first_token_time=None,
                  engine_last_token_time=None)
    (span,) = _spans(lambda t: t.on_finished(out, TracedRequest()))
    assert sorted(k for k in span.attributes if k.startswith("gen_ai.latency")) == ["gen_ai.latency.e2e"]


def test_pooling_request_span():
    now = time.monotonic()
    metrics = RequestMetrics(now - 0.5, finished_time=now)
    out = PoolingRequestOutput("embd-1", None, [1, 2, 3, 4], True, None, 0, metrics)
    (span,) = _spans(lambda t: t.on_finished(out, traced_request(None, 4, 64)))
    assert span.attributes["gen_ai.usage.prompt_tokens"] == 4 and span.attributes["gen_ai.usage.completion_tokens"] == 0
    assert not any(k.startswith("gen_ai.request.") and k != "gen_ai.request.id" for k in span.attributes)


def test_traced_request_takes_the_effective_max_tokens():
    headers = {"traceparent": TRACEPARENT}
    assert traced_request(SamplingParams(n=3, max_tokens=None, temperature=0.5, top_p=0.8), 10, 64, headers) == \
        TracedRequest(headers, 3, 54, 0.5, 0.8)
    assert traced_request(SamplingParams(max_tokens=7), 10, 64).max_tokens == 7


def test_a_tracing_failure_never_fails_the_request(caplog):
    bad = SimpleNamespace(request_id="r", metrics=None, outputs=None, prompt_token_ids=object())  # (no len)
    with caplog.at_level(logging.ERROR, logger="voltllm"):
        spans = _spans(lambda t: (t.on_finished(bad, None), t.on_finished(bad, None)))
    assert spans == [] and caplog.text.count("could not record the span of request r") == 1


def test_shutdown_sends_what_waits_and_stops():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer("tiny", exporter, schedule_delay_ms=60_000)
    tracer.on_finished(_output(time.monotonic()), None)
    assert exporter.get_finished_spans() == ()  # (waiting for the next export)
    threads = {t.name for t in __import__("threading").enumerate()}
    assert any(name.startswith("OtelBatch") for name in threads)
    tracer.shutdown()
    assert len(exporter.get_finished_spans()) == 1
    tracer.on_finished(_output(time.monotonic()), None)  # after shutdown: ignored
    tracer.shutdown()  # idempotent
    assert len(exporter.get_finished_spans()) == 1


def test_trace_headers_of_an_http_request(monkeypatch, caplog):
    from starlette.datastructures import Headers

    monkeypatch.setattr(tracing, "_warned_untraced", __import__("threading").Event())
    headers = Headers({"TraceParent": TRACEPARENT, "tracestate": "k=v", "x-other": "1"})
    assert trace_headers_of(headers, True) == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    assert trace_headers_of(Headers({"x-other": "1"}), True) is None and trace_headers_of(None, True) is None
    with caplog.at_level(logging.WARNING, logger="voltllm"):
        assert trace_headers_of(headers, False) is None
        assert trace_headers_of(headers, False) is None
    assert caplog.text.count("carries trace headers (traceparent, tracestate), but tracing is off") == 1


@pytest.mark.parametrize("endpoint,protocol,target,insecure", [
    ("http://collector:4318/v1/traces", HTTP_PROTOCOL, "http://collector:4318/v1/traces", False),
    ("https://otel.example.com/api/v1/traces/", HTTP_PROTOCOL, "https://otel.example.com/api/v1/traces/", False),
    ("localhost:4317", GRPC_PROTOCOL, "localhost:4317", True),
    ("grpc://collector:4317", GRPC_PROTOCOL, "collector:4317", True),
    ("http://collector:4317", GRPC_PROTOCOL, "collector:4317", True),
    ("https://collector:4317/", GRPC_PROTOCOL, "collector:4317", False),
    ("[::1]:4317", GRPC_PROTOCOL, "[::1]:4317", True),
])
def test_the_endpoint_picks_the_exporter(endpoint, protocol, target, insecure):
    config = parse_endpoint(endpoint)
    assert (config.protocol, config.target, config.insecure) == (protocol, target, insecure)


@pytest.mark.parametrize("endpoint,message", [
    ("", "must not be empty"),
    ("collector", "needs a host and a port"),
    ("collector:99999", "needs a host and a port"),
    ("grpc://collector", "needs a host and a port"),
    ("http://collector:4318/v1/logs", "an OTLP/gRPC endpoint has no path"),
    ("grpc://collector:4317/v1/traces", "an OTLP/gRPC endpoint has no path"),
    ("ftp://collector:21/v1/traces", "unknown scheme 'ftp'"),
    ("http:///v1/traces", "no host"),
    ("http://collector:4318/v1/traces?x=1", "a query or fragment is not taken"),
    ("http://collector:port/v1/traces", "--otlp-traces-endpoint 'http://collector:port/v1/traces'"),
    (4317, "must be a string"),
])
def test_bad_endpoints_are_refused(endpoint, message):
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint") as e:
        parse_endpoint(endpoint)
    assert message in str(e.value)


def test_the_http_exporter_sends_to_the_url():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = tracing.make_exporter(resolve_otlp_traces("http://127.0.0.1:9/v1/traces"))
    try:
        assert isinstance(exporter, OTLPSpanExporter) and exporter._endpoint == "http://127.0.0.1:9/v1/traces"
    finally:
        exporter.shutdown()


def test_the_grpc_exporter_gets_host_and_port():
    grpc_exporter = pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
    exporter = tracing.make_exporter(resolve_otlp_traces("grpc://127.0.0.1:9"))
    try:
        assert isinstance(exporter, grpc_exporter.OTLPSpanExporter) and exporter._endpoint == "127.0.0.1:9"
        assert exporter._insecure
    finally:
        exporter.shutdown()


def test_missing_packages_are_refused_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(ConfigError, match=r"--otlp-traces-endpoint \(http/protobuf exporter\) needs "
                                          r"opentelemetry-exporter-otlp-proto-http: pip install "
                                          r"opentelemetry-exporter-otlp-proto-http \("):
        resolve_otlp_traces("http://127.0.0.1:4318/v1/traces")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(ConfigError, match="pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc"):
        resolve_otlp_traces("127.0.0.1:4317")


def test_the_flag_is_checked_before_the_model_loads(capsys, tmp_path):
    from voltllm.cli import main

    logging.getLogger("voltllm").handlers.clear()
    assert main(["serve", "/nonexistent", "--otlp-traces-endpoint", "collector"]) == 2
    assert "voltllm: error: --otlp-traces-endpoint 'collector': an OTLP/gRPC endpoint needs" in capsys.readouterr().err
    assert main(["serve", "/nonexistent", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]) == 2
    assert "model '/nonexistent' not found" in capsys.readouterr().err  # (accepted; the model is looked for next)
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint 'grpc://x/y'"):
        EngineArgs(model=str(tmp_path / "not-read"), otlp_traces_endpoint="grpc://x/y").create_engine_config()


def test_detailed_traces_stay_refused(capsys):
    from voltllm.cli import main
    from voltllm.cli_unbuilt import UNBUILT_FLAGS

    assert "--otlp-traces-endpoint" not in UNBUILT_FLAGS
    logging.getLogger("voltllm").handlers.clear()
    assert main(["serve", "/nonexistent", "--collect-detailed-traces", "all"]) == 2
    assert "--collect-detailed-traces: per-request model forward / execute times are not measured" in \
        capsys.readouterr().err


class _Engine(SimpleNamespace):
    """What a RequestStream reads of its AsyncLLM."""


def test_a_stream_records_its_span_when_its_final_output_is_read():
    from voltllm.engine.async_llm import RequestStream

    recorded = []
    tracer = SimpleNamespace(on_finished=lambda out, request: recorded.append((out, request)))
    engine = _Engine(observer=None, _streams={}, tracer=tracer, abort=lambda rid: None)
    stream = RequestStream(engine, "chatcmpl-1")
    stream.traced = TracedRequest({"traceparent": TRACEPARENT}, 1, 4, 1.0, 1.0)
    engine._streams["chatcmpl-1"] = stream
    now = time.monotonic()
    partial = _output(now)
    partial.finished = False

    async def read(out):
        stream._put(lambda: out)
        return await stream.__anext__()

    asyncio.run(read(partial))
    assert recorded == []  # (not finished yet)
    final = _output(now)
    asyncio.run(read(final))
    assert recorded == [(final, stream.traced)]


def test_data_parallel_engines_share_the_tracer_and_get_the_headers(tmp_path):
    from tiny_models import make_model
    from voltllm.engine.data_parallel import DataParallelLLM

    config = EngineArgs(model=make_model(str(tmp_path / "tiny"), "llama"), device="cpu",
                        data_parallel_size=2).create_engine_config()
    dp = DataParallelLLM(config)
    tracer = object()
    dp.tracer = tracer
    assert dp.tracer is tracer and [e.tracer for e in dp.engines] == [tracer, tracer]
    sent = []
    for e in dp.engines:
        e.add_request = lambda *a, _k=e.engine_index, **kw: sent.append((_k, kw.get("trace_headers")))
        e.add_pooling_request = lambda *a, _k=e.engine_index: sent.append((_k, a[-1]))
    headers = {"traceparent": TRACEPARENT}
    dp.add_request("a", "prompt", SamplingParams(), trace_headers=headers)
    dp.add_pooling_request("b", "other prompt", None, trace_headers=headers)
    assert [h for _, h in sent] == [headers, headers]


def test_offline_llm_traces_its_requests(tmp_path, monkeypatch):
    """LLM(otlp_traces_endpoint=...): the same spans from the offline engine (the exporter swapped for an in-memory
    one)."""
    from tiny_models import make_model
    from voltllm import LLM

    exporter = InMemorySpanExporter()
    monkeypatch.setattr(tracing, "make_exporter", lambda config: exporter)
    llm = LLM(make_model(str(tmp_path / "tiny"), "llama"), device="cpu", served_model_name="tiny",
              otlp_traces_endpoint="http://127.0.0.1:9/v1/traces")
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0, n=2), use_tqdm=False)
    llm._tracer.shutdown()
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.attributes["gen_ai.request.id"])
    assert [s.attributes["gen_ai.request.id"] for s in spans] == [o.request_id for o in outs]
    for span, out in zip(spans, outs):
        assert span.attributes["gen_ai.usage.prompt_tokens"] == len(out.prompt_token_ids)
        assert span.attributes["gen_ai.usage.completion_tokens"] == sum(len(c.token_ids) for c in out.outputs)
        assert (span.attributes["gen_ai.request.n"], span.attributes["gen_ai.request.max_tokens"]) == (2, 3)
        assert span.attributes["gen_ai.response.model"] == "tiny" and span.parent is None
