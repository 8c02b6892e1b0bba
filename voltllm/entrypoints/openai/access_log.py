"""--disable-access-log-for-endpoints (vLLM's): uvicorn's access-log lines of the listed paths are dropped (health
probes and metric scrapes every few seconds drown the other requests), every other line is kept."""
from __future__ import annotations

import logging


class EndpointFilter(logging.Filter):
    """Drops uvicorn access records whose path (without its query string, and without --root-path) is listed."""

    def __init__(self, paths: frozenset[str], root_path: str = ""):
        super().__init__()
        self.paths = paths
        self.root_path = root_path.rstrip("/")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3:  # (not an access line: keep it)
            return True
        path = str(args[2]).split("?", 1)[0]
        if self.root_path and path.startswith(self.root_path + "/"):
            path = path[len(self.root_path):]
        return path not in self.paths


def endpoint_paths(value: str) -> frozenset[str]:
    """"/health,/metrics" -> {"/health", "/metrics"} (blanks dropped)."""
    return frozenset(p.strip() for p in value.split(",") if p.strip())


def quiet_endpoints(value: str, root_path: str = "") -> EndpointFilter:
    """Install the filter on uvicorn's access logger (after uvicorn configured its logging)."""
    f = EndpointFilter(endpoint_paths(value), root_path)
    logging.getLogger("uvicorn.access").addFilter(f)
    return f
