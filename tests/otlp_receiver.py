"""A minimal OTLP/HTTP trace receiver for the tests: a thread serving POST /v1/traces on 127.0.0.1, keeping each
decoded ExportTraceServiceRequest's spans."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


def otlp_http_available() -> bool:
    """The SDK and the OTLP/HTTP exporter (with opentelemetry-proto, which decodes here) are installed."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


class OtlpReceiver:
    """Start with start(); `endpoint` is the URL to export to; spans() the spans received so far (protobuf Span
    messages, with their resource's attributes under `.resource`)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        received: list[Any] = []
        self._received = received
        self._lock = threading.Lock()
        lock = self._lock

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with lock:
                    received.append(request)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")  # (an empty ExportTraceServiceResponse)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def start(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def spans(self) -> list[Any]:
        with self._lock:
            requests = list(self._received)
        out = []
        for request in requests:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        out.append((resource_spans.resource, span))
        return out

    def wait_for(self, found: Callable[[Any], bool], timeout: float = 10.0) -> list[Any]:
        """The received (resource, span) pairs that `found` accepts, once there is one (polls up to `timeout` s)."""
        deadline = time.monotonic() + timeout
        while True:
            hits = [(r, s) for r, s in self.spans() if found(s)]
            if hits or time.monotonic() > deadline:
                return hits
            time.sleep(0.1)


def attributes(span: Any) -> dict[str, Any]:
    """A protobuf span's (or resource's) attributes as a dict of Python values."""
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out
