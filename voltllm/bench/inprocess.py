"""Scenarios, the run protocol, and the in-process runner that drives EngineCore directly.

The runner adds token-id prompts (random ids, fixed seed) with forced output lengths (ignore_eos,
min_tokens = max_tokens) and steps the engine itself, so it sees every token arrive: each output token
gets a bench-side time.monotonic() stamp when the step that made it returns, beside the engine-side
first/last token and scheduled times carried by EngineCoreOutput (same clock, same process).
"""
from __future__ import annotations

import logging
import math
import random
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from voltllm.bench.compiles import CompileLog
from voltllm.bench.images import BenchImage, ImageTokens, RandomMM
from voltllm.bench.metrics import RequestTiming, RunResult, spec_counts, spec_delta
from voltllm.bench.workloads import MultiTurn, PrefixRepetition, RequestSource, make_source, stream_of
from voltllm.config import ConfigError

logger = logging.getLogger("voltllm.bench")

SCENARIOS = ("decode", "concurrency", "prefill")
# scenario -> (input length, output length) when --input-len / --output-len are not given (random-mm: the text's)
DEFAULT_LENGTHS = {"decode": (512, 256), "concurrency": (128, 128), "prefill": (8192, 1), "random-mm": (128, 128)}
# the prefix-cache scenarios (not in `all`): shared-prefix requests and multi-turn conversations, N requests each run
# with C in flight; their lengths come from their own flags (bench/workloads.py)
CACHE_SCENARIO_SPECS = {"prefix": PrefixRepetition, "multi-turn": MultiTurn}
DEFAULT_CONCURRENCY = {"concurrency": [1, 4, 16, 64], "prefix": [16], "multi-turn": [4], "random-mm": [1, 4, 16]}
# requests with images (bench/images.py, not in `all`): C requests together, as the concurrency scenario's, each with
# random text and random images
IMAGE_SCENARIO = "random-mm"


@dataclass(frozen=True)
class Plan:
    """One configuration: a scenario at one concurrency, run 1 cold + N warm times."""

    scenario: str
    concurrency: int
    input_len: int
    output_len: int
    # requests' lengths are drawn from [len * (1 - r), len * (1 + r)] (vLLM's --random-range-ratio); 0: all equal
    range_ratio: float = 0.0
    # requests arrive at this mean rate (1/s) with gamma-distributed gaps of shape `burstiness` (vLLM's
    # --request-rate / --burstiness; 1: a Poisson process); inf: all at once
    request_rate: float = math.inf
    burstiness: float = 1.0
    # the prefix-cache scenarios' request set (input_len / output_len then give its prompt and answer lengths)
    spec: Optional[PrefixRepetition | MultiTurn] = None
    # random-mm: the requests' images, and the model's vision token ids (set once the model is known)
    images: Optional[RandomMM] = None
    image_tokens: Optional[ImageTokens] = None
    # the concurrency scenario's --num-prompts: N requests per run, at most `concurrency` in flight, each sent when
    # one ends and (with request_rate) not before its arrival time (vLLM's bench serve with --max-concurrency);
    # None: `concurrency` requests, all sent together (or at request_rate)
    num_prompts: Optional[int] = None

    def workload(self) -> Optional[dict]:
        """The request set's flags for the result file (None: the concurrency scenario's one batch)."""
        if self.spec is not None:
            return self.spec.describe()
        if self.num_prompts is not None:
            return {"num_prompts": self.num_prompts, "max_concurrency": self.concurrency}
        return None


@dataclass(frozen=True)
class Workload:
    """One run's requests: token-id prompts, the output length each one is forced to and when each is sent
    (seconds after the run starts)."""

    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: Optional[list[float]] = None  # None: all at the start
    images: Optional[list[tuple[BenchImage, ...]]] = None  # random-mm: each request's images (after its text)

    def arrival(self, i: int) -> float:
        return self.arrivals[i] if self.arrivals else 0.0


def make_plans(scenario: str, concurrency: Optional[list[int]], input_len: Optional[int] = None,
               output_len: Optional[int] = None, range_ratio: float = 0.0, request_rate: float = math.inf,
               burstiness: float = 1.0, spec: Optional[PrefixRepetition | MultiTurn] = None,
               images: Optional[RandomMM] = None, num_prompts: Optional[int] = None) -> list[Plan]:
    """The configurations to run. range_ratio spreads the lengths of the concurrency scenario's requests and
    request_rate their arrival over time (the single-request scenarios measure one request, so they refuse both);
    num_prompts makes its runs N requests with at most C in flight. concurrency None: the scenario's default. The
    prefix-cache scenarios take their request set from spec, random-mm its images from `images`."""
    if scenario in CACHE_SCENARIO_SPECS:
        return _cache_plans(scenario, concurrency or DEFAULT_CONCURRENCY[scenario], input_len, output_len, range_ratio,
                            request_rate, spec)
    is_images = scenario == IMAGE_SCENARIO
    concurrency = concurrency or DEFAULT_CONCURRENCY[IMAGE_SCENARIO if is_images else "concurrency"]
    names = list(SCENARIOS) if scenario == "all" else [scenario]
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if not request_rate > 0 or not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"--request-rate and --burstiness must be > 0 (and the burstiness finite), got "
                         f"{request_rate} and {burstiness}")
    for flag, used in (("--random-range-ratio", range_ratio != 0.0), ("--request-rate", math.isfinite(request_rate))):
        if used and "concurrency" not in names and not is_images:
            raise ValueError(f"{flag} shapes the requests of --scenario concurrency and random-mm; --scenario "
                             f"{scenario} runs one request at a time")
    if num_prompts is not None:
        _check_num_prompts(num_prompts, scenario, concurrency)
    if is_images:
        images = images if images is not None else RandomMM()
    plans = []
    for name in names:
        if is_images:
            il, ol = DEFAULT_LENGTHS[name]
            il, ol = input_len or il, output_len or ol
            if il < 1 or ol < 1:
                raise ValueError("--input-len and --output-len must be >= 1")
            for c in concurrency:
                if c < 1:
                    raise ValueError(f"--concurrency values must be >= 1, got {c}")
                plans.append(Plan(name, c, il, ol, range_ratio, request_rate, burstiness, images=images))
            continue
        if name not in SCENARIOS:
            raise ValueError(f"--scenario must be one of {', '.join(SCENARIOS)} or all, got {name!r}")
        il, ol = DEFAULT_LENGTHS[name]
        il, ol = input_len or il, output_len or ol
        if il < 1 or ol < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        for c in (concurrency if name == "concurrency" else [1]):
            if c < 1:
                raise ValueError(f"--concurrency values must be >= 1, got {c}")
            if name == "concurrency":
                plans.append(Plan(name, c, il, ol, range_ratio, request_rate, burstiness, num_prompts=num_prompts))
            else:
                plans.append(Plan(name, c, il, ol))
    return plans


def _check_num_prompts(n: int, scenario: str, concurrency: list[int]) -> None:
    if scenario not in ("concurrency", "all"):
        raise ValueError(f"--num-prompts sets the requests per run of --scenario concurrency (and prefix), not of "
                         f"--scenario {scenario}")
    if n < max(concurrency):
        raise ValueError(f"--num-prompts {n} is below --concurrency {max(concurrency)}: each run sends N requests "
                         "with at most C in flight, so N >= C")


def _cache_plans(scenario: str, concurrency: list[int], input_len: Optional[int], output_len: Optional[int],
                 range_ratio: float, request_rate: float, spec: Optional[PrefixRepetition | MultiTurn]) -> list[Plan]:
    kind = CACHE_SCENARIO_SPECS[scenario]
    flags = "--prefix-repetition-prefix-len / -suffix-len / -output-len" if kind is PrefixRepetition else \
        "--multi-turn-input-len / --multi-turn-output-len"
    if input_len is not None or output_len is not None:
        raise ConfigError(f"--input-len / --output-len shape the decode, concurrency and prefill scenarios; --scenario "
                          f"{scenario} takes its lengths from {flags}")
    if range_ratio or math.isfinite(request_rate):
        raise ConfigError(f"--random-range-ratio and --request-rate shape --scenario concurrency; --scenario "
                          f"{scenario} sends its requests with --concurrency C in flight")
    spec = spec if spec is not None else kind()
    if not isinstance(spec, kind):
        raise ValueError(f"--scenario {scenario} needs a {kind.__name__} request set, got {type(spec).__name__}")
    spec.check()
    plans = []
    for c in concurrency:
        if c < 1:
            raise ConfigError(f"--concurrency values must be >= 1, got {c}")
        if isinstance(spec, PrefixRepetition):
            plans.append(Plan(scenario, c, spec.prompt_len, spec.output_len, spec=spec))
        else:
            plans.append(Plan(scenario, c, spec.input_len, spec.output_len, spec=spec))
    return plans


def prompt_seed(base: int, plan: Plan, run_index: int) -> int:
    key = f"{plan.scenario}/{plan.concurrency}/{plan.input_len}/{run_index}".encode()
    return (base * 1_000_003 + zlib.crc32(key)) % (2 ** 63)


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids (fresh per run, so warm runs do not hit the prefix cache)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=gen).tolist()


def length_range(mean: int, ratio: float) -> tuple[int, int]:
    """The inclusive range lengths are drawn from: [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    lo = max(1, math.floor(mean * (1.0 - ratio)))
    return lo, max(lo, math.ceil(mean * (1.0 + ratio)))


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> Optional[list[float]]:
    """Send times of n requests (seconds from the start): the first at 0, then gaps drawn from a gamma distribution
    of shape `burstiness` and mean 1 / rate (burstiness 1: exponential gaps, a Poisson process; below 1 burstier).
    None when the rate is infinite (all at once)."""
    if math.isinf(rate):
        return None
    rng = random.Random(seed)
    out, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def make_workload(plan: Plan, vocab_size: int, seed: int, n: Optional[int] = None) -> Workload:
    """The run's prompts, forced output lengths and send times. Without a range ratio: n (default plan.concurrency)
    prompts of plan.input_len random ids, each forced to plan.output_len. With one: every request's input and output
    lengths are drawn uniformly (inclusive) from length_range, then its ids; all from the one seed. The send times
    come from their own stream of the seed, so a rate changes when requests arrive, not what they are."""
    n = plan.concurrency if n is None else n
    arrivals = arrival_times(n, plan.request_rate, plan.burstiness, seed ^ 0x5EED)
    if plan.images is not None:
        return _image_workload(plan, vocab_size, seed, arrivals)
    if not plan.range_ratio:
        return Workload(random_prompts(n, plan.input_len, vocab_size, seed), [plan.output_len] * n, arrivals)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = length_range(plan.input_len, plan.range_ratio)
    input_lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    lo, hi = length_range(plan.output_len, plan.range_ratio)
    output_lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab_size, (length,), generator=gen).tolist() for length in input_lens]
    return Workload(prompts, output_lens, arrivals)


def _image_workload(plan: Plan, vocab_size: int, seed: int, arrivals: Optional[list[float]]) -> Workload:
    """random-mm: the lengths as the concurrency scenario draws them, then each request's text ids and images
    (bench/images.py) from the same seed."""
    from voltllm.bench.images import draw_requests

    if plan.image_tokens is None:
        raise ValueError("a random-mm plan needs the model's image token ids (Plan.image_tokens)")
    n = plan.concurrency
    input_lens, output_lens = [plan.input_len] * n, [plan.output_len] * n
    if plan.range_ratio:
        gen = torch.Generator().manual_seed(seed)
        lo, hi = length_range(plan.input_len, plan.range_ratio)
        input_lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
        lo, hi = length_range(plan.output_len, plan.range_ratio)
        output_lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    prompts, images = draw_requests(plan.images, plan.image_tokens, n, input_lens, vocab_size, seed)
    return Workload(prompts, output_lens, arrivals, images)


RunFn = Callable[[Plan, str, "Workload | RequestSource"], RunResult]


def make_run_input(plan: Plan, vocab_size: int, seed: int, run_index: int) -> Workload | RequestSource:
    """A run's requests: a Workload, or a RequestSource for the prefix-cache scenarios (prefixes fresh per run
    unless the spec reuses them: then drawn from the configuration's run-0 seed) and the concurrency scenario's
    --num-prompts (its N requests drawn as one batch of N would be)."""
    run_seed = prompt_seed(seed, plan, run_index)
    if plan.spec is not None:
        return make_source(plan.spec, vocab_size, run_seed, prompt_seed(seed, plan, 0))
    if plan.num_prompts is not None:
        work = make_workload(plan, vocab_size, run_seed, plan.num_prompts)
        return stream_of(work.prompts, work.output_lens, work.arrivals)
    return make_workload(plan, vocab_size, run_seed)


def run_protocol(plans: list[Plan], run_fn: RunFn, vocab_size: int, seed: int, num_warm: int = 3,
                 label: str = "voltllm") -> list[RunResult]:
    """1 cold + num_warm warm runs of every plan; prompts depend on (seed, plan, run index) only, so every
    runner (voltllm in-process, a server, transformers) gets the same prompts."""
    results = []
    for plan in plans:
        for i in range(1 + num_warm):
            run = "cold" if i == 0 else f"warm{i}"
            r = run_fn(plan, run, make_run_input(plan, vocab_size, seed, i))
            if r.is_warm and r.compiles:
                logger.warning("%s %s c=%d %s compiled %d Triton kernels during the run (%s): its numbers include "
                               "the compiles", label, plan.scenario, plan.concurrency, run, len(r.compiles),
                               ", ".join(sorted(set(r.compiles))))
            m = r.metrics()
            logger.info("%s %s c=%d %s: wall %.3f s, output %.1f tok/s, ttft %.1f ms%s", label, plan.scenario,
                        plan.concurrency, run, r.wall_s, m["output_tok_s"] or 0.0, m["ttft_ms"] or 0.0,
                        f", pure decode {m['pure_decode_tok_s']:.1f} tok/s" if m.get("pure_decode_tok_s") else "")
            results.append(r)
    return results


def sampling_params(output_len: int, temperature: float, top_p: float, top_k: int, seed: Optional[int]):
    from voltllm.sampling.params import SamplingParams

    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, ignore_eos=True,
                          max_tokens=output_len, min_tokens=output_len, detokenize=False)


@dataclass
class _Track:
    arrival: float
    prompt_tokens: int
    n: int = 0
    first: Optional[float] = None
    last: Optional[float] = None
    scheduled: Optional[float] = None
    cached: int = 0
    finish: Optional[str] = None
    stop_reason: Any = None

    def __post_init__(self) -> None:
        self.times: list[float] = []


class InProcessRunner:
    """Runs one batch at a time on an EngineCore that nothing else is using. Requests with images (random-mm) need
    the engine's image processor (multimodal/processor.py); tower_timer (bench/images.py, entered by the caller) times
    the vision tower's calls of each run."""

    def __init__(self, engine: Any, temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1,
                 sampling_seed: int = 0, compile_log: Optional[CompileLog] = None, image_processor: Any = None,
                 tower_timer: Any = None):
        self.engine = engine
        self.compile_log = compile_log  # entered by the caller: each run records the kernels compiled in it
        self.image_processor = image_processor
        self.tower_timer = tower_timer
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.sampling_seed = sampling_seed
        self._batch = 0

    def drain(self) -> None:
        """Let a step still in flight (async scheduling) land; the engine must then be idle."""
        eng = self.engine
        for _ in range(8):
            if not eng.has_unfinished_requests():
                break
            eng.step()
        if eng.has_unfinished_requests():
            raise RuntimeError("the engine still has requests from an earlier run")

    def __call__(self, plan: Plan, run: str, work: Workload | RequestSource) -> RunResult:
        from voltllm.engine.types import EngineCoreRequest

        if isinstance(work, RequestSource):
            from voltllm.bench.closed_loop import run_source_inprocess

            return run_source_inprocess(self, plan, run, work)
        eng = self.engine
        self.drain()
        self._batch += 1
        prompts, mms, processor_ms = self._prepare(plan, work)
        stats0 = eng.stats()
        preempt0, spec0 = stats0.num_preemptions, spec_counts(stats0)
        mark = self.compile_log.mark() if self.compile_log is not None else 0
        tower_mark = self.tower_timer.mark() if self.tower_timer is not None else 0
        t0 = time.monotonic()
        track: dict[str, _Track] = {}
        forced: dict[str, int] = {}
        order = sorted(range(len(work.prompts)), key=work.arrival)
        for i in order:
            track[f"bench{self._batch}-{i}"] = _Track(t0 + work.arrival(i), len(prompts[i]))

        def admit(k: int, now: float) -> int:
            """Add the requests from order[k] on whose send time has come, stamped with that time (a server would
            have queued them then); returns how many have been added so far."""
            while k < len(order) and t0 + work.arrival(order[k]) <= now:
                i = order[k]
                rid, n = f"bench{self._batch}-{i}", work.output_lens[i]
                sp = sampling_params(n, self.temperature, self.top_p, self.top_k, self.sampling_seed + i)
                eng.add_request(EngineCoreRequest(rid, list(prompts[i]), sp, arrival_time=track[rid].arrival,
                                                  multi_modal=mms[i]))
                forced[rid] = n
                k += 1
            return k

        pending = set(track)
        end = t0
        admitted = 0
        while pending:
            admitted = admit(admitted, time.monotonic())
            if admitted < len(order) and not eng.has_unfinished_requests():
                time.sleep(max(0.0, t0 + work.arrival(order[admitted]) - time.monotonic()))
                continue
            outs = eng.step()
            now = time.monotonic()  # the step returned: its tokens exist now (their ids are on the host)
            for o in outs:
                t = track.get(o.request_id)
                if t is None:
                    continue
                if o.new_token_ids:
                    t.times.extend([now] * len(o.new_token_ids))
                    t.n += len(o.new_token_ids)
                    end = now
                if o.first_token_time is not None:
                    t.first = o.first_token_time if t.first is None else t.first
                if o.last_token_time is not None:
                    t.last = o.last_token_time
                if o.scheduled_time is not None and t.scheduled is None:
                    t.scheduled = o.scheduled_time
                t.cached = max(t.cached, o.num_cached_tokens)
                if o.finished:
                    t.finish, t.stop_reason = o.finish_reason, o.stop_reason
                    pending.discard(o.request_id)
            if pending and not outs and not eng.has_unfinished_requests() and admitted == len(order):
                raise RuntimeError(f"the engine went idle with {len(pending)} bench requests unfinished")
        reqs = []
        for rid, t in track.items():
            if t.finish == "abort" or t.n != forced[rid]:
                raise RuntimeError(f"request {rid} ended with {t.n} of {forced[rid]} forced tokens "
                                   f"(finish {t.finish}, {t.stop_reason}); raise the KV cache or --max-model-len")
            i = int(rid.rsplit("-", 1)[1])
            reqs.append(RequestTiming(
                prompt_tokens=t.prompt_tokens, output_tokens=t.n, arrival=t.arrival,
                first_token=t.first if t.first is not None else t.times[0],
                last_token=t.last if t.last is not None else t.times[-1],
                scheduled=t.scheduled, cached_tokens=t.cached, token_times=t.times,
                images=len(work.images[i]) if work.images is not None else None,
                image_tokens=(sum(im.num_tokens for im in mms[i].images) if mms[i] is not None else 0)
                if work.images is not None else None))
        stats = eng.stats()
        result = RunResult(plan.scenario, plan.concurrency, run, plan.input_len, plan.output_len, t0, end, reqs,
                           preemptions=stats.num_preemptions - preempt0, side="server",
                           spec=spec_delta(spec0, spec_counts(stats)),
                           range_ratio=plan.range_ratio, request_rate=plan.request_rate,
                           compiles=self.compile_log.since(mark) if self.compile_log is not None else None)
        if work.images is not None:
            result.images = plan.images.describe()
            result.processor_ms = processor_ms
            result.tower_ms = self.tower_timer.since(tower_mark) if self.tower_timer is not None else None
        return result

    def _prepare(self, plan: Plan, work: Workload) -> tuple[list[list[int]], list[Any], list[float]]:
        """Each request's prompt ids and MultiModalPrompt (None: no image), and the image processor's milliseconds
        per image: the images go through the server's processor before the run's clock starts."""
        if work.images is None:
            return work.prompts, [None] * len(work.prompts), []
        from voltllm.bench.images import prepare_inprocess

        if self.image_processor is None:
            raise ValueError("requests with images need the engine's image processor (InProcessRunner's "
                             "image_processor)")
        prompts, mms, per_image = [], [], []
        for text, images in zip(work.prompts, work.images):
            ids, mm, secs = prepare_inprocess(self.image_processor, plan.image_tokens, text, images)
            prompts.append(ids)
            mms.append(mm)
            per_image += [secs * 1e3 / len(images)] * len(images) if images else []
        return prompts, mms, per_image


def build_engine(engine_args: Any) -> Any:
    """EngineCore from EngineArgs (no tokenizer, no frontend: the bench speaks token ids)."""
    from voltllm.engine.core import EngineCore

    return EngineCore(engine_args.create_engine_config())


def free_device_memory(device: torch.device) -> None:
    """After the caller dropped its engine: collect it and return its memory to the card, so that another
    model (the transformers baseline) fits."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        logger.info("after releasing the engine: %.2f GiB still allocated on %s",
                    torch.cuda.memory_allocated(device) / 2**30, device)
