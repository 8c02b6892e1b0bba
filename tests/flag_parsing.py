"""The engine flags as the command line parses them (voltllm.cli's spelling fixes first), for the flag tests."""
from __future__ import annotations

import argparse


def parse_engine_flags(*argv: str):
    """EngineArgs from a command line of MODEL and engine flags (underscores and dotted JSON keys as voltllm.cli
    takes them)."""
    from voltllm.cli import dashed_flags, dotted_json_flags
    from voltllm.cli_args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")
    add_engine_args(p)
    return engine_args_from(p.parse_args(dotted_json_flags(dashed_flags(list(argv)))))
