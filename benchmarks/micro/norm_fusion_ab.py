"""Decode-batch steps with the RMSNorms and residual adds folded into the batch GEMMs against separate norm launches,
one engine, alternating runs.

    PYTHONPATH=$PWD python3 benchmarks/micro/norm_fusion_ab.py [--shape smollm2-135m-shape] [--concurrency 64]
        [--input-len 128] [--output-len 128] [--rounds 3]

Random weights of a named shape, prefix caching off. Modes: `tuned` (what start-up timing chose per row count,
voltllm.worker.norm_fusion_tuning), `separate` (no row count folded) and `folded` (every row count whose projections
all run the batch GEMM). Each switch captures the CUDA graphs again; each round runs every mode once (C requests of
fresh random prompts, forced output length). Prints per mode the median output tok/s and common-window decode tok/s
(the bench's definitions)."""
import argparse
import statistics
import tempfile

from voltllm.bench.inprocess import InProcessRunner, Plan, random_prompts
from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m-shape")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ea = EngineArgs(model=materialize(args.shape, tmp), load_format="dummy", dtype="float16",
                        max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.concurrency,
                        enable_prefix_caching=False)
        ea.skip_tokenizer_init = True
        from voltllm.engine.core import EngineCore

        eng = EngineCore(ea.create_engine_config())
        runner, model = eng.runner, eng.runner.model
        tuned = dict(model.batch_norm_fused)
        print(f"{args.shape}: start-up choice by row count {tuned}")
        modes = {"tuned": tuned, "separate": {r: False for r in tuned}, "folded": {r: True for r in tuned}}
        run = InProcessRunner(eng)
        vocab = eng.config.model.hf_config.vocab_size
        plan = Plan("concurrency", args.concurrency, args.input_len, args.output_len)
        results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        run(plan, "cold", random_prompts(args.concurrency, args.input_len, vocab, 0))
        for i in range(args.rounds):
            for name, choice in modes.items():
                model.batch_norm_fused = dict(choice)
                runner.capture_cuda_graphs()
                r = run(plan, f"{name}{i}", random_prompts(args.concurrency, args.input_len, vocab, 1 + i))
                m = r.metrics()
                results[name].append((m["output_tok_s"], m.get("concurrent_decode_tok_s") or 0.0))
        print(f" mode      output tok/s (median, {args.rounds} rounds)  window tok/s")
        for name, rs in results.items():
            print(f" {name:<9} {statistics.median(o for o, _ in rs):>12,.0f}  {statistics.median(w for _, w in rs):>12,.0f}"
                  f"   (all: {', '.join(f'{o:,.0f}' for o, _ in rs)})")


if __name__ == "__main__":
    main()
