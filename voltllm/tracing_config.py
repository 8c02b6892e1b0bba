"""vLLM's `--otlp-traces-endpoint` (`LLM(otlp_traces_endpoint=...)`): where OpenTelemetry request spans are sent.

The exporter follows from the endpoint alone (voltllm reads no environment variable to choose it; vLLM reads
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL):
- an http:// or https:// URL whose path ends in /v1/traces (OTLP/HTTP's standard path) is sent to as it is, by the
  OTLP/HTTP (protobuf) exporter;
- anything else is an OTLP/gRPC collector: HOST:PORT or grpc://HOST:PORT (plaintext, as a collector's 4317 receiver
  listens by default), http://HOST:PORT (plaintext) or https://HOST:PORT (TLS), with no path.

The OpenTelemetry packages are optional: the endpoint is refused at start, with the pip command to run, when the SDK or
the exporter it needs is missing.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

from voltllm.config import ConfigError

_FLAG = "--otlp-traces-endpoint"
HTTP_PROTOCOL = "http/protobuf"
GRPC_PROTOCOL = "grpc"
OTLP_HTTP_PATH = "/v1/traces"
_EXAMPLES = ("http://HOST:4318/v1/traces (OTLP/HTTP), or HOST:4317, grpc://HOST:4317, http(s)://HOST:4317 "
             "(OTLP/gRPC)")
# (module, pip package) of what each protocol imports
_SDK = ("opentelemetry.sdk.trace", "opentelemetry-sdk")
_EXPORTERS = {HTTP_PROTOCOL: ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                              "opentelemetry-exporter-otlp-proto-http"),
              GRPC_PROTOCOL: ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                              "opentelemetry-exporter-otlp-proto-grpc")}


@dataclass(frozen=True)
class OtlpTracesConfig:
    endpoint: str  # as given
    protocol: str  # HTTP_PROTOCOL | GRPC_PROTOCOL
    target: str  # what the exporter is given: the URL (OTLP/HTTP) or HOST:PORT (OTLP/gRPC)
    insecure: bool = False  # OTLP/gRPC: plaintext (False: TLS)


def resolve_otlp_traces(endpoint: Optional[str]) -> Optional[OtlpTracesConfig]:
    """--otlp-traces-endpoint as the exporter's settings (None: tracing off). ConfigError for an endpoint that names no
    collector, or when the packages its exporter needs are not installed."""
    if endpoint is None:
        return None
    config = parse_endpoint(endpoint)
    check_packages(config.protocol)
    return config


def parse_endpoint(endpoint: object) -> OtlpTracesConfig:
    """The exporter an endpoint selects (the rule in this module's docstring); ConfigError for a malformed one."""
    if not isinstance(endpoint, str):
        raise ConfigError(f"{_FLAG} must be a string, got {type(endpoint).__name__}")
    given = endpoint.strip()
    if not given:
        raise ConfigError(f"{_FLAG} must not be empty: give {_EXAMPLES}")
    if "://" not in given:
        return OtlpTracesConfig(endpoint, GRPC_PROTOCOL, _host_port(given, endpoint), insecure=True)
    try:
        url = urlsplit(given)
        url.port  # (raises for a port that is not a number in 0..65535)
    except ValueError as e:
        raise ConfigError(f"{_FLAG} {endpoint!r}: {e}") from None
    if url.scheme not in ("http", "https", "grpc"):
        raise ConfigError(f"{_FLAG} {endpoint!r}: unknown scheme {url.scheme!r}; give {_EXAMPLES}")
    if not url.hostname:
        raise ConfigError(f"{_FLAG} {endpoint!r}: no host; give {_EXAMPLES}")
    if url.query or url.fragment:
        raise ConfigError(f"{_FLAG} {endpoint!r}: a query or fragment is not taken; give {_EXAMPLES}")
    path = url.path.rstrip("/")
    if url.scheme in ("http", "https") and path.endswith(OTLP_HTTP_PATH):
        return OtlpTracesConfig(endpoint, HTTP_PROTOCOL, given)
    if path:
        raise ConfigError(f"{_FLAG} {endpoint!r}: an OTLP/gRPC endpoint has no path, and an OTLP/HTTP URL's path "
                          f"ends in {OTLP_HTTP_PATH} (e.g. http://HOST:4318/v1/traces)")
    return OtlpTracesConfig(endpoint, GRPC_PROTOCOL, _host_port(url.netloc, endpoint),
                            insecure=url.scheme != "https")


def _host_port(netloc: str, endpoint: str) -> str:
    """HOST:PORT of an OTLP/gRPC collector ([v6]:PORT for IPv6); a port is required (gRPC has no default one)."""
    host, colon, port = netloc.rpartition(":")
    if "@" in host:
        raise ConfigError(f"{_FLAG} {endpoint!r}: credentials in the endpoint are not taken")
    if not colon or not host or host in ("[", "[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{_FLAG} {endpoint!r}: an OTLP/gRPC endpoint needs a host and a port in 1..65535 (the "
                          f"collector's, 4317 by default); give {_EXAMPLES}")
    return netloc


def check_packages(protocol: str) -> None:
    """The OpenTelemetry SDK and the protocol's exporter import; else a ConfigError with the pip command."""
    missing = []
    for module, package in (_SDK, _EXPORTERS[protocol]):
        try:
            importlib.import_module(module)
        except ImportError as e:
            missing.append((package, e))
    if missing:
        packages = " ".join(p for p, _ in missing)
        why = "; ".join(f"{p}: {e}" for p, e in missing)
        raise ConfigError(f"{_FLAG} ({protocol} exporter) needs {packages}: pip install {packages} ({why})")
