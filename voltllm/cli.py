"""`voltllm serve | generate | bench | check` — thin dispatch; each command lives in its own module."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import re
import sys
from typing import Optional


def _generate(args: argparse.Namespace) -> int:
    from voltllm.cli_args import engine_args_from
    from voltllm.engine.frontend import generation_defaults
    from voltllm.entrypoints.llm import LLM
    from voltllm.sampling.params import SamplingParams

    ea = engine_args_from(args)
    llm = LLM(**{k: v for k, v in vars(ea).items()})
    m = llm.config.model
    # as the server: the generation config's defaults (and --override-generation-config) under the flags given;
    # greedy when neither sets a temperature
    values = {"temperature": 0.0, **generation_defaults(m.model, m.generation_config, m.override_generation_config)}
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    values.update({k: v for k, v in given.items() if v is not None})
    params = SamplingParams(**values, max_tokens=args.max_tokens, seed=args.sampling_seed)
    if args.chat:  # (one prompt: no progress bar)
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from voltllm import __version__
    from voltllm.cli_args import add_engine_args

    p = argparse.ArgumentParser(prog="voltllm", description="voltllm inference engine")
    p.add_argument("--version", action="version", version=f"voltllm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt (offline)")
    g.add_argument("prompt")
    g.add_argument("model", nargs="?", default=None, help="model path (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None,
                   help="default: the generation config's (--generation-config), else 0 (greedy)")
    g.add_argument("--top-p", type=float, default=None, help="default: the generation config's, else 1")
    g.add_argument("--top-k", type=int, default=None, help="default: the generation config's, else off")
    g.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(g)
    g.set_defaults(func=_generate)

    for name, module, help_ in (
        ("serve", "voltllm.entrypoints.openai.cli_serve", "OpenAI-compatible HTTP server"),
        ("bench", "voltllm.bench.cli", "measure decode / prefill / concurrency against the hardware limit"),
        ("run-batch", "voltllm.entrypoints.openai.run_batch", "run an OpenAI batch file (JSONL) offline"),
        ("check", "voltllm.check.cli", "acceleration report; --sm70 compiles the compat kernels for sm_70/75"),
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its package is absent
            found = False
        if not found:
            continue  # command not built in this version
        importlib.import_module(module).add_parser(sub, help_)
    return p


def dashed_flags(argv: list[str]) -> list[str]:
    """--max_model_len -> --max-model-len (vLLM's parser takes both spellings); values, and the JSON keys of a dotted
    flag (--compilation_config.cudagraph_mode), are left alone."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            flag, dot, keys = name.partition(".")
            arg = flag.replace("_", "-") + dot + keys + eq + value
        out.append(arg)
    return out


_DOTTED = re.compile(r"(--?[A-Za-z][\w-]*)\.([A-Za-z_][\w.]*)(?:=(.*))?", re.DOTALL)
_FLAG_ALIASES = {"-cc": "--compilation-config", "-ac": "--attention-config"}


def dotted_json_flags(argv: list[str]) -> list[str]:
    """vLLM's dotted form of JSON flags: `-cc.cudagraph_mode=NONE` or `--compilation-config.cudagraph_mode NONE`
    (`--speculative-config.method ngram`, ...) set one key of the flag's JSON object (each value read as JSON, else as
    a string); a flag's dotted keys are merged into one object, given after the other flags."""
    out: list[str] = []
    objects: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        match = _DOTTED.fullmatch(argv[i])
        if match is None:
            out.append(argv[i])
            i += 1
            continue
        flag, keys, value = match.group(1), match.group(2).split("."), match.group(3)
        if value is None:
            if i + 1 >= len(argv):
                out.append(argv[i])  # (argparse names it as unrecognized)
                break
            value, i = argv[i + 1], i + 1
        i += 1
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        node = objects.setdefault(_FLAG_ALIASES.get(flag, flag), {})
        for key in keys[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        node[keys[-1]] = parsed
    for flag, obj in objects.items():
        out += [flag, json.dumps(obj)]
    return out


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag the parser and its subcommands define."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= option_strings(sub)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    parser = build_parser()
    argv = dotted_json_flags(dashed_flags(sys.argv[1:] if argv is None else argv))
    from voltllm.cli_unbuilt import screen_unbuilt_flags

    # a known vLLM flag: why, not "unrecognized"; at the value voltllm matches anyway (--no-enable-lora): dropped
    argv, unbuilt = screen_unbuilt_flags(argv, option_strings(parser))
    if unbuilt is not None:
        print(f"voltllm: error: {unbuilt}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    from voltllm.config import ConfigError
    from voltllm.model.loader import ModelLoadError

    try:
        # (`voltllm bench --profile` is a switch of its own, not launch profiles)
        if getattr(args, "config", None) or isinstance(getattr(args, "profile", None), list):
            from voltllm.cli_config import merge_config

            args = merge_config(parser, args.command, args, argv)
        return int(args.func(args) or 0)
    except (ConfigError, ModelLoadError, ValueError) as e:
        print(f"voltllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
