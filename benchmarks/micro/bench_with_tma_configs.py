"""`voltllm bench` with extra decode-batch TMA tiles offered to the start-up tuner (GPU; an A/B harness).

    PYTHONPATH=$PWD python3 benchmarks/micro/bench_with_tma_configs.py TILES.json|none [--set MODULE:NAME=VALUE ...]
        -- BENCH ARGS...

TILES.json is batch_gemm_wide_split.py's --json output ({shape: [[BLOCK_N, BLOCK_K, warps, stages, SPLIT_K,
true], ...]}); its tiles are appended to batch_gemm.TMA_CONFIGS for this process only, so the tuner times them
beside the production candidates at every shape and row count and the run measures what it then picks. `none`
runs the production candidates (the A side). --set assigns a module constant for this process (a Python literal,
e.g. voltllm.kernels.attention.paged_decode:EARLY_FIRST_TILE=True), for A/B runs of a switch that has no flag.
"""
import ast
import importlib
import json
import sys

from voltllm.kernels import batch_gemm


def main(argv):
    sep = argv.index("--")
    if argv[0] != "none":
        with open(argv[0]) as f:
            extra = {tuple(c) for tiles in json.load(f).values() for c in tiles}
        batch_gemm.TMA_CONFIGS = batch_gemm.TMA_CONFIGS + tuple(sorted(extra - set(batch_gemm.TMA_CONFIGS)))
        print("extra TMA tiles:", sorted(extra), flush=True)
    for i, a in enumerate(argv[:sep]):
        if a == "--set":
            target, value = argv[i + 1].split("=", 1)
            mod, name = target.split(":")
            setattr(importlib.import_module(mod), name, ast.literal_eval(value))
            print(f"set {mod}.{name} = {value}", flush=True)
    from voltllm.cli import main as cli_main

    return cli_main(["bench", *argv[sep + 1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
