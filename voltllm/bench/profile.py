"""`voltllm bench --profile`: where a decode step's time goes, per GPU kernel.

After the measured runs (so the metrics are those of an unprofiled engine), for each decode / concurrency
configuration C fresh requests (the configuration's prompt length and sampling) are started and decoded to the
middle of their output, twice:
  1. for every configuration first, before any profiler has run in the process: `--profile-steps` engine steps
     unprofiled, wall time per step (synchronized at both ends) and where the host's share of it goes
     (HostPhaseTimer: scheduling, input preparation, launching, waiting for the GPU, reading the results back,
     updating the requests). Once a torch.profiler session has run, every later CUDA call costs the host more, so
     these figures are taken before the first one;
  2. then per configuration, the prompt phase and as many decode steps under torch.profiler (CUDA activity): every
     kernel / memcpy / memset the GPU ran, and the host's launch calls.
The requests are then aborted. Per configuration: kernels grouped by name (calls per step, us per step,
share of the summed kernel time), GPU busy time per step (union of the GPU activity intervals), and the
wall time per step with and without the profiler. With programmatic dependent launch a kernel starts while its
predecessor runs and waits for it (kernels/pdl.py), so its recorded duration includes that wait; each kernel's
exclusive time (the part of its interval no earlier-started activity covers; the exclusive times sum to the busy
time) says where the step's time goes, and the table is ordered by it. busy / unprofiled wall well below 1 means the GPU
waits for the host (launch or scheduling gaps), not for memory.
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import re
import statistics
import tempfile
import time
from typing import Any, Optional, Sequence

import torch

from voltllm.bench.inprocess import Plan, make_workload, prompt_seed, sampling_params

logger = logging.getLogger("voltllm.bench")

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")
_NAMESPACES = re.compile(r"\(anonymous namespace\)::|\b(?:at::native::|at::cuda::|std::|c10::|cutlass::|cute::)")


def shorten(name: str, width: int = 80) -> str:
    """A kernel name for a table: no 'void ', no parameter list, common namespaces dropped, cut to width."""
    n = name.strip()
    if n.startswith("void ") and n.endswith(")"):  # a demangled C++ kernel: drop "void " and "(parameters)"
        n = n[5:]
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(n[i], 0)
            if depth == 0:
                n = n[:i] if i > 0 else n
                break
    n = _NAMESPACES.sub("", n).strip()
    wrapped = re.fullmatch(r"(?:Kernel2?|device_kernel)<(.+)>", n)  # cutlass wrappers: the instance says more
    n = wrapped.group(1).strip() if wrapped else n
    return n if len(n) <= width else n[:width - 3] + "..."


def gpu_events(trace: dict) -> list[dict]:
    """GPU activity records (name, cat, ts, dur in us) of a chrome trace written by torch.profiler."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in GPU_CATEGORIES and "dur" in ev:
            out.append({"name": ev.get("name", "?"), "cat": ev["cat"], "ts": float(ev["ts"]), "dur": float(ev["dur"])})
    return out


def launch_counts(trace: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in ("cuda_runtime", "cuda_driver") and ev.get("name") in LAUNCH_CALLS:
            counts[ev["name"]] = counts.get(ev["name"], 0) + 1
    return counts


def busy_us(events: Sequence[dict]) -> float:
    """Length of the union of the events' [ts, ts + dur] intervals (overlapping streams count once)."""
    total, end = 0.0, None
    for ev in sorted(events, key=lambda e: e["ts"]):
        s, e = ev["ts"], ev["ts"] + ev["dur"]
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def idle_gaps(events: Sequence[dict], top: int = 5) -> tuple[float, list[dict]]:
    """(total us of idle time between the first and last GPU activity, the `top` longest such gaps): each gap with
    the activity that ended last before it and the one that starts it. Idle time outside that span (host work
    before the first launch, after the last) is wall - busy - this total."""
    total, gaps, end, last = 0.0, [], None, None
    for ev in sorted(events, key=lambda e: e["ts"]):
        e = ev["ts"] + ev["dur"]
        if end is not None and ev["ts"] > end:
            total += ev["ts"] - end
            gaps.append({"us": ev["ts"] - end, "after": shorten(last["name"], 48), "before": shorten(ev["name"], 48)})
        if end is None or e > end:
            end, last = e, ev
    return total, sorted(gaps, key=lambda g: -g["us"])[:top]


def blocking_calls(trace: dict) -> dict[str, dict]:
    """Host calls that wait for the GPU (synchronize, blocking copies): name -> {calls, us}. A forward that
    waits mid-way shows here as time the GPU may idle while the host launches what follows."""
    out: dict[str, dict] = {}
    for ev in trace.get("traceEvents", []):
        name = ev.get("name", "")
        if (ev.get("ph") == "X" and ev.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in ev
                and ("Synchronize" in name or name in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2"))):
            r = out.setdefault(name, {"calls": 0, "us": 0.0})
            r["calls"] += 1
            r["us"] += float(ev["dur"])
    return out


def exclusive_us(events: Sequence[dict]) -> list[float]:
    """Per event (in the given order): the part of [ts, ts + dur] not covered by events that started earlier
    (ties: the longer one first). A PDL kernel's wait for its predecessor is covered by the predecessor, so it
    counts there; the values sum to busy_us(events)."""
    order = sorted(range(len(events)), key=lambda i: (events[i]["ts"], -events[i]["dur"]))
    out = [0.0] * len(events)
    covered = None
    for i in order:
        s, e = events[i]["ts"], events[i]["ts"] + events[i]["dur"]
        out[i] = max(0.0, e - (s if covered is None else max(s, covered)))
        covered = e if covered is None else max(covered, e)
    return out


def summarize(events: Sequence[dict], steps: int, wall_s: float, wall_s_profiled: float,
              launches: Optional[dict[str, int]] = None) -> dict:
    """Per-kernel table and busy / wall time per step from GPU activity records of `steps` steps."""
    groups: dict[str, list[float]] = {}
    for ev, excl in zip(events, exclusive_us(events)):
        g = groups.setdefault(ev["name"], [0, 0.0, 0.0])
        g[0] += 1
        g[1] += ev["dur"]
        g[2] += excl
    kernel_sum = sum(g[1] for g in groups.values())
    busy_total = sum(g[2] for g in groups.values())
    kernels = [{"name": name, "short": shorten(name), "calls_per_step": n / steps, "us_per_step": us / steps,
                "pct": us / kernel_sum if kernel_sum else None, "excl_us_per_step": ex / steps,
                "excl_pct": ex / busy_total if busy_total else None}
               for name, (n, us, ex) in sorted(groups.items(), key=lambda kv: (-kv[1][2], -kv[1][1]))]
    wall_us = wall_s * 1e6 / steps
    busy = busy_us(events) / steps if events else None  # None: no GPU activity at all (a CPU run)
    gaps_total, gaps = idle_gaps(events)
    return {"steps": steps, "wall_us_per_step": wall_us, "wall_us_per_step_profiled": wall_s_profiled * 1e6 / steps,
            "gpu_busy_us_per_step": busy, "kernel_sum_us_per_step": kernel_sum / steps,
            "gpu_busy_frac": busy / wall_us if busy is not None and wall_us > 0 else None,
            "gpu_idle_us_per_step": wall_us - busy if busy is not None else None,
            "gpu_gaps_us_per_step": gaps_total / steps if events else None, "largest_gaps": gaps,
            "kernels_per_step": sum(g[0] for g in groups.values()) / steps,
            "launches_per_step": {k: v / steps for k, v in sorted((launches or {}).items())},
            "kernels": kernels}


# -- the host's side of a step -----------------------------------------------------------------------
HOST_PHASES = ("schedule", "prepare", "launch", "wait", "collect", "update", "other")


class HostPhaseTimer:
    """Times the host's phases of engine steps by wrapping the engine's own methods on the instances (restored
    on exit): scheduler.schedule, runner.prepare (inside execute_async), the rest of runner.execute_async
    ("launch": graph replay or eager forward, logits, sampler launches), runner.collect split into the wait for
    the step's GPU event ("wait") and the copy back ("collect"), scheduler.update; "other" is the rest of the
    wall time (the engine's step loop, output objects). Per-step microseconds via `per_step`."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.totals = dict.fromkeys(HOST_PHASES, 0.0)
        self._patched: list[tuple[Any, str]] = []

    def _wrap(self, obj: Any, name: str, phase: str) -> None:
        fn = getattr(obj, name)
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[phase] += time.perf_counter() - t
        setattr(obj, name, timed)
        self._patched.append((obj, name))

    def __enter__(self) -> "HostPhaseTimer":
        runner, scheduler, totals = self.engine.runner, self.engine.scheduler, self.totals
        self._wrap(scheduler, "schedule", "schedule")
        self._wrap(scheduler, "update", "update")
        self._wrap(runner, "prepare", "prepare")
        self._wrap(runner, "execute_async", "launch")  # prepare's share is taken out in per_step
        collect = runner.collect

        def timed_collect(handle: Any) -> Any:
            t = time.perf_counter()
            if getattr(handle, "event", None) is not None:
                handle.event.synchronize()
            t1 = time.perf_counter()
            try:
                return collect(handle)
            finally:
                totals["wait"] += t1 - t
                totals["collect"] += time.perf_counter() - t1
        runner.collect = timed_collect
        self._patched.append((runner, "collect"))
        return self

    def __exit__(self, *exc: Any) -> None:
        for obj, name in reversed(self._patched):
            delattr(obj, name)  # the class's method shows through again
        self._patched.clear()

    def per_step(self, wall_s: float, steps: int) -> dict[str, float]:
        t = dict(self.totals)
        t["launch"] -= t["prepare"]
        t["other"] = wall_s - sum(v for k, v in t.items() if k != "other")
        return {k: t[k] / steps * 1e6 for k in HOST_PHASES}


class GpuStepTimer:
    """The GPU's own time per engine step, from CUDA timing events (no profiler attached): an event recorded just
    before each step's launch (the GPU reaches it when the work queued before is done) and one after it (behind the
    step's logits, sampling and copy back). `per_step()` gives the medians of launch -> step end (`gpu_us_per_step`:
    the step's GPU time, inter-kernel gaps included, which the profiler's busy union leaves out) and launch -> next
    launch (`gpu_period_us`). A step is host-bound when the period clearly exceeds the GPU time. None on a CPU."""

    def __init__(self, engine: Any):
        self.runner = engine.runner
        self.on = torch.device(self.runner.device).type == "cuda"
        self.marks: list[tuple[Any, Any]] = []

    def __enter__(self) -> "GpuStepTimer":
        if self.on:
            self._own = self.runner.__dict__.get("execute_async")  # another timer's wrapper, restored on exit
            launch, marks = self.runner.execute_async, self.marks

            def timed(sched: Any) -> Any:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                handle = launch(sched)
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                marks.append((start, end))
                return handle
            self.runner.execute_async = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            if self._own is None:
                del self.runner.execute_async  # the class's method shows through again
            else:
                self.runner.execute_async = self._own

    def per_step(self) -> dict[str, Optional[float]]:
        """Call after a synchronize."""
        if len(self.marks) < 2:
            return {"gpu_us_per_step": None, "gpu_period_us": None}
        work = [a.elapsed_time(b) * 1e3 for a, b in self.marks]
        period = [a.elapsed_time(b) * 1e3 for (a, _), (b, _) in zip(self.marks, self.marks[1:])]
        return {"gpu_us_per_step": statistics.median(work), "gpu_period_us": statistics.median(period)}


# -- driving the engine -----------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drain(engine: Any, limit: int = 10000) -> None:
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise RuntimeError("the engine did not go idle")


class _PlanRequests:
    """C fresh requests of a plan on an idle engine, long enough that none finishes inside the measured windows;
    `step` counts each one's new tokens and fails on an early finish."""

    def __init__(self, engine: Any, plan: Plan, prompts: list[list[int]], steps: int, temperature: float,
                 top_p: float, top_k: int, sampling_seed: int, tag: str):
        from voltllm.engine.types import EngineCoreRequest

        self.engine = engine
        _drain(engine)
        self.pre = max(2, plan.output_len // 2 - steps)  # decode to the middle of the output before measuring
        max_tokens = max(plan.output_len, self.pre + 2 * steps + 4)
        self.counts: dict[str, int] = {}
        t0 = time.monotonic()
        for i, ids in enumerate(prompts):
            rid = f"profile-{tag}-{plan.scenario}-{plan.concurrency}-{i}"
            sp = sampling_params(max_tokens, temperature, top_p, top_k, sampling_seed + i)
            engine.add_request(EngineCoreRequest(rid, list(ids), sp, arrival_time=t0))
            self.counts[rid] = 0

    def step(self) -> None:
        for o in self.engine.step():
            if o.request_id in self.counts:
                self.counts[o.request_id] += len(o.new_token_ids)
                if o.finished:
                    raise RuntimeError(f"profile request {o.request_id} finished early ({o.finish_reason})")

    def prompt_phase(self) -> int:
        """Every step until each request has its first token; returns the engine steps it took."""
        n = 0
        while min(self.counts.values()) < 1:
            if n >= 1000:
                raise RuntimeError("the profile requests produced no first token")
            self.step()
            n += 1
        return n

    def decode_to_middle(self) -> None:
        for _ in range(100 * (self.pre + 8) + 1000):
            if min(self.counts.values()) >= self.pre:
                return
            self.step()
        raise RuntimeError("the profile requests did not reach their decode phase")

    def end(self) -> None:
        self.engine.abort_requests(list(self.counts))
        _drain(self.engine)


def time_host_phases(engine: Any, plan: Plan, prompts: list[list[int]], steps: int, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = -1, sampling_seed: int = 0) -> dict:
    """Wall time per decode step and the host's phases of it (HostPhaseTimer), with no profiler attached. Call it
    before any torch.profiler session in the process: once one has run, the CUDA calls of every later step cost
    the host more (H200 machine, SmolLM2's shape at 64 concurrent: 1,167-1,255 us per step before one, 1,545-1,553
    after), which would misstate a host-bound step."""
    device = torch.device(engine.runner.device)
    reqs = _PlanRequests(engine, plan, prompts, steps, temperature, top_p, top_k, sampling_seed, "host")
    reqs.prompt_phase()
    reqs.decode_to_middle()
    context = plan.input_len + min(reqs.counts.values())
    _sync(device)
    with HostPhaseTimer(engine) as host, GpuStepTimer(engine) as gpu:
        t = time.perf_counter()
        for _ in range(steps):
            reqs.step()
        _sync(device)
        wall = time.perf_counter() - t
    reqs.end()
    return {"context_len_at_start": context, "wall_s": wall, "host_us_per_step": host.per_step(wall, steps),
            **gpu.per_step()}


def profile_plan(engine: Any, plan: Plan, prompts: list[list[int]], steps: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = -1, sampling_seed: int = 0,
                 trace_path: Optional[str] = None, host: Optional[dict] = None) -> dict:
    """The plan's prompt phase and `steps` decode steps under torch.profiler. host: `time_host_phases`'s result for
    the same plan, taken before any profiler ran (measured here, after this profile, when not given).
    trace_path: also keep the profiled decode steps' chrome trace there (gzip; chrome://tracing or Perfetto)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(engine.runner.device)
    reqs = _PlanRequests(engine, plan, prompts, steps, temperature, top_p, top_k, sampling_seed, "trace")
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with tempfile.TemporaryDirectory(prefix="voltllm-profile-") as tmp:
        # the prompt phase: every step until each request has its first token
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            prompt_steps = reqs.prompt_phase()
            _sync(device)
            wall_prompt = time.perf_counter() - t
        prompt_trace = _trace(prof, tmp)
    reqs.decode_to_middle()
    _sync(device)
    with tempfile.TemporaryDirectory(prefix="voltllm-profile-") as tmp:
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                reqs.step()
            _sync(device)
            wall_prof = time.perf_counter() - t
        trace = _trace(prof, tmp)
    if trace_path:
        os.makedirs(os.path.dirname(trace_path) or ".", exist_ok=True)
        with gzip.open(trace_path, "wt") as f:
            json.dump(trace, f)
    reqs.end()
    if host is None:
        host = time_host_phases(engine, plan, prompts, steps, temperature, top_p, top_k, sampling_seed)
    out = {"scenario": plan.scenario, "concurrency": plan.concurrency, "input_len": plan.input_len,
           "output_len": plan.output_len, "context_len_at_start": host["context_len_at_start"]}
    out.update(summarize(gpu_events(trace), steps, host["wall_s"], wall_prof, launch_counts(trace)),
               blocking_calls=blocking_calls(trace), host_us_per_step=host["host_us_per_step"],
               gpu_us_per_step=host.get("gpu_us_per_step"), gpu_period_us=host.get("gpu_period_us"))
    # the prompt phase as one unit (its figures are per phase, not per engine step); profiled wall time only
    out["prompt_phase"] = {"engine_steps": prompt_steps,
                           **summarize(gpu_events(prompt_trace), 1, wall_prompt, wall_prompt,
                                       launch_counts(prompt_trace)),
                           "blocking_calls": blocking_calls(prompt_trace)}
    return out


def _trace(prof: Any, tmp: str) -> dict:
    path = os.path.join(tmp, f"trace-{time.monotonic_ns()}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)


def profile_plans(engine: Any, plans: Sequence[Plan], vocab: int, seed: int, steps: int, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = -1, trace_prefix: Optional[str] = None) -> list[dict]:
    """One profile per decode / concurrency configuration (prefill plans are skipped). Every configuration's host
    timing runs first, before the first torch.profiler session (time_host_phases says why). trace_prefix: keep each
    configuration's decode-step trace as <trace_prefix>-<scenario>-c<concurrency>.trace.json.gz."""
    if steps < 1:
        raise ValueError("--profile-steps must be >= 1")
    chosen = []
    for plan in plans:
        if plan.scenario not in ("decode", "concurrency"):
            continue
        max_seqs = engine.config.scheduler.max_num_seqs
        if plan.concurrency > max_seqs:  # some requests would wait for others to finish: not one decode batch
            logger.warning("not profiling concurrency %d > --max-num-seqs %d", plan.concurrency, max_seqs)
            continue
        # the measured runs' prompt lengths (spread by --random-range-ratio); every request decodes the same steps.
        # The host timing draws its own prompts: with the profile's, their blocks would be prefix-cache hits by the
        # time the profile's prompt phase runs, which would then compute only each prompt's last token
        chosen.append((plan, make_workload(plan, vocab, prompt_seed(seed, plan, 10_000)).prompts,
                       make_workload(plan, vocab, prompt_seed(seed, plan, 10_001)).prompts))
    hosts = []
    for plan, _, host_prompts in chosen:
        logger.info("timing the host's phases: %s c=%d (%d steps)", plan.scenario, plan.concurrency, steps)
        hosts.append(time_host_phases(engine, plan, host_prompts, steps, temperature, top_p, top_k, seed))
    out = []
    for (plan, prompts, _), host in zip(chosen, hosts):
        logger.info("profiling %s c=%d (%d steps)", plan.scenario, plan.concurrency, steps)
        trace = f"{trace_prefix}-{plan.scenario}-c{plan.concurrency}.trace.json.gz" if trace_prefix else None
        out.append(profile_plan(engine, plan, prompts, steps, temperature, top_p, top_k, seed, trace, host))
    return out


# -- output -----------------------------------------------------------------------------------------
def profile_summary(profiles: list[dict], top: int = 5) -> list[dict]:
    """The result file's `profile` entry: per configuration the per-step figures and the top kernels."""
    keys = ("scenario", "concurrency", "input_len", "output_len", "context_len_at_start", "steps",
            "wall_us_per_step", "wall_us_per_step_profiled", "gpu_busy_us_per_step", "gpu_busy_frac",
            "gpu_idle_us_per_step", "kernel_sum_us_per_step", "kernels_per_step", "host_us_per_step",
            "gpu_us_per_step", "gpu_period_us")
    return [{**{k: p[k] for k in keys},
             "top_kernels": [{k: r[k] for k in ("short", "excl_us_per_step", "excl_pct", "us_per_step")}
                             for r in p["kernels"][:top]]}
            for p in profiles]


def profile_file(report: dict, profiles: list[dict]) -> dict:
    head = {k: report.get(k) for k in ("name", "gpu", "commit", "command", "created", "model")}
    return {**head, "profiles": profiles}


def _f(v: Optional[float], spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _kernel_table(kernels: list[dict], top: int, unit: str) -> list[str]:
    if not kernels:
        return ["  (no GPU activity recorded: a CPU run, or the profiler could not trace the GPU)"]
    rows = [(r["short"], _f(r["calls_per_step"], ".1f"), _f(r["excl_us_per_step"]), _f(r["excl_pct"], ".1%"),
             _f(r["us_per_step"])) for r in kernels[:top]]
    rest = kernels[top:]
    if rest:
        rows.append((f"({len(rest)} more)", _f(sum(r["calls_per_step"] for r in rest), ".1f"),
                     _f(sum(r["excl_us_per_step"] for r in rest)),
                     _f(sum(r["excl_pct"] or 0 for r in rest), ".1%"), _f(sum(r["us_per_step"] for r in rest))))
    head = ("kernel", f"calls/{unit}", f"exclusive us/{unit}", "% busy", f"as recorded us/{unit}")
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return (["  " + "  ".join(h.ljust(w) for h, w in zip(head, widths))]
            + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows])


def format_profiles(profiles: list[dict], top: int = 15) -> str:
    lines = []
    for p in profiles:
        launches = ", ".join(f"{k} {v:.0f}" for k, v in p["launches_per_step"].items())
        lines.append(f"profile {p['scenario']} C={p['concurrency']} (context {p['context_len_at_start']}, "
                     f"{p['steps']} steps): wall {_f(p['wall_us_per_step'])} us/step "
                     f"({_f(p['wall_us_per_step_profiled'])} under the profiler), GPU busy "
                     f"{_f(p['gpu_busy_us_per_step'])} us/step ({_f(p['gpu_busy_frac'], '.0%')} of wall, idle "
                     f"{_f(p['gpu_idle_us_per_step'])} us/step), "
                     f"{_f(p['kernels_per_step'], '.0f')} GPU ops/step" + (f"; launches/step: {launches}"
                                                                             if launches else ""))
        lines += _kernel_table(p["kernels"], top, "step")
        lines += _idle_lines(p, "step")
        if p.get("host_us_per_step"):
            h = p["host_us_per_step"]
            phases = ", ".join(f"{k} {h[k]:.0f}" for k in HOST_PHASES if k != "wait")
            lines.append(f"  host per step (unprofiled): {phases} us; waiting for the GPU {h['wait']:.0f} us")
        if p.get("gpu_us_per_step") is not None:
            lines.append(f"  GPU per step (timing events, unprofiled): launch -> step end {p['gpu_us_per_step']:.0f} "
                         f"us, launch -> next launch {p['gpu_period_us']:.0f} us")
        pp = p.get("prompt_phase")
        if pp:
            busy = pp['gpu_busy_us_per_step'] / 1e3 if pp['gpu_busy_us_per_step'] is not None else None
            lines.append(f"  prompt phase ({p['concurrency']} x {p['input_len']} tokens, {pp['engine_steps']} engine "
                         f"steps, under the profiler): wall {_f(pp['wall_us_per_step'] / 1e3, '.2f')} ms, GPU busy "
                         f"{_f(busy, '.2f')} ms, {_f(pp['kernels_per_step'], '.0f')} GPU ops")
            lines += _kernel_table(pp["kernels"], top, "phase")
            lines += _idle_lines(pp, "phase")
    return "\n".join(lines)


def _idle_lines(p: dict, unit: str) -> list[str]:
    """Where the GPU's idle time is: between its kernels (the longest gaps named) or outside them, and the host's
    waits for the GPU."""
    if p.get("gpu_gaps_us_per_step") is None:
        return []
    # the events are the profiled steps', so the time outside them comes from the profiled wall; the window
    # starts on a drained GPU (synchronized first), so its first step's launch gaps count as between kernels
    outside = p["wall_us_per_step_profiled"] - p["gpu_busy_us_per_step"] - p["gpu_gaps_us_per_step"]
    gaps = "; ".join(f"{g['us']:.0f} us after {g['after']} before {g['before']}" for g in p.get("largest_gaps", [])[:3])
    waits = ", ".join(f"{k} {v['calls']}x {v['us'] / 1e3:.2f} ms" for k, v in (p.get("blocking_calls") or {}).items())
    return [f"  GPU idle per {unit}: {p['gpu_gaps_us_per_step']:.0f} us between kernels, {outside:.0f} us before the "
            f"first / after the last" + (f"; longest gaps: {gaps}" if gaps else ""),
            f"  host waits for the GPU (whole window): {waits or 'none'}"]
