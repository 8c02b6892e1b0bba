"""--enable-mfu-metrics on the GPU: the engine's estimated FLOPs and bytes per GPU over a concurrent run, as rates
beside the run's measured time, to set against the card's measured matmul rate and copy bandwidth (the bench's
DeviceLimits). Random weights at a named shape, one warm-up run, then the timed one.

    PYTHONPATH=$PWD python3 benchmarks/micro/mfu_check.py [--shape qwen3-8b-shape] [--concurrency 64]
"""
import argparse
import json
import sys
import tempfile
import time

import torch

from voltllm import LLM, SamplingParams
from voltllm.bench.shapes import materialize
from voltllm.perf_metrics import FLOPS, READ, WRITE


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b-shape")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: input + output + 16")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the concurrency")
    ap.add_argument("--seeded", action="store_true", help="a seed per request, as voltllm bench gives them")
    ap.add_argument("--min-tokens", action="store_true", help="min_tokens = the output length, as voltllm bench asks")
    ap.add_argument("--compile-log", action="store_true", help="the timed run inside voltllm bench's CompileLog")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = materialize(args.shape, tempfile.mkdtemp(prefix="mfu-"))
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="float16", enable_mfu_metrics=True,
              max_num_seqs=args.max_num_seqs or args.concurrency,
              max_model_len=args.max_model_len or args.input_len + args.output_len + 16, seed=0)
    gen = torch.Generator().manual_seed(0)

    def draw() -> list:  # (fresh prompts per run: the same ones again would hit the prefix cache)
        return [{"prompt_token_ids": torch.randint(0, 256, (args.input_len,), generator=gen).tolist()}
                for _ in range(args.concurrency)]

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    if args.seeded or args.min_tokens:
        sp = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                             seed=i if args.seeded else None, min_tokens=args.output_len if args.min_tokens else 0)
              for i in range(args.concurrency)]
    llm.generate(draw(), sp, use_tqdm=False)  # warm-up
    before = llm.engine.stats().extra
    import contextlib

    from voltllm.bench.compiles import CompileLog

    prompts = draw()
    with CompileLog() if args.compile_log else contextlib.nullcontext():
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)  # (generate returns once every token is on the host)
        dt = time.perf_counter() - t0
    after = llm.engine.stats().extra
    flops = after[FLOPS] - before[FLOPS]
    moved = after[READ] + after[WRITE] - before[READ] - before[WRITE]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    row = {"shape": args.shape, "gpu": gpu, "concurrency": args.concurrency, "max_model_len": args.max_model_len,
           "max_num_seqs": args.max_num_seqs,
           "input_len": args.input_len, "output_len": args.output_len, "seconds": dt,
           "output_tok_s": args.concurrency * args.output_len / dt, "estimated_TFLOPs": flops / dt / 1e12,
           "estimated_GBps": moved / dt / 1e9, "estimated_flops": flops, "estimated_bytes": moved}
    print(json.dumps(row))
    print(f"{dt:.3f} s, {row['output_tok_s']:.0f} output tok/s: estimated {row['estimated_TFLOPs']:.1f} TF/s and "
          f"{row['estimated_GBps']:.0f} GB/s per GPU")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
