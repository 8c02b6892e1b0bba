"""A RequestSource's requests (bench/workloads.py) in process with at most C in flight: the prefix-cache scenarios,
and the concurrency scenario given --num-prompts.

A request is added when a slot frees (the moment its predecessor's last token returns; a request with an arrival time,
--request-rate with --num-prompts, not before that time) and stamped with that time, so TTFT counts from it; a
multi-turn conversation's next turn is built from the answer's token ids as soon as it ends.
Cache hits are the engine's own per-request count (num_cached_tokens: GPU-pool and CPU-tier blocks together); the CPU
tier's share is the engine's external_prefix_cache_hits counter over the run (vLLM's KV-connector counter, counted
by the lookup that admits each request).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from voltllm.bench.metrics import RequestTiming, RunResult, spec_counts, spec_delta
from voltllm.bench.workloads import BenchRequest, RequestSource

if TYPE_CHECKING:
    from voltllm.bench.inprocess import InProcessRunner, Plan


@dataclass
class _Live:
    req: BenchRequest
    arrival: float
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    first: Optional[float] = None
    last: Optional[float] = None
    scheduled: Optional[float] = None
    cached: int = 0


def _external_hits(engine: Any) -> Optional[int]:
    return engine.stats().extra.get("external_prefix_cache_hits")


def run_source_inprocess(runner: InProcessRunner, plan: Plan, run: str, source: RequestSource) -> RunResult:
    from voltllm.bench.inprocess import sampling_params
    from voltllm.engine.types import EngineCoreRequest

    eng = runner.engine
    runner.drain()
    runner._batch += 1
    stats0 = eng.stats()
    preempt0, ext0 = stats0.num_preemptions, stats0.extra.get("external_prefix_cache_hits")
    spec0 = spec_counts(stats0)
    mark = runner.compile_log.mark() if runner.compile_log is not None else 0
    live: dict[str, _Live] = {}
    done: list[RequestTiming] = []
    t0 = end = time.monotonic()

    pending: list[BenchRequest] = []  # the next request, taken from the source before its arrival time

    def fill() -> None:
        while len(live) < plan.concurrency:
            req = pending.pop() if pending else source.next()
            if req is None:
                return
            if req.not_before is not None and time.monotonic() - t0 < req.not_before:
                pending.append(req)
                return
            rid = f"bench{runner._batch}-{req.index}"
            sp = sampling_params(req.output_len, runner.temperature, runner.top_p, runner.top_k,
                                 runner.sampling_seed + req.seed)
            now = time.monotonic()
            eng.add_request(EngineCoreRequest(rid, list(req.prompt), sp, arrival_time=now))
            live[rid] = _Live(req, now)

    fill()
    while live or pending:
        if not live:  # (the next request's arrival time has not come: nothing to step until it does)
            time.sleep(max(0.0, t0 + pending[0].not_before - time.monotonic()))
            fill()
            continue
        outs = eng.step()
        now = time.monotonic()  # the step returned: its tokens exist now
        for o in outs:
            t = live.get(o.request_id)
            if t is None:
                continue
            if o.new_token_ids:
                t.ids.extend(o.new_token_ids)
                t.times.extend([now] * len(o.new_token_ids))
                end = now
            t.first = o.first_token_time if t.first is None else t.first
            t.last = o.last_token_time if o.last_token_time is not None else t.last
            t.scheduled = o.scheduled_time if t.scheduled is None else t.scheduled
            t.cached = max(t.cached, o.num_cached_tokens)
            if o.finished:
                del live[o.request_id]
                done.append(_finish(o.request_id, t, o.finish_reason, o.stop_reason))
                source.done(t.req, t.ids)
        fill()
        if live and not outs and not eng.has_unfinished_requests():
            raise RuntimeError(f"the engine went idle with {len(live)} bench requests unfinished")
    if not source.exhausted:
        raise RuntimeError(f"{source.total - source.handed_out} bench requests were never ready to send")
    ext1 = _external_hits(eng)
    done.sort(key=lambda r: r.index)
    stats = eng.stats()
    return RunResult(plan.scenario, plan.concurrency, run, plan.input_len, plan.output_len, t0, end, done,
                     preemptions=stats.num_preemptions - preempt0, side="server", range_ratio=plan.range_ratio,
                     request_rate=plan.request_rate,
                     spec=spec_delta(spec0, spec_counts(stats)),
                     compiles=runner.compile_log.since(mark) if runner.compile_log is not None else None,
                     workload=plan.workload(),
                     external_cache_hit_tokens=ext1 - ext0 if ext0 is not None and ext1 is not None else None)


def _finish(rid: str, t: _Live, finish: Optional[str], stop_reason: Any) -> RequestTiming:
    if finish == "abort" or len(t.ids) != t.req.output_len:
        raise RuntimeError(f"request {rid} ended with {len(t.ids)} of {t.req.output_len} forced tokens (finish "
                           f"{finish}, {stop_reason}); raise the KV cache or --max-model-len")
    return RequestTiming(prompt_tokens=len(t.req.prompt), output_tokens=len(t.ids), arrival=t.arrival,
                         first_token=t.first if t.first is not None else t.times[0],
                         last_token=t.last if t.last is not None else t.times[-1], scheduled=t.scheduled,
                         cached_tokens=t.cached, token_times=t.times, index=t.req.index, group=t.req.group,
                         turn=t.req.turn)
