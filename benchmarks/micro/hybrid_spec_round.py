"""n-gram speculation on a hybrid target with random weights (no real checkpoint reaches the GPU machine): the plain
decode step against the speculative round (a verification of K drafts through the GDN checkpoints, then the accepted
state kept). Random weights repeat nothing the proposer could find, so the drafts here come from an oracle patched into
the scheduler's proposer: the plain run's own next tokens (all accepted, bar fp16 near-ties between the verification
and decode kernels) or wrong ones (none accepted: each round emits one token, so its time is the round's cost). From
the measured times it projects tokens / s at acceptance rates prompt lookup reaches on repetitive text: tokens per
round = (1 - a^(K+1)) / (1 - a).

    PYTHONPATH=$PWD python3 benchmarks/micro/hybrid_spec_round.py [--target qwen3.5-27b-shape] [-k 4] [--batch 1] \\
        [--dtype float16] [--out result.json]
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
from voltllm.engine.scheduler import Scheduler
from voltllm.engine.speculative import spec_allowed

_ORACLE: dict = {"table": {}, "wrong": False, "vocab": 1}


def _oracle_propose(self, req, max_new):
    """Scheduler._propose for this benchmark: the next tokens of the plain run (or each one plus 1: all wrong)."""
    k = spec_allowed(req, min(self.spec.num_speculative_tokens, max_new))
    full = _ORACLE["table"].get(tuple(req.prompt_token_ids))
    if k <= 0 or full is None:
        return []
    at = len(req.all_token_ids)
    return [(t + 1) % _ORACLE["vocab"] if _ORACLE["wrong"] else t for t in full[at:at + k]]


def _engine(target: str, spec, dtype: str, batch: int, k: int) -> LLM:
    # rows for batch * (K + 1) tokens: a verification replays a walks graph only when its tokens fit --max-num-seqs
    return LLM(target, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=2048,
               max_num_seqs=max(batch * (k + 1), 4), gpu_memory_utilization=0.85, speculative_config=spec)


def _measure(llm: LLM, prompts: list, output_len: int) -> tuple[dict, list]:
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    s0 = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    s1 = llm.engine.stats()
    steps = s1.step_counter - s0.step_counter - 1  # less the prompt step
    row = {"steps": steps, "wall_s": dt, "step_ms": 1e3 * dt / max(steps + 1, 1),
           "tok_s": len(prompts) * output_len / dt}
    if "spec_draft_tokens" in s1.extra:
        d = s1.extra["spec_draft_tokens"] - s0.extra["spec_draft_tokens"]
        a = s1.extra["spec_accepted_tokens"] - s0.extra["spec_accepted_tokens"]
        row.update(drafts=d, accepted=a, acceptance=a / max(d, 1))
    return row, [o.outputs[0].token_ids for o in outs]


def _free() -> None:
    """Give the GPU memory back after the caller's `del llm`: an engine is freed only once no name holds it, and the
    next engine's weights and KV budget need its memory (a 27B-shape engine fills --gpu-memory-utilization)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3.5-27b-shape")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    Scheduler._propose = _oracle_propose
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"target": args.target, "k": args.k, "dtype": args.dtype, "gpu": gpu, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        target = materialize(args.target, tmp)
        for b in (int(x) for x in args.batch.split(",")):
            llm = _engine(target, None, args.dtype, b, args.k)
            _ORACLE["vocab"] = vocab = llm.engine.vocab_size
            prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % min(30000, vocab - 100) + 100 for j in range(128)]}
                       for i in range(b)]
            _measure(llm, prompts, args.output_len)  # warm-up: Triton compiles, first-use allocations
            plain, tokens = _measure(llm, prompts, args.output_len)
            del llm
            _free()
            _ORACLE["table"] = {tuple(p["prompt_token_ids"]): list(p["prompt_token_ids"]) + list(t)
                                for p, t in zip(prompts, tokens)}
            llm = _engine(target, spec, args.dtype, b, args.k)
            _ORACLE["wrong"] = True
            _measure(llm, prompts, args.output_len)  # warm-up (the verification's kernels)
            wrong, _ = _measure(llm, prompts, args.output_len)
            _ORACLE["wrong"] = False
            right, spec_tokens = _measure(llm, prompts, args.output_len)
            graphs = llm.engine.runner.verify_graphs
            right["verify_graph_replays"] = graphs.replays if graphs is not None else 0
            del graphs, llm
            _free()
            same = sum(x == y for s, r in zip(spec_tokens, tokens) for x, y in zip(s, r)) / max(
                sum(len(s) for s in tokens), 1)
            proj = {f"{a:.1f}": round(b * (1 - a ** (args.k + 1)) / (1 - a) / (wrong["step_ms"] / 1e3), 1)
                    for a in (0.5, 0.7, 0.8, 0.9)}
            print(f"batch {b}: {args.target} plain {plain['step_ms']:.2f} ms/step ({plain['tok_s']:.1f} tok/s); "
                  f"round K={args.k} {wrong['step_ms']:.2f} ms (no draft accepted, {wrong['tok_s']:.1f} tok/s); "
                  f"all-correct drafts: acceptance {right['acceptance']:.2f}, {right['tok_s']:.1f} tok/s, "
                  f"tokens equal to plain {same:.3f}, verification graph replays {right['verify_graph_replays']}; "
                  f"projected tok/s at acceptance {proj}")
            result["rows"].append({"batch": b, "plain": plain, "round_rejected": wrong, "round_accepted": right,
                                   "same_tokens": same, "projected_tok_s": proj})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
