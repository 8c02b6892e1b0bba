"""`voltllm check [MODEL] [engine flags] [--json] [--generate N]` and `voltllm check --sm70`.

Without --sm70: resolve the configuration exactly as `voltllm serve` would (same engine flags), load the
model, optionally run one short request so that the counters and the compile cache show real use, and
print the acceleration report (voltllm.acceleration). Exit 0 when every route the configuration expects
is enabled, 1 when one is disabled (with --require-acceleration the configuration is refused first: exit 2).
--no-load prints the report predicted from the configuration alone (no weights are read).

With --sm70: the sm_70/sm_75 compile gate (voltllm.check.sm70_gate), which needs no GPU and no model; the
gate's own flags follow (--arch, --module, --jobs, --max-lines, --ptxas, --aligned).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    from voltllm.cli_args import add_engine_args

    p = subparsers.add_parser(
        "check", help=help,
        description="Print the acceleration report of a configuration (which kernel route each stage takes, "
                    "enabled / expected / why, call counters). --sm70 instead cross-compiles every compat-route "
                    "Triton kernel for sm_70 and sm_75 and rejects instructions those GPUs lack.")
    p.add_argument("model", nargs="?", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--sm70", action="store_true", help="run the sm_70/sm_75 compile gate instead (no GPU needed)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-load", action="store_true", help="predict the report from the configuration; load nothing")
    p.add_argument("--generate", type=int, default=8, metavar="N",
                   help="after loading, run one request of N tokens so counters and the compile cache show use "
                        "(0: none; default 8)")
    g = p.add_argument_group("compile gate (--sm70)")
    g.add_argument("--arch", type=int, action="append", help="compute capability (repeatable; default 70 and 75)")
    g.add_argument("--module", action="append", help="only kernels of this module (repeatable)")
    g.add_argument("--jobs", "-j", type=int, default=None, help="compile processes")
    g.add_argument("--max-lines", type=int, default=None, help="offending lines shown per failure")
    g.add_argument("--ptxas", choices=("cover", "all"), default=None,
                   help="which specs ptxas assembles (default cover: every kernel and instruction form once per arch)")
    g.add_argument("--aligned", action="store_true",
                   help="compile as the JIT specializes aligned tensors (pointer / stride arguments divisible by 16)")
    add_engine_args(p)
    p.set_defaults(func=run_check)
    return p


def gate_argv(args: argparse.Namespace) -> list[str]:
    argv: list[str] = []
    for a in args.arch or []:
        argv += ["--arch", str(a)]
    for m in args.module or []:
        argv += ["--module", m]
    if args.jobs is not None:
        argv += ["--jobs", str(args.jobs)]
    if args.max_lines is not None:
        argv += ["--max-lines", str(args.max_lines)]
    if args.ptxas is not None:
        argv += ["--ptxas", args.ptxas]
    if args.aligned:
        argv.append("--aligned")
    return argv


def run_check(args: argparse.Namespace) -> int:
    if args.sm70:
        from voltllm.check import sm70_gate

        return sm70_gate.main(gate_argv(args))
    from voltllm.acceleration import build_report, format_report, install_global_hooks, instrument
    from voltllm.cli_args import engine_args_from

    config = engine_args_from(args).create_engine_config()  # ConfigError (incl. --require-acceleration): exit 2
    if config.parallel.data_parallel_size > 1:  # (the engines share the configuration: the first one stands for all)
        print(f"voltllm check: --data-parallel-size {config.parallel.data_parallel_size}: checking engine 0 (on "
              f"{config.device.device}); the others run the same configuration on their own cards", file=sys.stderr)
    if args.no_load:
        report = build_report(config)
    else:
        install_global_hooks()  # before the engine: start-up compiles count in the compile-cache figures
        from voltllm.engine.core import EngineCore

        core = EngineCore(config)
        instrument(core.runner)
        if args.generate > 0:
            _run_one(core, args.generate)
        report = build_report(config, core.runner)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
    sys.stdout.flush()
    return 0 if report["ok"] else 1


def _run_one(core: Any, max_tokens: int) -> None:
    """One greedy request of token ids (no tokenizer needed), prompt long enough for a prefill step."""
    from voltllm.engine.types import EngineCoreRequest
    from voltllm.sampling.params import SamplingParams

    n = max(1, min(32, core.max_model_len - max_tokens - 1))
    max_tokens = max(1, min(max_tokens, core.max_model_len - n - 1))
    prompt = [(7 * i + 3) % max(2, core.vocab_size) for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id="voltllm-check", prompt_token_ids=prompt, sampling_params=params))
    steps = 0
    while core.has_unfinished_requests() and steps < 4 * max_tokens + 16:
        core.step()
        steps += 1
