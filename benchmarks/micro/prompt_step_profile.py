"""Where a dense model's prompt step spends its GPU time: C prompts of n tokens prefilled in one step (#4's 64 x 128
for the 8B shape), time to first token, then the step's kernels under torch.profiler.

    PYTHONPATH=$PWD python3 benchmarks/micro/prompt_step_profile.py [--shape qwen3-8b-shape] [--prompts 64x128]
        [--runs 3] [--top 20]

Random weights, fp16, prefix caching off. Prints the median / min time until all C prompts have their first token
(the first run warms up), then one such step's GPU kernel time by kernel, the largest --top, and the share of the
kernels whose names look like matrix products (cuBLAS / CUTLASS / nvjet / Triton GEMMs): the rest is what fusing
the prompt step's norms, RoPE, activation, KV writes and attention could still win."""
import argparse
import re
import statistics
import tempfile

from _micro_timing import first_tokens_ms, kernel_times_us

from voltllm.bench.shapes import materialize
from voltllm.config import EngineArgs

GEMM_NAME = re.compile(r"gemm|cutlass|nvjet|xmma|sm90_|sm80_|_matmul|batch_gemm|Kernel2", re.IGNORECASE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b-shape")
    ap.add_argument("--prompts", default="64x128", help="CxN: C prompts of N tokens")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: the timing part only (a smoke run of the script)")
    args = ap.parse_args()
    c, n = (int(v) for v in args.prompts.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        path = materialize(args.shape, tmp)
        ea = EngineArgs(model=path, load_format="dummy", dtype="float16", device=args.device, max_model_len=n + 256,
                        max_num_seqs=max(c, 1), max_num_batched_tokens=max(8192, c * n),
                        enable_prefix_caching=False, gpu_memory_utilization=0.85)
        ea.skip_tokenizer_init = True
        from voltllm.engine.core import EngineCore

        eng = EngineCore(ea.create_engine_config())
        vocab = eng.config.model.hf_config.vocab_size
        times = [first_tokens_ms(eng, vocab, n, c, f"run{i}") for i in range(args.runs + 1)][1:]
        print(f"{args.shape} fp16, {c} x {n} prompt tokens in one step: time to first token median "
              f"{statistics.median(times):.1f} ms, min {min(times):.1f} ms ({args.runs} runs)")
        if args.device != "cuda":
            return
        k = kernel_times_us(lambda: first_tokens_ms(eng, vocab, n, c, "profile"))
        total = sum(k.values())
        gemm = sum(us for name, us in k.items() if GEMM_NAME.search(name))
        print(f"profiled step: {total / 1e3:.2f} ms of GPU kernels, {gemm / 1e3:.2f} ms ({100 * gemm / total:.1f}%) "
              f"in kernels named like matrix products, {(total - gemm) / 1e3:.2f} ms in the rest; the largest:")
        for name, us in sorted(k.items(), key=lambda kv: -kv[1])[:args.top]:
            tag = "gemm" if GEMM_NAME.search(name) else "    "
            print(f"{us / 1e3:>9.3f} ms {100 * us / total:>5.1f}% {tag} {name}")


if __name__ == "__main__":
    main()
