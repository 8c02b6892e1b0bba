"""`voltllm serve --config FILE.yaml`: flags from a YAML mapping, as vLLM's `--config` (keys are flag names with
dashes or underscores; the command line wins over the file).

A key becomes its flag: `true` -> `--key`, `false` -> `--no-key` where the flag has that form (else left out: off is
the default), a list -> `--key a b`, a mapping -> `--key '<JSON>'`, anything else -> `--key value`; `model` is the
MODEL argument. The file's flags are parsed alone, and each value the command line left at its default takes the
file's.
"""
from __future__ import annotations

import argparse
import json
import os

from voltllm.config import ConfigError


def config_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags a YAML file stands for (`parser`: the subcommand's, to know which `--no-` forms exist)."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    known = {opt for action in parser._actions for opt in action.option_strings}
    argv: list[str] = []
    model: list[str] = []  # first: a list-valued flag before it would take it
    for key, value in data.items():
        name = str(key).replace("_", "-")
        if name == "model":
            model = [str(value)]
            continue
        flag = f"--{name}"
        if flag == "--config":
            raise ConfigError(f"--config {path}: a config file cannot name another one")
        if flag not in known:
            from voltllm.cli_unbuilt import unbuilt_setting_error

            why = unbuilt_setting_error(str(key))
            raise ConfigError(f"--config {path}: {why}" if why else f"--config {path}: unknown flag {key!r}")
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


def merge_config(parser: argparse.ArgumentParser, command: str, args: argparse.Namespace) -> argparse.Namespace:
    """`args` with each value the command line left at its default taken from `args.config`'s file."""
    sub = _subparser(parser, command)
    file_args = parser.parse_args([command, *config_argv(args.config, sub)])
    defaults = parser.parse_args([command])
    for dest, value in vars(file_args).items():
        if getattr(args, dest, None) == getattr(defaults, dest, None) and value != getattr(defaults, dest, None):
            setattr(args, dest, value)
    return args


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise ConfigError(f"no command {command!r}")
