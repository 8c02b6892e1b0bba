"""The host's phases of an engine step (HostPhaseTimer, as `bench --profile` reports them) at many running requests,
on a tiny random llama (default) or a named shape, on the CPU or a GPU.

    PYTHONPATH=$PWD:$PWD/tests python3 benchmarks/micro/host_phases.py [--requests 256] [--shape NAME] [--device cpu]

N requests of 40 random prompt tokens decode greedily; after four steps, `--steps` steps run with the phases timed.
On the CPU the forward dominates the wall time; the scheduling, preparation and update phases are what scale with
the number of running requests."""
import argparse
import random
import tempfile
import time

from voltllm.bench.inprocess import build_engine, sampling_params
from voltllm.bench.profile import HOST_PHASES, HostPhaseTimer
from voltllm.config import EngineArgs
from voltllm.engine.types import EngineCoreRequest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--shape", default=None, help="a named shape (random weights); default: a tiny random llama")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape:
            from voltllm.bench.shapes import materialize
            path, fmt = materialize(args.shape, tmp), "dummy"
        else:
            from tiny_models import make_model
            path, fmt = make_model(tmp, "llama"), "auto"
        ea = EngineArgs(model=path, load_format=fmt, device=args.device, max_model_len=512,
                        max_num_seqs=args.requests)
        ea.skip_tokenizer_init = True
        eng = build_engine(ea)
        vocab = eng.config.model.hf_config.vocab_size
        rng = random.Random(0)
        for i in range(args.requests):
            eng.add_request(EngineCoreRequest(f"r{i}", [rng.randrange(vocab) for _ in range(40)],
                                              sampling_params(args.steps + 64, 0.0, 1.0, -1, i),
                                              arrival_time=time.monotonic()))
        for _ in range(4):
            eng.step()
        with HostPhaseTimer(eng) as host:
            t = time.perf_counter()
            for _ in range(args.steps):
                eng.step()
            wall = time.perf_counter() - t
        per = host.per_step(wall, args.steps)
        print(f"{args.requests} requests, {args.shape or 'tiny llama'}, {args.device}: {wall / args.steps * 1e6:.0f} us "
              "per step; " + ", ".join(f"{k} {per[k]:.0f}" for k in HOST_PHASES) + " us")


if __name__ == "__main__":
    main()
