"""`voltllm serve --config FILE.yaml`: flags from a YAML mapping, as vLLM's `--config` (keys are flag names with
dashes or underscores; the command line wins over the file, the file over `--profile` launch profiles).

A key becomes its flag: `true` -> `--key`, `false` -> `--no-key` where the flag has that form (else left out: off is
the default), a list -> `--key a b`, a mapping -> `--key '<JSON>'`, anything else -> `--key value`; `model` is the
MODEL argument. The file's flags are parsed alone, and each flag the command line does not give takes the file's
value.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from voltllm.config import ConfigError


def add_config_args(g) -> None:
    """--config and --profile, into a command's parser or group (`voltllm serve`, `voltllm run-batch`)."""
    g.add_argument("--config", default=None, help="a YAML file of flags (vLLM's format: `max-model-len: 8192`); the "
                   "command line wins")
    g.add_argument("--profile", action="append", default=None, metavar="NAME",
                   help="a launch profile: a named set of flags (long-context, low-memory, qwen3-tools, "
                        "qwen3.5-tools, code-editing; docs/cli.md) or a YAML file of one; repeatable; the command line "
                        "and --config win")


def config_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags a YAML file stands for (`parser`: the subcommand's, to know which `--no-` forms exist)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    return mapping_argv(load_yaml(path, f"--config {path}"), parser, f"--config {path}")


def load_yaml(path: str, source: str):
    import yaml

    with open(path) as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None


def mapping_argv(data, parser: argparse.ArgumentParser, source: str, allow_model: bool = True) -> list[str]:
    """The flags a mapping of flag names to values stands for; `source` names it in errors."""
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of flag names to values, got {type(data).__name__}")
    known = {opt for action in parser._actions for opt in action.option_strings}
    argv: list[str] = []
    model: list[str] = []  # first: a list-valued flag before it would take it
    for key, value in data.items():
        name = str(key).replace("_", "-")
        if name == "model":
            if not allow_model:
                raise ConfigError(f"{source}: cannot name the model (give MODEL on the command line)")
            model = [str(value)]
            continue
        flag = f"--{name}"
        if flag in ("--config", "--profile"):
            raise ConfigError(f"{source}: cannot name {flag}")
        if flag not in known:
            from voltllm.cli_unbuilt import is_accepted_setting, unbuilt_setting_error

            if is_accepted_setting(str(key), value):  # an unbuilt feature left off (enable-lora: false)
                continue
            why = unbuilt_setting_error(str(key), value)
            raise ConfigError(f"{source}: {why}" if why else f"{source}: unknown flag {key!r}")
        if value is True:
            argv.append(flag)
        elif value is False:
            if f"--no-{name}" in known:
                argv.append(f"--no-{name}")
        elif isinstance(value, list):
            argv += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return model + argv


def merge_config(parser: argparse.ArgumentParser, command: str, args: argparse.Namespace,
                 argv: Optional[list[str]] = None) -> argparse.Namespace:
    """`args` (parsed from `argv`, the command line) with the flags it does not give taken from `args.config`'s
    file, then from the launch profiles of `--profile` (voltllm.profiles; a later profile over an earlier one).
    A flag counts as given when it is on the command line, even at its default value (`--kv-cache-dtype auto`
    over a profile's fp8). Without argv, a flag counts as given when its value differs from the default."""
    sub = _subparser(parser, command)
    sources: list[tuple[str, list[str]]] = []
    if getattr(args, "config", None):
        sources.append((f"--config {args.config}", config_argv(args.config, sub)))
    profiles = getattr(args, "profile", None)
    for name in reversed(profiles if isinstance(profiles, list) else []):
        from voltllm.profiles import load_profile

        profile = load_profile(name)
        sources.append((f"--profile {name}", mapping_argv(profile.flags, sub, f"--profile {name}",
                                                          allow_model=False)))
    if argv is None:
        defaults = _parse(parser, sub, [command])
        given = {d for d, v in vars(args).items() if v != getattr(defaults, d, None)}
    else:
        given = _given(parser, sub, argv)
    for source, source_argv in sources:
        source_args = _parse(parser, sub, [command, *source_argv])
        for dest in _given(parser, sub, [command, *source_argv]) - given:
            setattr(args, dest, getattr(source_args, dest))
            given.add(dest)
    return args


def _given(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations `argv` sets itself (the subcommand's defaults suppressed for one parse)."""
    return set(vars(_parse(parser, sub, argv, suppress_defaults=True))) - {"command", "func"}


def _parse(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, argv: list[str],
           suppress_defaults: bool = False) -> argparse.Namespace:
    """argv parsed with the subcommand's required flags optional (a file or profile gives some flags, not all: the
    command line's own parse has checked the required ones)."""
    saved = [(action, action.default, action.required) for action in sub._actions]
    try:
        for action, _, _ in saved:
            action.required = False
            if suppress_defaults:
                action.default = argparse.SUPPRESS
        return parser.parse_args(argv)
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise ConfigError(f"no command {command!r}")
