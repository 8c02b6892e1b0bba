"""--enforce-eager decode steps with cuBLAS (the engine's choice for decode batches since session 68) against the
tuned decode-batch Triton GEMMs (the choice before), in one engine; at one row, cuBLAS against the tuned one-row
GEMV (which an --enforce-eager engine still runs where its tuner times it faster).

    PYTHONPATH=$PWD python3 benchmarks/micro/eager_decode_gemm_ab.py [--shape qwen3-8b-shape] [--concurrency 1 16 64]

Random weights of a named shape (as `voltllm bench --random-weights`), an --enforce-eager engine; per concurrency C,
C requests of 128 random prompt tokens decode together, and the median step time over `--steps` steady decode steps
is taken first with every Triton choice cleared (cuBLAS), then after the tuner has set its Triton choices for exactly
that row count (the decode-batch tuner; at one row the GEMV tuner), then with cuBLAS again. An eager step's time is the
larger of the host's launches and the GPU's work, so the host cost of a Triton launch (results/session68/
eager-gemm-host-cost-h100.txt) shows here."""
import argparse
import random
import statistics
import tempfile
import time

from voltllm.bench.inprocess import build_engine, sampling_params
from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs
from voltllm.engine.types import EngineCoreRequest


def clear_choices(model) -> None:
    model.logits_batch = None
    model.logits_skinny = None
    for m in model.modules():
        if hasattr(m, "batch_gemm"):
            m.skinny, m.skinny_gated = None, False
            m.batch_gemm.clear()
            m.batch_gated.clear()
            m.batch_silu_fused.clear()


def step_us(eng, concurrency: int, steps: int, tag: str) -> float:
    vocab = eng.config.model.hf_config.vocab_size
    rng = random.Random(concurrency)
    for i in range(concurrency):
        ids = [rng.randrange(vocab) for _ in range(128)]
        eng.add_request(EngineCoreRequest(f"{tag}-{i}", ids, sampling_params(steps + 24, 0.0, 1.0, -1, i),
                                          arrival_time=time.monotonic()))
    for _ in range(8):  # the prompt step and a warm-up
        eng.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b-shape")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    from voltllm.worker.skinny_tuning import tune_batch_gemm, tune_skinny_gemm

    with tempfile.TemporaryDirectory() as tmp:
        path = materialize(args.shape, tmp)
        ea = EngineArgs(model=path, load_format="dummy", dtype="float16", max_model_len=2048, enforce_eager=True,
                        max_num_seqs=max(args.concurrency))
        ea.skip_tokenizer_init = True
        eng = build_engine(ea)
        model = eng.runner.model
        rows = []
        for c in args.concurrency:
            clear_choices(model)
            cublas = step_us(eng, c, args.steps, f"a{c}")
            if c == 1:
                tune_skinny_gemm(model)
            else:
                tune_batch_gemm(model, [c])
            triton = step_us(eng, c, args.steps, f"b{c}")
            clear_choices(model)
            again = step_us(eng, c, args.steps, f"c{c}")
            rows.append((c, cublas, triton, again))
    print(f"{args.shape} fp16 --enforce-eager, median decode step (us), {args.steps} steps")
    print(f"{'C':>4} {'cuBLAS':>9} {'Triton':>9} {'cuBLAS':>9} {'Triton/cuBLAS':>14}")
    for c, a, b, a2 in rows:
        print(f"{c:>4} {a:>9.0f} {b:>9.0f} {a2:>9.0f} {b / min(a, a2):>14.2f}")


if __name__ == "__main__":
    main()
