"""The compat route's prefill attention (bridge + efficient attention) with requests joined three ways (GPU only).

    PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/unit python3 benchmarks/micro/compat_prefill_join.py

`compat_backend.JOIN_REQUESTS` 0 (one request at a time), 1 (runs of consecutive equal requests) and 2 (one varlen
launch per workspace piece), for prompt steps of the 8B's and SmolLM2's heads: 64 equal 128-token prompts and 64
prompts of mixed lengths (32-256 tokens, some chunks over a prefix). Per step of one layer: the host's time to
issue the forward (wall clock, no sync inside) and the time to its completion (wall clock with a sync), median of 20
after warm-up; a prompt step runs this once per layer. Each join form's output is checked against JOIN 0's.
"""
import random
import statistics
import time

import torch
from _attention_interp_check import make_case
from voltllm.attention import compat_backend
from voltllm.attention.triton_backend import TritonAttentionBackend

HEADS = {"8b": (32, 8, 128), "smollm2": (9, 3, 64)}


def steps():
    rng = random.Random(0)
    mixed = []
    for _ in range(64):
        lq = rng.randint(32, 256)
        mixed.append((lq + (rng.choice((0, 0, 0, 512))), lq))  # a quarter are chunks over a 512-token prefix
    return {"64 x 128 equal": [(128, 128)] * 64, "64 mixed 32-256": mixed}


def time_forward(be, case, reps=20):
    issue, done = [], []
    for i in range(reps + 3):
        cache = case.kv_cache
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = be.forward(case.q, case.k, case.v, cache, case.meta, case.scale)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 3:
            issue.append((t1 - t0) * 1e6)
            done.append((t2 - t0) * 1e6)
    return statistics.median(issue), statistics.median(done), out


def main():
    print(f"{'heads':8} {'step':18} {'join':>4} {'launches':>8} {'issue us':>9} {'done us':>9} {'max diff':>9}")
    for name, (hq, hkv, d) in HEADS.items():
        for label, seqs in steps().items():
            case = make_case(seqs, hq, hkv, d, 16, torch.float16, device="cuda", seed=1)
            base = None
            for join in (0, 1, 2):
                compat_backend.JOIN_REQUESTS = join
                be = TritonAttentionBackend(use_tensor_cores=False, max_context=8192)
                issue, done, out = time_forward(be, case)
                launches = be.sdpa_prefill.launches // 23
                if base is None:
                    base = out.clone()
                diff = (out.float() - base.float()).abs().max().item()
                print(f"{name:8} {label:18} {join:>4} {launches:>8} {issue:>9.0f} {done:>9.0f} {diff:>9.2e}",
                      flush=True)


if __name__ == "__main__":
    main()
