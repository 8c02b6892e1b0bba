"""KV-cache capacity with a DFlash drafter: how many tokens the sized cache holds for a target with a 5-layer drafter
whose layers are all full attention, against the same drafter with Qwen3.6's layout (four sliding-window layers of
window 2,048, then one full layer: their K / V in per-request rings, worker/drafter_rings.py), each with the model
dtype's KV cache and with fp8_e4m3 (the drafter's caches follow --kv-cache-dtype). Random weights (--load-format
dummy; capacity does not depend on values), eager (no graphs), each engine in a process of its own (an engine
dropped in the same process left its weights to the next one's sizing).

    PYTHONPATH=$PWD:$PWD/benchmarks/micro python3 benchmarks/micro/dflash_kv_capacity.py [--target qwen3-8b-shape]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from dflash_round import write_drafter
from voltllm import LLM
from voltllm.bench.shapes import materialize


def _windowed(drafter: str, window: int) -> str:
    """The drafter's config with layer_types [sliding x (n - 1), full] and the window."""
    path = os.path.join(drafter, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    n = cfg["num_hidden_layers"]
    cfg.update(layer_types=["sliding_attention"] * (n - 1) + ["full_attention"], sliding_window=window,
               use_sliding_window=True)
    out = drafter + "-swa"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def _one(args, target: str, drafter: str, kv: str, name: str) -> int:
    llm = LLM(target, load_format="dummy", skip_tokenizer_init=True, dtype="float16", max_model_len=32768,
              max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.utilization, enforce_eager=True,
              kv_cache_dtype=kv, speculative_config={"method": "dflash", "model": drafter,
                                                     "num_speculative_tokens": args.k})
    r = llm.engine.runner
    d = r.draft
    print(json.dumps({"kv_cache_dtype": kv, "drafter": name, "blocks": r.num_blocks,
                      "tokens": r.num_blocks * r.block_size, "bytes_per_token": r.kv_block_bytes() // r.block_size,
                      "drafter_bytes_per_token": d.kv_block_bytes(r.block_size, r.kv_dtype) // r.block_size,
                      "ring_bytes": d.fixed_kv_bytes(r.block_size, r.kv_dtype) if hasattr(d, "fixed_kv_bytes") else 0}),
          flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3-8b-shape")
    ap.add_argument("-k", type=int, default=15)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--utilization", type=float, default=0.9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=4, metavar=("TARGET", "DRAFTER", "KV", "NAME"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return _one(args, *args.one)
    root = tempfile.mkdtemp(prefix="dflash-kv-")
    target = materialize(args.target, root)
    full = write_drafter(target, root, 5, 16)
    drafters = {"full": full, "swa": _windowed(full, args.window)}
    rows = []
    for kv in ("auto", "fp8_e4m3"):
        for name, drafter in drafters.items():
            cmd = [sys.executable, __file__, "-k", str(args.k), "--max-num-seqs", str(args.max_num_seqs),
                   "--utilization", str(args.utilization), "--one", target, drafter, kv, name]
            done = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if done.returncode != 0 or not lines:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            rows.append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
    print(f"\n{'kv dtype':10} {'drafter':8} {'KV tokens':>10} {'bytes/token':>12} {'rings MiB':>10}")
    for row in rows:
        print(f"{row['kv_cache_dtype']:10} {row['drafter']:8} {row['tokens']:>10} "
              f"{row['bytes_per_token']:>12} {row['ring_bytes'] / 2**20:>10.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": args.target, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
