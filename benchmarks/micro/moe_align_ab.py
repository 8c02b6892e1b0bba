"""moe_align on the GPU: the Triton kernel of this checkout against another version of voltllm/kernels/moe.py (a
file path, e.g. the one-sort kernel of an earlier commit: `git show 503202b:voltllm/kernels/moe.py > old.py`) and the
torch ops, per pair count. Prints, per n: the first call's time (compile included, with an empty Triton cache), the
median GPU time per call of each (CUDA events over back-to-back calls) and whether the outputs agree with torch's.

    python3 benchmarks/micro/moe_align_ab.py --other old.py --experts 256 --top-k 8
"""
import argparse
import importlib.util
import os
import sys
import tempfile
import time

import torch


def load(path: str, name: str):
    """The module at path, its kernels kept out of the registry (the checkout's own hold those names)."""
    import voltllm.kernels.registry as registry

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    saved = dict(registry.REGISTRY)
    registry.REGISTRY.clear()
    try:
        spec.loader.exec_module(mod)
    finally:
        registry.REGISTRY.clear()
        registry.REGISTRY.update(saved)
    return mod


def gpu_us(fn, reps: int = 20) -> float:
    """GPU time per call (us): the kernels' summed durations from the profiler over `reps` calls (host launch
    overhead excluded, which CUDA events around one call would include)."""
    from _micro_timing import kernel_times_us

    fn()
    return sum(kernel_times_us(lambda: [fn() for _ in range(reps)]).values()) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other", required=True, help="another moe.py to compare")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--pairs", default="8,64,256,512,1024,2048,4096")
    ap.add_argument("--variants", default="128x4", help="this checkout's kernel as CHUNKxWARPS, comma separated")
    args = ap.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="align-ab-")  # compile times from cold
    import voltllm.kernels.moe as cur
    other = load(args.other, "moe_other")
    e, k = args.experts, args.top_k
    variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
    print(f"{'pairs':>6} {'bm':>3} | {'first cur ms':>12} {'first other ms':>14} | "
          + " ".join(f"{f'cur {c}x{w} us':>14}" for c, w in variants) + f" {'other us':>8} {'torch us':>8} | agree")
    for n in (int(x) for x in args.pairs.split(",")):
        t = max(1, n // k)
        ids = torch.randint(0, e, (t, k), device="cuda", dtype=torch.int32)
        bm = cur.pick_config(t * k, e)["BLOCK_M"]
        row = {}
        for name, mod in (("cur", cur), ("other", other)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            mod.moe_align(ids, e, bm, use_triton=True)
            torch.cuda.synchronize()
            row[name + "_first"] = (time.perf_counter() - t0) * 1e3
            row[name] = gpu_us(lambda m=mod: m.moe_align(ids, e, bm, use_triton=True))
        timed = []
        for c, w in variants:
            cur.ALIGN_CHUNK, cur.ALIGN_WARPS = c, w
            timed.append(gpu_us(lambda: cur.moe_align(ids, e, bm, use_triton=True)))
        row["torch"] = gpu_us(lambda: cur.moe_align(ids, e, bm, use_triton=False))
        want = cur.moe_align(ids, e, bm, use_triton=False)
        agree = []
        for mod in (cur, other):
            got = mod.moe_align(ids, e, bm, use_triton=True)
            used = int(want[2][0])
            agree.append(int(got[2][0]) == used and torch.equal(got[0], want[0])
                         and torch.equal(got[1][:used // bm], want[1][:used // bm]))
        print(f"{t * k:>6} {bm:>3} | {row['cur_first']:>12.1f} {row['other_first']:>14.1f} | "
              + " ".join(f"{x:>14.1f}" for x in timed) + f" {row['other']:>8.1f} {row['torch']:>8.1f} | {agree}",
              flush=True)
        cur.ALIGN_CHUNK, cur.ALIGN_WARPS = variants[0]


if __name__ == "__main__":
    main()
