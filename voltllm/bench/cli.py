"""`voltllm bench`: the metrics of DESIGN.md ("Benchmark definitions") with the ratio to the hardware limit.

In-process (default): builds the engine from the same engine flags as `voltllm serve` and drives it
directly. Against a server: `--base-url http://host:port`. `--baseline hf` also runs transformers'
generate on the same model and prompts in the same call. Writes benchmarks/results/<name>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import tempfile
import time
from typing import Any, Optional

from voltllm.bench import limits as L
from voltllm.bench import record as R
from voltllm.bench.compiles import CompileLog
from voltllm.bench.inprocess import IMAGE_SCENARIO, SCENARIOS, Plan, make_plans, run_protocol
from voltllm.bench.images import RandomMM, random_mm
from voltllm.bench.workloads import MultiTurn, PrefixRepetition
from voltllm.config import ConfigError
from voltllm.bench.metrics import (CACHE_SCENARIOS, DEFAULT_PERCENTILES, LATENCY_METRICS, find_row, format_report,
                                   headline, rate_json, speedup, table_rows)

logger = logging.getLogger("voltllm.bench")

# vLLM bench serve's --dataset-name values that a scenario here matches (random: C requests of random ids, or N with
# --num-prompts; prefix_repetition: shared prefixes)
DATASET_SCENARIOS = {"random": "concurrency", "random-mm": IMAGE_SCENARIO, "prefix_repetition": "prefix"}


def _int_list(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return out


def _latency_metrics(value: str) -> tuple[str, ...]:
    names = tuple(_str_list(value))
    bad = [n for n in names if n not in LATENCY_METRICS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(LATENCY_METRICS)}, got "
                                         f"{value!r}")
    return names


def _percentiles(value: str) -> tuple[float, ...]:
    try:
        qs = tuple(float(v) for v in _str_list(value))
    except ValueError:
        qs = ()
    if not qs or not all(0 < q <= 100 for q in qs):
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles in (0, 100], got {value!r}")
    return qs


def _str_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bench")
    g.add_argument("--random-weights", default=None, metavar="NAME|DIR",
                   help="random weights at a named shape (qwen3-8b-shape, qwen3-0.6b-shape, qwen3.5-27b-shape) "
                        "or at the shape of a directory's config.json (implies --load-format dummy)")
    g.add_argument("--scenario", default=None, choices=list(SCENARIOS) + ["all"] + list(CACHE_SCENARIOS)
                   + [IMAGE_SCENARIO, "kernels"],
                   help="decode: batch 1, 512 in / 256 out; concurrency: C requests together, 128/128; "
                        "prefill: one 8192-token prompt; all: the three; prefix: requests sharing prompt prefixes "
                        "(--prefix-repetition-*), C in flight; multi-turn: conversations whose turns resend the "
                        "history (--multi-turn-*), C in flight; random-mm: C requests together, each random text "
                        "and random images (--random-mm-*; a Qwen3.5 / Qwen3-VL model); kernels: the GDN / MoE "
                        "Triton kernels "
                        "against their torch references at the model's layer shapes (CUDA only, no engine); default "
                        "decode")
    g.add_argument("--dataset-name", default=None, choices=sorted(DATASET_SCENARIOS),
                   help="vLLM bench serve's spelling of the scenario: random = concurrency, random-mm, "
                        "prefix_repetition = prefix")
    g.add_argument("--input-len", "--random-input-len", type=int, default=None,
                   help="prompt tokens (default: per scenario)")
    g.add_argument("--output-len", "--random-output-len", type=int, default=None,
                   help="forced output tokens (default: per scenario)")
    g.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="--scenario concurrency / random-mm: draw each request's input and output length uniformly "
                        "from "
                        "[len * (1 - R), len * (1 + R)] (vLLM's flag; 0 = all equal, R < 1)")
    g.add_argument("--request-rate", type=float, default=float("inf"), metavar="R",
                   help="--scenario concurrency / random-mm: send the C requests at R per second on average instead "
                        "of all at "
                        "once (vLLM's flag; gaps drawn from a gamma distribution, see --burstiness; default inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma distribution of --request-rate's gaps: 1 = a Poisson process, below 1 "
                        "burstier, above 1 more regular (vLLM's flag)")
    g.add_argument("--concurrency", "--max-concurrency", type=_int_list, default=None,
                   help="e.g. 1,4,16,64 (the default for --scenario concurrency; random-mm: 1,4,16); prefix / "
                        "multi-turn, and concurrency with --num-prompts: requests in flight (default 16 / 4)")
    p = PrefixRepetition()
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"--scenario prefix: requests per run (vLLM's flag; default {p.num_prompts}, a multiple of "
                        "--prefix-repetition-num-prefixes); --scenario concurrency: N requests per run, at most C in "
                        "flight, each sent when one ends (vLLM's bench serve with --max-concurrency; default: C "
                        "requests sent together)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=None,
                   help=f"--scenario prefix: tokens of each shared prefix (vLLM's flag; default {p.prefix_len})")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=None,
                   help=f"--scenario prefix: fresh tokens after the prefix per request (default {p.suffix_len})")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=None,
                   help=f"--scenario prefix: distinct prefixes, each serving num-prompts / P requests (default "
                        f"{p.num_prefixes})")
    g.add_argument("--prefix-repetition-output-len", type=int, default=None,
                   help=f"--scenario prefix: forced output tokens per request (default {p.output_len})")
    g.add_argument("--prefix-repetition-reuse-prefixes", action="store_true",
                   help="--scenario prefix: draw the prefixes once per configuration, so the warm runs find the cold "
                        "run's prefixes cached (default: a fresh prefix set per run)")
    mt = MultiTurn()
    g.add_argument("--multi-turn-num-conversations", type=int, default=None,
                   help=f"--scenario multi-turn: conversations per run (default {mt.num_conversations})")
    g.add_argument("--multi-turn-num-turns", type=int, default=None,
                   help=f"--scenario multi-turn: user turns (requests) per conversation (default {mt.num_turns})")
    g.add_argument("--multi-turn-input-len", type=int, default=None,
                   help=f"--scenario multi-turn: tokens of each new user turn (default {mt.input_len})")
    g.add_argument("--multi-turn-output-len", type=int, default=None,
                   help=f"--scenario multi-turn: forced tokens of each answer (default {mt.output_len})")
    g.add_argument("--random-mm-base-items-per-request", type=int, default=None, metavar="N",
                   help="--scenario random-mm: images per request around which the count is drawn (vLLM's flag; "
                        "default 1)")
    g.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=None, metavar="R",
                   help="--scenario random-mm: draw each request's image count uniformly from [floor(N * (1 - R)), "
                        "ceil(N * (1 + R))] (vLLM's flag; 0 <= R <= 1, default 0)")
    g.add_argument("--random-mm-limit-mm-per-prompt", default=None, metavar="JSON",
                   help="--scenario random-mm: the most images one request gets, e.g. '{\"image\": 3, \"video\": 0}' "
                        "(vLLM's flag; only the image count is used; default image 255)")
    g.add_argument("--random-mm-bucket-config", default=None, metavar="DICT",
                   help="--scenario random-mm: image sizes and their probabilities, {(height, width, 1): p, ...} "
                        "(vLLM's flag; num_frames must be 1: images only; default {(256, 256, 1): 0.5, "
                        "(720, 1280, 1): 0.5})")
    g.add_argument("--num-warm", type=int, default=3, help="warm runs after the one cold run")
    g.add_argument("--percentile-metrics", type=_latency_metrics, default=None, metavar="ttft,tpot,itl,e2el",
                   help="--scenario concurrency / random-mm: the latencies whose percentiles the table reports (vLLM's "
                        "flag; default ttft,tpot,itl; e2el: request sent -> its last token)")
    g.add_argument("--metric-percentiles", type=_percentiles, default=None, metavar="Q[,Q...]",
                   help="the percentiles of --percentile-metrics, in (0, 100] (vLLM's flag; default 99; 50: the "
                        "median)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="accepted for vLLM's bench serve: every run here forces its output length anyway")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts (and sampling seeds)")
    g.add_argument("--name", default=None, help="result file name without .json (default: model-dtype-scenario-time); "
                   "vLLM's --result-filename NAME.json is taken as --name NAME")
    g.add_argument("--result-filename", default=None, metavar="NAME.json",
                   help="vLLM's spelling of --name: the result file's name in --output-dir (--result-dir)")
    g.add_argument("--output-dir", "--result-dir", default=os.path.join("benchmarks", "results"),
                   help="where the result file goes (default benchmarks/results)")
    g.add_argument("--save-result", action="store_true",
                   help="accepted for vLLM's bench serve: the result file is always written")
    g.add_argument("--commit", default=None, help="record this commit when the tree is not a git checkout")
    g.add_argument("--baseline", type=_str_list, default=[], metavar="hf[,hf-static]",
                   help="also run transformers generate on the same model and prompts: hf (plain generate) "
                        "and/or hf-static (static cache + transformers' own compile)")
    g.add_argument("--baseline-num-warm", type=int, default=None, help="warm runs of the baseline (default --num-warm)")
    g.add_argument("--baseline-max-concurrency", type=int, default=None,
                   help="skip baseline configurations above this concurrency")
    g.add_argument("--base-url", default=None, help="measure a running server (streaming /v1/completions)")
    g.add_argument("--server-model", default=None, help="model name to send to the server (default: its first)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--prompt-vocab", type=int, default=None,
                   help="random prompt ids are drawn from [0, N) (default: the model's vocabulary; 10000 "
                        "against a server whose config is not given)")
    g.add_argument("--profile", action="store_true",
                   help="after the measured runs, profile a few decode steps per decode / concurrency "
                        "configuration (torch.profiler, CUDA kernels): <output-dir>/<name>.profile.json")
    g.add_argument("--profile-steps", type=int, default=20, help="engine steps profiled per configuration")
    g.add_argument("--profile-trace", action="store_true",
                   help="with --profile, also keep each configuration's profiled decode steps as a chrome trace "
                        "(<output-dir>/<--name or profile>-<scenario>-c<C>.trace.json.gz; chrome://tracing, "
                        "ui.perfetto.dev)")
    g.add_argument("--kernel-iters", type=int, default=20,
                   help="--scenario kernels: timed calls per kernel (the median is reported)")
    g.add_argument("--kernel-ref-iters", type=int, default=5, help="--scenario kernels: timed reference calls")
    g.add_argument("--kernels", type=_str_list, default=None, metavar="NAME[,NAME]",
                   help="--scenario kernels: only these (gdn_chunk, gdn_decode, conv_decode, conv_prefill, moe)")
    g.add_argument("--no-limits", action="store_true", help="do not measure copy bandwidth / matmul rate")
    g.add_argument("--limit-copy-mib", type=int, default=None, help="copy test buffer (default 1024 GPU, 32 CPU)")
    g.add_argument("--limit-matmul-n", type=int, default=None, help="matmul test size (default 8192 GPU, 256 CPU)")
    g.add_argument("--limit-iters", type=int, default=None, help="timed repetitions (default 20 GPU, 5 CPU)")


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    from voltllm.cli_args import add_engine_args

    p = subparsers.add_parser("bench", help=help, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="model path (HF directory or .gguf file)")
    add_bench_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_bench)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """`voltllm bench ARGS` as a function (records argv as the command)."""
    p = argparse.ArgumentParser(prog="voltllm")
    add_parser(p.add_subparsers(dest="command", required=True), "bench")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(["bench"] + argv)
    args.bench_argv = ["voltllm", "bench"] + argv
    return run_bench(args)


# -- limits -----------------------------------------------------------------------------------------
def _decode_context(plan: Plan) -> float:
    """Mean context length over a request's decode steps."""
    return plan.input_len + plan.output_len / 2


def attach_limits(rows: list[dict], plans: list[Plan], cost: Optional[L.ModelCost],
                  dev: Optional[L.DeviceLimits], img_cost: Optional[dict] = None) -> dict:
    """Fill each row's limit and ratio (measured / limit; limit / measured for times) and build `limit`.
    random-mm (img_cost: bench/images.py image_cost): the prompt counts its mean image tokens, TTFT at C = 1 adds the
    images' tower FLOPs to the prefill's, and the tower's time per image is held to its FLOPs / matmul rate."""
    out: dict[str, Any] = {"copy_GBps": dev.copy_GBps if dev else None,
                           "matmul_TFLOPs": dev.matmul_TFLOPs if dev else None,
                           "decode_limit_tok_s": None, "ratio": None}
    if img_cost is not None:
        out["image_cost"] = img_cost
    if dev is None or cost is None:
        return out
    decode_plan = next((p for p in plans if p.scenario == "decode"), Plan("decode", 1, 512, 256))
    ctx = _decode_context(decode_plan)
    out["decode_limit_tok_s"] = L.decode_limit_tok_s(cost, dev, 1, ctx)
    out["decode_context_len"] = ctx
    out["decode_bytes_per_step"] = cost.decode_bytes_per_step(1, ctx)
    conc_limit, conc_ratio = {}, {}
    for row in rows:
        metric = row["metric"]
        plan = Plan(row["scenario"], row["concurrency"], row["input_len"], row["output_len"],
                    row.get("range_ratio", 0.0))
        limit = None
        if row["scenario"] == IMAGE_SCENARIO:  # (the row carries its limit; the headline keys are the text scenarios')
            limit = _image_row_limit(metric, plan, cost, dev, img_cost)
            if limit is not None:
                row["limit"] = limit
                row["ratio"] = limit / row["median"] if metric.endswith("_ms") else row["median"] / limit
            continue
        if metric == "pure_decode_tok_s":
            limit = L.decode_limit_tok_s(cost, dev, 1, _decode_context(plan))
        elif metric == "concurrent_decode_tok_s":
            limit = L.decode_limit_tok_s(cost, dev, plan.concurrency, _decode_context(plan), roofline=True)
            conc_limit[str(plan.concurrency)] = limit
        elif metric == "prefill_tok_s" and plan.scenario == "prefill":  # (one prompt: the prefix scenarios' vary)
            limit = L.prefill_limit_tok_s(cost, dev, plan.input_len)
            out["prefill_limit_tok_s"] = limit
        elif metric == "ttft_ms" and plan.scenario == "prefill":
            limit = cost.prefill_flops(plan.input_len) / (dev.matmul_TFLOPs * 1e12) * 1e3
        if limit is None:
            continue
        row["limit"] = limit
        row["ratio"] = limit / row["median"] if metric.endswith("_ms") else row["median"] / limit
        if metric == "pure_decode_tok_s" and plan == decode_plan:
            out["ratio"] = row["ratio"]
        elif metric == "prefill_tok_s" and plan.scenario == "prefill":
            out["prefill_ratio"] = row["ratio"]
        elif metric == "concurrent_decode_tok_s":
            conc_ratio[str(plan.concurrency)] = row["ratio"]
    if conc_limit:
        out["concurrent_decode_limit_tok_s"] = conc_limit
        out["concurrent_decode_ratio"] = conc_ratio
    return out


def _image_row_limit(metric: str, plan: Plan, cost: L.ModelCost, dev: L.DeviceLimits, img_cost: Optional[dict]
                     ) -> Optional[float]:
    """A random-mm row's limit at the mean request: text + mean images x mean prompt tokens per image."""
    if img_cost is None:
        return None
    images = img_cost["images_per_request"]
    prompt = plan.input_len + images * img_cost["prompt_tokens_per_image"]
    rate = dev.matmul_TFLOPs * 1e12
    if metric == "ttft_ms" and plan.concurrency == 1:
        return (cost.prefill_flops(round(prompt)) + images * img_cost["tower_flops_per_image"]) / rate * 1e3
    if metric == "vision_tower_ms":
        return img_cost["tower_flops_per_image"] / rate * 1e3
    if metric == "concurrent_decode_tok_s":
        return L.decode_limit_tok_s(cost, dev, plan.concurrency, prompt + plan.output_len / 2, roofline=True)
    return None


def _measure(args: argparse.Namespace, device: Any, dtype: Any) -> Optional[L.DeviceLimits]:
    import torch

    if args.no_limits:
        return None
    dev = torch.device(device)
    logger.info("measuring copy bandwidth and matmul rate on %s", dev)
    try:
        d = L.measure_device(dev, dtype, args.limit_copy_mib, args.limit_matmul_n, args.limit_iters)
    except torch.cuda.OutOfMemoryError:
        logger.warning("not enough free memory for the limit measurement (a server on this GPU?); "
                       "retrying at 256 MiB / 4096")
        torch.cuda.empty_cache()
        d = L.measure_device(dev, dtype, 256, 4096, args.limit_iters)
    logger.info("copy %.0f GB/s (read + write), %s matmul %.1f TFLOP/s", d.copy_GBps, d.matmul_dtype,
                d.matmul_TFLOPs)
    return d


# -- the command ------------------------------------------------------------------------------------
def resolve_scenario(scenario: Optional[str], dataset_name: Optional[str]) -> str:
    """--scenario, or the one vLLM's --dataset-name stands for (default decode); the two must agree when both are
    given."""
    named = DATASET_SCENARIOS.get(dataset_name) if dataset_name is not None else None
    if scenario is not None and named is not None and scenario != named:
        raise ConfigError(f"--dataset-name {dataset_name} is --scenario {named}, not --scenario {scenario}: give one")
    return scenario or named or "decode"


def result_name(name: Optional[str], result_filename: Optional[str]) -> Optional[str]:
    """--name, or vLLM's --result-filename without its .json (both given must agree)."""
    if result_filename is None:
        return name
    stem = result_filename[:-5] if result_filename.endswith(".json") else result_filename
    if not stem or os.sep in stem:
        raise ConfigError(f"--result-filename {result_filename!r}: a file name (the directory is --result-dir)")
    if name is not None and name != stem:
        raise ConfigError(f"--name {name} and --result-filename {result_filename} name different files: give one")
    return stem


def run_bench(args: argparse.Namespace) -> int:
    from voltllm.bench.shapes import materialize

    args.scenario = resolve_scenario(args.scenario, getattr(args, "dataset_name", None))
    args.name = result_name(args.name, getattr(args, "result_filename", None))
    given = getattr(args, "percentile_metrics", None), getattr(args, "metric_percentiles", None)
    args.percentiles = (given[0] or DEFAULT_PERCENTILES[0], given[1] or DEFAULT_PERCENTILES[1])

    if args.scenario == "kernels":
        from voltllm.bench.kernel_timings import run_kernels_scenario

        return run_kernels_scenario(args)
    if args.num_warm < 1:
        raise ValueError("--num-warm must be >= 1")
    if args.profile_trace and not args.profile:
        raise ValueError("--profile-trace keeps the traces of --profile: add --profile")
    if args.profile and (args.base_url or args.profile_steps < 1):
        raise ValueError("--profile runs torch.profiler in this process (not with --base-url) over "
                         "--profile-steps >= 1 steps")
    spec = cache_spec(args)
    if spec is not None and (args.baseline or args.profile):
        raise ConfigError(f"--scenario {args.scenario} measures voltllm's prefix cache: --baseline (transformers has "
                          "none) and --profile (decode steps) run with the other scenarios")
    images = image_spec(args)
    if images is not None and (args.baseline or args.profile):
        raise ConfigError("--scenario random-mm sends images: --baseline (transformers' generate is given token ids "
                          "only) and --profile (decode steps) run with the other scenarios")
    streamed = None if spec is not None else args.num_prompts  # (prefix: its request set's count, in spec)
    plans = make_plans(args.scenario, args.concurrency, args.input_len, args.output_len, args.random_range_ratio,
                       args.request_rate, args.burstiness, spec, images, streamed)
    if args.baseline and (args.random_range_ratio or math.isfinite(args.request_rate) or streamed is not None):
        raise ValueError("--baseline runs transformers generate on one batch of equal lengths sent together: "
                         "drop --random-range-ratio, --request-rate and --num-prompts")
    with tempfile.TemporaryDirectory(prefix="voltllm-bench-") as tmp:
        shape = None
        if args.random_weights:
            path = materialize(args.random_weights, tmp)
            shape = args.random_weights if path.startswith(tmp) else None
            args.model_flag, args.model, args.load_format = path, None, "dummy"
        if args.base_url:
            if args.baseline:
                raise ValueError("--baseline runs transformers in this process; use it without --base-url")
            report = _run_client(args, plans, shape)
        else:
            report = _run_inprocess(args, plans, shape)
    profiles = report.pop("profile_data", None)
    ordered = R.finish(report, args, _default_name(report, args))
    name = ordered["name"]
    out_path = R.write_json(ordered, args.output_dir, f"{name}.json")
    profile_path = None
    if profiles is not None:
        from voltllm.bench.profile import profile_file

        profile_path = R.write_json(profile_file(ordered, profiles), args.output_dir, f"{name}.profile.json")
    print(format_report(ordered))
    if profiles is not None:
        from voltllm.bench.profile import format_profiles

        print()
        print(format_profiles(profiles))
    print(f"\nwrote {out_path}" + (f" and {profile_path}" if profile_path else ""))
    return 0


def _workload_flags(args: argparse.Namespace) -> dict:
    """How the concurrency scenario's requests were shaped, for the result file (JSON has no infinity); the prefix-cache
    scenarios' request set."""
    out = {"random_range_ratio": args.random_range_ratio, "request_rate": rate_json(args.request_rate),
           "burstiness": args.burstiness}
    metrics, qs = getattr(args, "percentiles", DEFAULT_PERCENTILES)
    out.update(percentile_metrics=list(metrics), metric_percentiles=list(qs))
    spec = cache_spec(args)
    if spec is not None:
        out["workload"] = spec.describe()
    elif args.num_prompts is not None:  # (the concurrency scenario's requests per run, at most C in flight)
        out["num_prompts"] = args.num_prompts
    images = image_spec(args)
    if images is not None:
        out["random_mm"] = images.describe()
    return out


_IMAGE_FLAGS = ("random_mm_base_items_per_request", "random_mm_num_mm_items_range_ratio",
                "random_mm_limit_mm_per_prompt", "random_mm_bucket_config")


def image_spec(args: argparse.Namespace) -> Optional[RandomMM]:
    """The images of --scenario random-mm from its flags (None for the other scenarios); a --random-mm-* flag given
    with another scenario is refused."""
    given = [f"--{dest.replace('_', '-')}" for dest in _IMAGE_FLAGS if getattr(args, dest, None) is not None]
    if args.scenario != IMAGE_SCENARIO:
        if given:
            raise ConfigError(f"{', '.join(given)} shape the images of --scenario random-mm, not --scenario "
                              f"{args.scenario}")
        return None
    return random_mm(args.random_mm_base_items_per_request, args.random_mm_num_mm_items_range_ratio,
                     args.random_mm_limit_mm_per_prompt, args.random_mm_bucket_config)


_PREFIX_FLAGS = {"prefix_repetition_prefix_len": "prefix_len",
                 "prefix_repetition_suffix_len": "suffix_len", "prefix_repetition_num_prefixes": "num_prefixes",
                 "prefix_repetition_output_len": "output_len"}
_MULTI_TURN_FLAGS = {"multi_turn_num_conversations": "num_conversations", "multi_turn_num_turns": "num_turns",
                     "multi_turn_input_len": "input_len", "multi_turn_output_len": "output_len"}


def cache_spec(args: argparse.Namespace) -> Optional[PrefixRepetition | MultiTurn]:
    """The request set of --scenario prefix / multi-turn from their flags (None for the other scenarios); a flag of
    one of them given with another scenario is refused."""
    def given(flags: dict) -> dict:
        return {field: getattr(args, dest) for dest, field in flags.items() if getattr(args, dest) is not None}

    prefix, multi = given(_PREFIX_FLAGS), given(_MULTI_TURN_FLAGS)
    if args.num_prompts is not None and args.scenario == "prefix":  # (the concurrency scenario's: make_plans)
        prefix["num_prompts"] = args.num_prompts
    if args.num_prompts is not None and args.scenario == "multi-turn":
        raise ConfigError("--num-prompts does not apply to --scenario multi-turn: its requests are "
                          "--multi-turn-num-conversations x --multi-turn-num-turns")
    if args.prefix_repetition_reuse_prefixes:
        prefix["reuse_prefixes"] = True
    for scenario, flags, table in (("prefix", prefix, _PREFIX_FLAGS), ("multi-turn", multi, _MULTI_TURN_FLAGS)):
        if flags and args.scenario != scenario:
            names = [f"--{dest.replace('_', '-')}" for dest, field in table.items() if field in flags]
            names += ["--prefix-repetition-reuse-prefixes"] if "reuse_prefixes" in flags else []
            raise ConfigError(f"{', '.join(names)} shape the requests of --scenario {scenario}, not --scenario "
                              f"{args.scenario}")
    if args.scenario == "prefix":
        return PrefixRepetition(**prefix)
    if args.scenario == "multi-turn":
        return MultiTurn(**multi)
    return None


def _default_name(report: dict, args: argparse.Namespace) -> str:
    model = report["model"]
    label = model.get("shape") or os.path.basename(str(model.get("source") or "server").rstrip("/"))
    label = label.replace(".gguf", "")
    where = "server-" if args.base_url else ""
    return f"{where}{label}-{model.get('dtype')}-{args.scenario}-{time.strftime('%Y%m%d-%H%M%S')}"


def _image_plans(plans: list[Plan], hf_config: Any, processor: Any, image_limit: int, limit_name: str
                 ) -> tuple[list[Plan], dict]:
    """random-mm's plans with the model's vision token ids, and what an image costs (bench/images.py image_cost);
    ConfigError when a request could get more images than `image_limit` allows."""
    import dataclasses

    from voltllm.bench.images import bucket_grids, image_cost, image_tokens_of

    spec = plans[0].images
    most = spec.items_range[1]
    if most > image_limit:
        raise ConfigError(f"--scenario random-mm gives a request up to {most} images, more than {limit_name} image "
                          f"{image_limit}: lower --random-mm-base-items-per-request / --random-mm-limit-mm-per-prompt")
    tokens = image_tokens_of(hf_config)
    cost = image_cost(spec, bucket_grids(processor, spec), hf_config.vision_config, tokens)
    return [dataclasses.replace(p, image_tokens=tokens) for p in plans], cost


def _longest_image_request(plan: Plan, cost: dict) -> int:
    """Tokens of random-mm's longest possible request: the longest text, the most images of the largest bucket, the
    longest answer."""
    from voltllm.bench.inprocess import length_range

    per_image = max(b["tokens"] for b in cost["buckets"].values()) + len(plan.image_tokens.placeholder) - 1
    text = length_range(plan.input_len, plan.range_ratio)[1] if plan.range_ratio else plan.input_len
    out = length_range(plan.output_len, plan.range_ratio)[1] if plan.range_ratio else plan.output_len
    return text + plan.images.items_range[1] * per_image + out


def _client_images(args: argparse.Namespace, model_path: Optional[str], hf_config: Any, plans: list[Plan]
                   ) -> tuple[list[Plan], dict, Any]:
    """random-mm against a server: the model's image processor (image tokens per image, the limit's tower FLOPs)
    and tokenizer (the text ids -> the chat message's text), from the model the bench is given."""
    from voltllm.multimodal.config import resolve_multimodal
    from voltllm.multimodal.processor import ImageProcessor
    from voltllm.multimodal.support import IMAGE_MODEL_TYPES

    if hf_config is None:
        raise ConfigError("--scenario random-mm with --base-url needs the served model's path (MODEL or --model): "
                          "its tokenizer writes the text and its image processor counts the image tokens")
    if getattr(hf_config, "vision_config", None) is None or hf_config.model_type not in IMAGE_MODEL_TYPES:
        raise ConfigError(f"--scenario random-mm sends images: {model_path} is a text-only model (image input is "
                          f"built for {', '.join(IMAGE_MODEL_TYPES)} checkpoints with a vision_config)")
    from transformers import AutoTokenizer

    processor = ImageProcessor.from_model(model_path, hf_config,
                                          resolve_multimodal(mm_processor_kwargs=args.mm_processor_kwargs)
                                          .mm_processor_kwargs)
    plans, cost = _image_plans(plans, hf_config, processor, plans[0].images.image_limit,
                               "--random-mm-limit-mm-per-prompt")
    tok = AutoTokenizer.from_pretrained(args.tokenizer or model_path, trust_remote_code=args.trust_remote_code)
    return plans, cost, lambda ids: tok.decode(ids, skip_special_tokens=False)


def _run_inprocess(args: argparse.Namespace, plans: list[Plan], shape: Optional[str]) -> dict:
    from voltllm.bench.inprocess import InProcessRunner, free_device_memory
    from voltllm.cli_args import engine_args_from
    from voltllm.engine.core import EngineCore
    from voltllm.engine.data_parallel import require_one_engine

    ea = engine_args_from(args)
    ea.skip_tokenizer_init = True  # token-id prompts, no text: the bench never needs the tokenizer
    config = ea.create_engine_config()
    require_one_engine(config, "the in-process bench")
    if config.otlp_traces is not None:  # (its requests go to the engine core directly: none would be traced)
        raise ConfigError("--otlp-traces-endpoint: the in-process bench sends no request spans; trace a server "
                          "(voltllm serve --otlp-traces-endpoint ...) and measure it with voltllm bench --base-url")
    if config.model.runner != "generate":
        raise ConfigError("voltllm bench measures generation: a pooling (embedding) model (--runner pooling) "
                          "generates nothing to measure")
    device, dtype = config.device.device, config.model.dtype
    processor = img_cost = None
    if any(p.images is not None for p in plans):
        from voltllm.multimodal.processor import image_processor_for
        from voltllm.multimodal.support import image_input_refusal

        refusal = image_input_refusal(config)
        if refusal is not None:
            raise ConfigError(f"--scenario random-mm sends images, which this engine does not take: {refusal}")
        processor = image_processor_for(config)
        plans, img_cost = _image_plans(plans, config.model.hf_config, processor, config.multimodal.image_limit,
                                       "the engine's --limit-mm-per-prompt")
    max_c = max(p.concurrency for p in plans)
    if max_c > config.scheduler.max_num_seqs:
        logger.warning("concurrency %d > --max-num-seqs %d: requests will queue instead of starting together",
                       max_c, config.scheduler.max_num_seqs)
    dev_limits = _measure(args, device, dtype)
    t0 = time.monotonic()
    engine = EngineCore(config)
    start_s = time.monotonic() - t0
    longest = max((p.spec.max_request_len for p in plans if p.spec is not None), default=0)
    if img_cost is not None:
        longest = max(_longest_image_request(p, img_cost) for p in plans)
    if longest > engine.max_model_len:
        raise ConfigError(f"--scenario {args.scenario}: its longest request needs {longest} tokens (prompt and "
                          f"answer), more than --max-model-len {engine.max_model_len}: raise it or shorten the "
                          "requests")
    model = engine.runner.model
    cost = L.model_cost(model, config.model.hf_config, engine.runner.kv_dtype)
    if config.parallel.pipeline_parallel_size > 1:  # the stages run in turn: a step reads the whole model
        if not getattr(engine.runner, "keep_quantized", False) and engine.runner.kv_dtype == engine.runner.dtype:
            cost = L.meta_model_cost(config.model.hf_config, engine.runner.dtype)  # (its dense weights, all layers)
        else:
            logger.warning("-pp %d: the limits below count rank 0's stage (%d of the model's layers) only",
                           config.parallel.pipeline_parallel_size, len(model.layers))
    hf_config = config.model.hf_config
    vocab = args.prompt_vocab or int(getattr(getattr(hf_config, "text_config", None) or hf_config, "vocab_size"))
    # compiles are seen in this process only: with -tp N the engine runs in processes of its own
    observe = config.parallel.world_size == 1
    image_step = getattr(engine.runner, "image_step", None) if observe and processor is not None else None
    with CompileLog() as compiles, contextlib.ExitStack() as stack:
        from voltllm.bench.images import TowerTimer

        timer = stack.enter_context(TowerTimer(image_step, device)) if image_step is not None else None
        runner = InProcessRunner(engine, args.temperature, args.top_p, args.top_k, args.prompt_seed,
                                 compiles if observe else None, processor, timer)
        results = run_protocol(plans, runner, vocab, args.prompt_seed, args.num_warm)
    rows = table_rows(results, args.percentiles)
    limit = attach_limits(rows, plans, cost, dev_limits, img_cost)
    limit["model_cost"] = cost.to_json()
    if dev_limits:
        limit["device"] = dev_limits.to_json()
    profiles = None
    if args.profile:  # after every measured run, so that profiling cannot change the metrics above
        from voltllm.bench.profile import profile_plans

        trace_prefix = os.path.join(args.output_dir, args.name or "profile") if args.profile_trace else None
        profiles = profile_plans(engine, plans, vocab, args.prompt_seed, args.profile_steps,
                                 args.temperature, args.top_p, args.top_k, trace_prefix)
    report: dict[str, Any] = {
        "gpu": R.gpu_name(device), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"source": config.model.model, "shape": shape, "architecture": config.model.architecture,
                  "dtype": R.dtype_name(dtype), "load_format": config.model.load_format,
                  "params": sum(p.numel() for p in model.parameters()), "weight_bytes": cost.weight_bytes},
        "config": {"device": str(device), "tensor_parallel_size": config.parallel.tensor_parallel_size,
                   "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
                   "max_model_len": engine.max_model_len,  # (--max-model-len auto: as fitted)
                   "max_num_seqs": config.scheduler.max_num_seqs,
                   "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
                   "block_size": config.cache.block_size, "num_kv_blocks": engine.runner.num_blocks,
                   "kv_cache_dtype": config.cache.kv_cache_dtype, "enforce_eager": config.device.enforce_eager,
                   "prompt_graph_tokens": list(getattr(engine.runner.prompt_graphs, "sizes", []) or []),
                   "attention_backend": type(engine.runner.backend).__name__, "compat": config.device.compat,
                   "async_scheduling": config.scheduler.async_scheduling,
                   "enable_prefix_caching": config.cache.enable_prefix_caching,
                   "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                   "prompt_seed": args.prompt_seed, **_workload_flags(args),
                   "num_warm": args.num_warm, "engine_start_s": start_s},
        "metrics": {**headline(rows), "table": rows, "runs": [r.to_json() for r in results]},
        "limit": limit,
    }
    if profiles is not None:
        from voltllm.bench.profile import profile_summary

        report["profile"] = profile_summary(profiles)
        report["profile_data"] = profiles
    if args.baseline:
        model_path = config.model.model
        load_format = config.model.load_format
        del engine, runner, model
        free_device_memory(device)
        report["baseline"] = {v: _run_baseline(args, v, plans, rows, model_path, hf_config, load_format, dtype,
                                               device, vocab) for v in args.baseline}
    return report


def _run_baseline(args: argparse.Namespace, variant: str, plans: list[Plan], ours: list[dict], model_path: str,
                  hf_config: Any, load_format: str, dtype: Any, device: Any, vocab: int) -> dict:
    import transformers

    from voltllm.bench.hf_baseline import HFRunner, hf_plans, load_hf_model
    from voltllm.bench.inprocess import free_device_memory

    if variant not in ("hf", "hf-static"):
        raise ValueError(f"--baseline must be hf or hf-static, got {variant!r}")
    num_warm = args.baseline_num_warm or args.num_warm
    selected = hf_plans(plans, args.baseline_max_concurrency)
    try:
        model = load_hf_model(model_path, hf_config, load_format, dtype, device)
        runner = HFRunner(model, device, variant, args.temperature, args.top_p, args.top_k, args.prompt_seed)
        results = run_protocol(selected, runner, vocab, args.prompt_seed, num_warm, label=variant)
    except Exception as e:  # noqa: BLE001 - keep voltllm's numbers; record why the baseline has none
        logger.exception("transformers baseline %s failed", variant)
        return {"error": f"{type(e).__name__}: {e}", "transformers": transformers.__version__}
    finally:
        model = runner = None
        free_device_memory(device)
    rows = table_rows(results, args.percentiles)
    for row in rows:
        mine = find_row(ours, row["metric"], row["scenario"], row["concurrency"])
        row["ratio"] = speedup(mine["median"] if mine else None, row["median"], row["metric"])
    theirs, mine_hl = headline(rows), headline(ours)
    ratios: dict[str, Any] = {}
    for key in ("pure_decode_tok_s", "ttft_ms", "prefill_tok_s"):
        ratios[key] = speedup(mine_hl[key], theirs[key], key)
    for key in ("concurrent_decode_tok_s", "output_tok_s"):
        ratios[key] = {c: speedup(mine_hl[key].get(c), v, key) for c, v in theirs[key].items()}
    return {"variant": variant, "transformers": transformers.__version__,
            "weights": "random init of its own (same config)" if load_format == "dummy" else model_path,
            "num_warm": num_warm,
            "metrics": {**theirs, "table": rows, "runs": [r.to_json() for r in results]},
            "ratios_voltllm_over_hf": ratios}


def _server_dtype(flag: str, hf_config: Any) -> Any:
    """The dtype the server most likely runs (for the limit only): --dtype, else the config's half type."""
    import torch

    named = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "float": torch.float32, "float32": torch.float32}
    if flag in named:
        return named[flag]
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    cfg = named.get(cfg, cfg) if isinstance(cfg, str) else cfg
    return cfg if cfg in (torch.float16, torch.bfloat16) else torch.float16


def _run_client(args: argparse.Namespace, plans: list[Plan], shape: Optional[str]) -> dict:
    import torch

    from voltllm.bench.client import ClientRunner

    model_path = args.model_flag or args.model
    cost = hf_config = None
    dtype = None
    if model_path:
        from voltllm.model.loader import load_hf_config, resolve_model_for

        hf_config = load_hf_config(resolve_model_for(model_path, args), args.trust_remote_code)
        dtype = _server_dtype(args.dtype, hf_config)
        cost = L.meta_model_cost(hf_config, dtype)
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    dev_limits = _measure(args, device, dtype) if cost is not None else None
    vocab = args.prompt_vocab or (int(getattr(getattr(hf_config, "text_config", None) or hf_config, "vocab_size"))
                                  if hf_config is not None else 10000)
    decode = img_cost = None
    if any(p.images is not None for p in plans):
        plans, img_cost, decode = _client_images(args, model_path, hf_config, plans)
    runner = ClientRunner(args.base_url, args.server_model, args.temperature, args.top_p, args.top_k,
                          args.prompt_seed, args.api_key, decode_text=decode,
                          image_token_counts={k: b["tokens"] for k, b in img_cost["buckets"].items()}
                          if img_cost else None)
    try:
        server = runner.server_platform()
        results = run_protocol(plans, runner, vocab, args.prompt_seed, args.num_warm, label="server")
    finally:
        runner.close()
    rows = table_rows(results, args.percentiles)
    limit = attach_limits(rows, plans, cost, dev_limits, img_cost)
    if cost is not None:
        limit["model_cost"] = cost.to_json()
    if dev_limits:
        limit["device"] = dev_limits.to_json()
    return {
        "gpu": server.get("gpu") or R.gpu_name(device), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"source": model_path, "shape": shape, "server": args.base_url, "server_model": runner.model,
                  "dtype": server.get("dtype") or (R.dtype_name(dtype) if dtype is not None else None),
                  "weight_bytes": cost.weight_bytes if cost else None},
        "config": {"client_side_times": True, "temperature": args.temperature, "top_p": args.top_p,
                   "top_k": args.top_k, "prompt_seed": args.prompt_seed, **_workload_flags(args),
                   "num_warm": args.num_warm},
        "metrics": {**headline(rows), "table": rows, "runs": [r.to_json() for r in results]},
        "limit": limit,
    }
