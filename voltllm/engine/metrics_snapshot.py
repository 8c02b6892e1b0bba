"""LLM.get_metrics(): the offline engine's counters and gauges as vLLM's metrics reader types them (Counter,
Gauge, Vector), so scripts written for vLLM's `llm.get_metrics()` (its speculative-decoding example reads the
drafts, accepted tokens and per-position acceptance this way) run unchanged. Each metric comes under voltllm's name
and again under vLLM's (`vllm:` prefix), as GET /metrics writes them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from voltllm.engine.types import SchedulerStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    """Counters side by side, by position (vLLM's form of spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int] = field(default_factory=list)


AnyMetric = Union[Counter, Gauge, Vector]


def metrics_snapshot(stats: SchedulerStats, engine: str = "0") -> list[AnyMetric]:
    """The engine's state now: requests running / waiting, KV-cache use, prefix-cache lookups, preemptions and, with
    speculative decoding, drafts, draft tokens, accepted tokens and accepted tokens per draft position."""
    labels = {"engine": engine}
    out: list[AnyMetric] = [
        Gauge("num_requests_running", dict(labels), stats.num_running),
        Gauge("num_requests_waiting", dict(labels), stats.num_waiting),
        Gauge("kv_cache_usage_perc", dict(labels), stats.kv_cache_usage),
        Counter("prefix_cache_queries", dict(labels), stats.prefix_cache_queries),
        Counter("prefix_cache_hits", dict(labels), stats.prefix_cache_hits),
        Counter("num_preemptions", dict(labels), stats.num_preemptions),
    ]
    extra = stats.extra
    if "spec_draft_tokens" in extra:
        out += [Counter("spec_decode_num_drafts", dict(labels), extra.get("spec_drafts", 0)),
                Counter("spec_decode_num_draft_tokens", dict(labels), extra["spec_draft_tokens"]),
                Counter("spec_decode_num_accepted_tokens", dict(labels), extra["spec_accepted_tokens"]),
                Vector("spec_decode_num_accepted_tokens_per_pos", dict(labels),
                       list(extra.get("spec_accepted_per_pos", ())))]
    named = []
    for m in out:
        for prefix in ("voltllm:", "vllm:"):
            copy = type(m)(**{**m.__dict__, "name": prefix + m.name, "labels": dict(m.labels)})
            named.append(copy)
    return named
