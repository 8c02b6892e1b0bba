"""MTP speculation's round cost on a hybrid target with random weights (no real checkpoint reaches the GPU machine;
--load-format dummy gives the MTP module random weights too): the plain decode step against the MTP round at
K = 1..3 (K - 1 chained MTP passes and the LM head K times, the verification of K drafts, the MTP pass over the
step's tokens after sampling). Random weights make the MTP's drafts wrong, so each round emits one token and its time
is the round's cost; a second run overwrites the MTP's drafts with the plain run's own tokens (every draft accepted,
the MTP's work unchanged) and checks the tokens equal plain decoding's. From the rejected round's time it projects
tokens / s at the acceptance the seed system reports for Qwen3.5-27B MTP (acceptance length 3.92 at K = 4):
tokens per round = (1 - a^(K+1)) / (1 - a).

    PYTHONPATH=$PWD python3 benchmarks/micro/mtp_round.py [--target qwen3.5-27b-shape] [-k 1,2,3] [--batch 1] \\
        [--dtype float16] [--out result.json]
"""
import argparse
import json
import sys
import tempfile

import torch

from hybrid_spec_round import _engine, _free, _measure  # (this folder: the same engines and timed runs)
from voltllm.bench.shapes import materialize
from voltllm.worker.mtp_runner import MTPRunner

_ORACLE: dict = {"table": None}
_propose = MTPRunner.propose


def _oracle_propose(self, sched):
    """MTPRunner.propose, then (when an oracle table is set) its drafts replaced by the plain run's next tokens."""
    _propose(self, sched)
    table = _ORACLE["table"]
    if table is None or self._drafts is None:
        return
    for s in sched.scheduled:
        if s.spec_tokens:
            full = table[tuple(s.request.prompt_token_ids)]
            want = full[s.start + 1:s.start + 1 + len(s.spec_tokens)]
            col = self._prob_rows[s.request.request_id]
            self._drafts[:len(want), col] = torch.tensor(want, device=self._drafts.device)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3.5-27b-shape")
    ap.add_argument("-k", default="1,2,3")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    MTPRunner.propose = _oracle_propose
    ks = [int(x) for x in args.k.split(",")]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"target": args.target, "dtype": args.dtype, "batch": args.batch, "gpu": gpu, "rows": []}
    b = args.batch
    with tempfile.TemporaryDirectory() as tmp:
        target = materialize(args.target, tmp)
        llm = _engine(target, None, args.dtype, b, max(ks))
        vocab = llm.engine.vocab_size
        prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % min(30000, vocab - 100) + 100 for j in range(128)]}
                   for i in range(b)]
        _measure(llm, prompts, args.output_len)  # warm-up
        plain, tokens = _measure(llm, prompts, args.output_len)
        del llm
        _free()
        table = {tuple(p["prompt_token_ids"]): list(p["prompt_token_ids"]) + list(t) for p, t in zip(prompts, tokens)}
        print(f"batch {b}: {args.target} plain {plain['step_ms']:.2f} ms/step ({plain['tok_s']:.1f} tok/s)")
        result["plain"] = plain
        for k in ks:
            llm = _engine(target, {"method": "mtp", "num_speculative_tokens": k}, args.dtype, b, k)
            _ORACLE["table"] = None
            _measure(llm, prompts, args.output_len)  # warm-up
            own, _ = _measure(llm, prompts, args.output_len)
            _ORACLE["table"] = table
            right, spec_tokens = _measure(llm, prompts, args.output_len)
            del llm
            _free()
            same = sum(x == y for s, r in zip(spec_tokens, tokens) for x, y in zip(s, r)) / max(
                sum(len(s) for s in tokens), 1)
            proj = {f"{a:.2f}": round(b * (1 - a ** (k + 1)) / (1 - a) / (own["step_ms"] / 1e3), 1)
                    for a in (0.5, 0.7, 0.8, 0.9)}
            print(f"  K={k}: round {own['step_ms']:.2f} ms with the MTP's own drafts (acceptance "
                  f"{own['acceptance']:.2f}, {own['tok_s']:.1f} tok/s; x{own['step_ms'] / plain['step_ms']:.2f} of "
                  f"a plain step); oracle drafts: acceptance {right['acceptance']:.2f}, {right['tok_s']:.1f} tok/s, "
                  f"tokens equal to plain {same:.3f}; projected tok/s at acceptance {proj}")
            result["rows"].append({"k": k, "round_own_drafts": own, "round_oracle_drafts": right, "same_tokens": same,
                                   "projected_tok_s": proj})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
