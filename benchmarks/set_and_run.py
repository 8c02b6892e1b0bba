"""A / B runs in one device call: set module constants of voltllm, then run the voltllm CLI with the rest.

    python3 benchmarks/set_and_run.py voltllm.worker.skinny_tuning:BATCH_GATED=0 -- bench --random-weights ...

Each MODULE:NAME=INT before `--` must name an existing module-level constant (an experiment knob such as
`paged_decode.KV_PREFETCH_TOKENS`); it is set before the engine starts, so the run differs from the plain one in
that constant only. For measurements, not for serving (serving options are CLI flags).
"""
import importlib
import sys


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: set_and_run.py MODULE:NAME=INT ... -- <voltllm CLI arguments>")
    i = argv.index("--")
    for item in argv[:i]:
        target, _, value = item.partition("=")
        module, _, name = target.partition(":")
        mod = importlib.import_module(module)
        if not name or not hasattr(mod, name):
            raise SystemExit(f"{item}: {module} has no constant {name!r}")
        setattr(mod, name, int(value))
        print(f"set {module}.{name} = {int(value)}")
    from voltllm.cli import main as cli

    return cli(argv[i + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
