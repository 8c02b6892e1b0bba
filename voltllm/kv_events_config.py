"""vLLM's `--kv-events-config` (`LLM(kv_events_config=...)`): KV cache events published over ZeroMQ.

The JSON object's keys and defaults are vLLM's KVEventsConfig's. Events are published only with
`enable_kv_cache_events` true and the `zmq` publisher (vLLM's newer default once events are on); otherwise the engine
collects nothing and opens no socket (`resolve_kv_events` returns None).

Endpoint rule (vLLM's): a PUB endpoint containing `*` or `::`, or an ipc:// / inproc:// one, is bound; any other
tcp:// endpoint is connected to (a collector that binds it receives the events). The replay endpoint is always bound.
Under data parallelism engine k publishes on its own endpoints: a tcp port + k, an ipc path / inproc name + `_dp{k}`
(engine 0 keeps the endpoint as given).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Optional

from voltllm.config import ConfigError, parse_json_object

KV_EVENTS_PUBLISHERS = ("null", "zmq")
_FLAG = "--kv-events-config"
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # "null" | "zmq"; None: "zmq" when events are enabled, else "null" (vLLM's)
    endpoint: str = "tcp://*:5557"  # the PUB socket's
    replay_endpoint: Optional[str] = None  # a ROUTER socket answering replay requests (None: none)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages queued per subscriber; 0: no limit)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread (more are dropped, with a warning)
    topic: str = ""  # the first frame of every message (subscribers filter on it)

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def resolve_kv_events(value: Any, data_parallel_size: int = 1) -> Optional[KVEventsConfig]:
    """--kv-events-config (JSON text, a dict or a KVEventsConfig) as the config the engine publishes with; None when
    events are off (not given, disabled, or the null publisher). ConfigError for anything that cannot run."""
    if value is None:
        return None
    if isinstance(value, KVEventsConfig):
        value = dataclasses.asdict(value)
    elif not isinstance(value, (str, dict)):
        raise ConfigError(f"{_FLAG} must be a JSON object, got {type(value).__name__}")
    value = parse_json_object(_FLAG, value)
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{_FLAG}: unknown keys {unknown} (its keys: {sorted(known)})")
    _check_types(value)
    config = KVEventsConfig(**value)
    if config.publisher is None:
        config = dataclasses.replace(config, publisher="zmq" if config.enable_kv_cache_events else "null")
    if config.publisher not in KV_EVENTS_PUBLISHERS:
        raise ConfigError(f"{_FLAG} publisher {config.publisher!r}: use \"zmq\" (or \"null\": no events)")
    if not config.publishes:
        return None
    for rank in range(max(1, data_parallel_size)):  # (every engine's endpoints must be valid)
        check_endpoint("endpoint", offset_endpoint(config.endpoint, rank))
        if config.replay_endpoint is not None:
            check_endpoint("replay_endpoint", offset_endpoint(config.replay_endpoint, rank))
    if config.replay_endpoint is not None and config.replay_endpoint == config.endpoint:
        raise ConfigError(f"{_FLAG}: replay_endpoint must differ from endpoint ({config.endpoint})")
    check_msgspec()
    return config


def _check_types(value: dict) -> None:
    if not isinstance(value.get("enable_kv_cache_events", False), bool):
        raise ConfigError(f"{_FLAG} enable_kv_cache_events must be true or false, got "
                          f"{value['enable_kv_cache_events']!r}")
    for name in ("publisher", "replay_endpoint"):
        if value.get(name) is not None and not isinstance(value[name], str):
            raise ConfigError(f"{_FLAG} {name} must be a string, got {value[name]!r}")
    for name in ("endpoint", "topic"):
        if name in value and not isinstance(value[name], str):
            raise ConfigError(f"{_FLAG} {name} must be a string, got {value[name]!r}")
    for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
        if name in value and (isinstance(value[name], bool) or not isinstance(value[name], int)
                              or value[name] < least):
            raise ConfigError(f"{_FLAG} {name} must be an integer >= {least}, got {value[name]!r}")


def check_endpoint(name: str, endpoint: str) -> None:
    """A ZeroMQ endpoint this publisher can open: tcp://HOST:PORT (HOST `*` for every interface, [v6] in brackets),
    ipc://PATH or inproc://NAME."""
    scheme = next((s for s in _SCHEMES if endpoint.startswith(s)), None)
    rest = endpoint[len(scheme):] if scheme else ""
    if scheme is None or not rest:
        raise ConfigError(f"{_FLAG} {name} {endpoint!r}: not a ZeroMQ endpoint; use tcp://HOST:PORT (e.g. "
                          "tcp://*:5557), ipc://PATH or inproc://NAME")
    if scheme == "tcp://":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{_FLAG} {name} {endpoint!r}: a tcp endpoint needs a host (or *) and a port in "
                              "1..65535, e.g. tcp://*:5557")


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard / IPv6-any address or a local transport, connect to any other tcp address."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Data-parallel engine k's endpoint: the tcp port + k, or the ipc path / inproc name + "_dp{k}"."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, colon, port = endpoint.rpartition(":")
        if colon and port.isdigit():
            return f"{base}:{int(port) + data_parallel_rank}"
        return endpoint  # (check_endpoint refuses it)
    return f"{endpoint}_dp{data_parallel_rank}"


def check_msgspec() -> None:
    """The events are msgspec structs (vLLM's wire format); refused at start, saying what to install, without it."""
    try:
        import msgspec  # noqa: F401
    except ImportError:
        raise ConfigError(f"{_FLAG} needs the msgspec package (the events' msgpack encoding): pip install msgspec"
                          ) from None
