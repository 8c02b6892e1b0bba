"""Speculative decoding A/B on real text: the same greedy chat requests without and with --speculative-config (n-gram
drafts, or a draft model with --draft), one request at a time; prints tokens / s, steps and the drafts accepted, checks
the outputs are identical, and writes a JSON result. Each request runs once untimed first (compiles and start-up
tuning).

    PYTHONPATH=$PWD python3 benchmarks/micro/spec_decode_ab.py MODEL [--device cpu|cuda] [--dtype ...] [--compat ...] \\
        [--draft DRAFT_MODEL] [-k 5] [--out benchmarks/results/spec-decode-ab.json]

The requests are the kinds where prompt lookup pays (code edited and printed again, a counting list) and one where
it cannot (a one-sentence answer); a draft model that shares the target's training can draft all three.
"""
import argparse
import json
import sys
import time

from voltllm import LLM, SamplingParams

CODE = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n")
REQUESTS = {
    "code edit": f"Rename the function fibonacci to fib in this code and print the whole code again:\n\n{CODE}",
    "counting": "Write the numbers from 1 to 40 separated by commas.",
    "short answer": "What is the capital of France? Answer in one sentence.",
}


def spec_config(draft: str, k: int) -> dict:
    if draft:
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run(model: str, spec, device: str, dtype: str, compat: str, max_tokens: int) -> dict:
    llm = LLM(model, device=device, dtype=dtype, compat=compat, max_model_len=2048, speculative_config=spec)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    for text in REQUESTS.values():  # warm-up: each request once, so Triton compiles and tuning stay out of the timing
        llm.chat([{"role": "user", "content": text}], sp)
    rows = {}
    for name, text in REQUESTS.items():
        s0 = llm.engine.stats()
        t0 = time.perf_counter()
        out = llm.chat([{"role": "user", "content": text}], sp)[0].outputs[0]
        dt = time.perf_counter() - t0
        s1 = llm.engine.stats()
        rows[name] = {"tokens": len(out.token_ids), "tok_s": len(out.token_ids) / dt,
                      "steps": s1.step_counter - s0.step_counter, "token_ids": list(out.token_ids),
                      "drafts": s1.extra.get("spec_draft_tokens", 0) - s0.extra.get("spec_draft_tokens", 0),
                      "accepted": s1.extra.get("spec_accepted_tokens", 0) - s0.extra.get("spec_accepted_tokens", 0)}
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compat", default="auto")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--draft", default="", help="a draft model (path or .gguf) instead of n-gram drafts")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    plain = run(args.model, None, args.device, args.dtype, args.compat, args.max_tokens)
    config = spec_config(args.draft, args.num_speculative_tokens)
    spec = run(args.model, config, args.device, args.dtype, args.compat, args.max_tokens)
    print(f"{'request':<14} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} {'steps':>9} "
          f"{'accepted':>12} same")
    same_all = True
    for name in REQUESTS:
        a, b = plain[name], spec[name]
        same = a["token_ids"] == b["token_ids"]
        same_all &= same
        print(f"{name:<14} {b['tokens']:>6} {a['tok_s']:>11.1f} {b['tok_s']:>10.1f} {b['tok_s'] / a['tok_s']:>7.2f}x "
              f"{a['steps']:>4}->{b['steps']:<4} {b['accepted']:>5}/{b['drafts']:<6} {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"name": "spec-decode-ab", "commit": args.commit, "model": args.model, "device": args.device,
                       "dtype": args.dtype, "compat": args.compat, "speculative_config": config,
                       "command": "python3 benchmarks/micro/spec_decode_ab.py " + " ".join(argv),
                       "plain": plain, "spec": spec}, f, indent=1)
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
