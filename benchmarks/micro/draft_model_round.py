"""Draft-model speculation's round cost on the GPU, with random weights (no real checkpoint reaches the GPU machine):
the target's plain decode step against its speculative round with a draft shape beside it. Random weights agree on
nothing, so every round emits one token and its time is the round's cost (K draft steps, the draft beside the
verification, the target's K + 1 rows); the target as its own draft (same shape and seed: the same random weights)
accepts everything and shows the round at full acceptance. From the measured times it projects tokens / s at
acceptance rates a real draft reaches: tokens per round = (1 - a^(K+1)) / (1 - a).

    PYTHONPATH=$PWD python3 benchmarks/micro/draft_model_round.py [--target qwen3-8b-shape] \\
        [--draft qwen3-0.6b-shape] [-k 4] [--batch 1,16] [--dtype float16] [--out result.json]
"""
import argparse
import gc
import json
import sys
import tempfile
import time

import torch

from voltllm import LLM, SamplingParams
from voltllm.bench.shapes import materialize


def measure(target: str, spec, batch: int, dtype: str, output_len: int) -> dict:
    llm = LLM(target, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=2048,
              gpu_memory_utilization=0.85, speculative_config=spec)
    prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % 30000 + 100 for j in range(128)]} for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, sp)  # warm-up: Triton compiles, first-use allocations
    s0 = llm.engine.stats()
    t0 = time.perf_counter()
    llm.generate(prompts, sp)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    s1 = llm.engine.stats()
    steps = s1.step_counter - s0.step_counter - 1  # less the prompt step
    row = {"batch": batch, "steps": steps, "wall_s": dt, "step_ms": 1e3 * dt / max(steps + 1, 1),
           "tok_s": batch * output_len / dt}
    if spec is not None:
        d = s1.extra["spec_draft_tokens"] - s0.extra["spec_draft_tokens"]
        a = s1.extra["spec_accepted_tokens"] - s0.extra["spec_accepted_tokens"]
        row.update(drafts=d, accepted=a, acceptance=a / max(d, 1))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3-8b-shape")
    ap.add_argument("--draft", default="qwen3-0.6b-shape")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"target": args.target, "draft": args.draft, "k": args.k, "dtype": args.dtype,
              "gpu": torch.cuda.get_device_name(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = materialize(args.target, tmp), materialize(args.draft, tmp)
        for b in (int(x) for x in args.batch.split(",")):
            plain = measure(target, None, b, args.dtype, args.output_len)
            spec = measure(target, {"model": draft, "num_speculative_tokens": args.k}, b, args.dtype,
                           args.output_len)
            own = measure(draft, {"model": draft, "num_speculative_tokens": args.k}, b, args.dtype, args.output_len)
            own_plain = measure(draft, None, b, args.dtype, args.output_len)
            proj = {f"{a:.1f}": round(b * (1 - a ** (args.k + 1)) / (1 - a) / (spec["step_ms"] / 1e3), 1)
                    for a in (0.5, 0.7, 0.8, 0.9)}
            print(f"batch {b}: {args.target} plain {plain['step_ms']:.2f} ms/step ({plain['tok_s']:.0f} tok/s); "
                  f"round with {args.draft} K={args.k}: {spec['step_ms']:.2f} ms (acceptance "
                  f"{spec['acceptance']:.2f}); projected tok/s at acceptance {proj}")
            print(f"  {args.draft} as its own draft: round {own['step_ms']:.2f} ms, acceptance "
                  f"{own['acceptance']:.2f}, {own['tok_s']:.0f} tok/s vs plain {own_plain['step_ms']:.2f} ms/step, "
                  f"{own_plain['tok_s']:.0f} tok/s")
            result["rows"].append({"plain": plain, "spec": spec, "self_draft": own, "draft_plain": own_plain,
                                   "projected_tok_s": proj})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
