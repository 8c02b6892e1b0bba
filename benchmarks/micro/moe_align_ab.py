"""moe_align's two Triton forms on the GPU (voltllm/kernels/moe.py): the chunk kernel (eager steps: one compile for
every pair count) and the sort kernel (CUDA-graph captures: one compile per power of two of the pair count), beside
the torch ops. Per pair count: each form's first call (compile included, from an empty Triton cache), its GPU time
per call (kernel durations from the profiler: no host overhead) and whether its outputs equal torch's.

    python3 benchmarks/micro/moe_align_ab.py --experts 256 --top-k 8 --variants 128x4,64x4
"""
import argparse
import os
import tempfile
import time

import torch


def gpu_us(fn, reps: int = 20) -> float:
    """GPU time per call (us): the kernels' summed durations from the profiler over `reps` calls (CUDA events around
    one call would time the host's launch work instead)."""
    from _micro_timing import kernel_times_us

    fn()
    return sum(kernel_times_us(lambda: [fn() for _ in range(reps)]).values()) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--pairs", default="8,64,256,512,1024,2048,4096")
    ap.add_argument("--variants", default="128x4", help="chunk kernel tiles as CHUNKxWARPS, comma separated")
    args = ap.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="align-ab-")  # first calls compile from cold
    import voltllm.kernels.moe as moe

    e, k = args.experts, args.top_k
    variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
    print(f"{'pairs':>6} {'bm':>3} | {'first chunk ms':>14} {'first sort ms':>13} | "
          + " ".join(f"{f'chunk {c}x{w} us':>16}" for c, w in variants) + f" {'sort us':>8} {'torch us':>8} | agree")
    for n in (int(x) for x in args.pairs.split(",")):
        t = max(1, n // k)
        ids = torch.randint(0, e, (t, k), device="cuda", dtype=torch.int32)
        bm = moe.pick_config(t * k, e)["BLOCK_M"]
        moe.ALIGN_CHUNK, moe.ALIGN_WARPS = variants[0]
        first, agree = {}, []
        want = moe.moe_align(ids, e, bm, use_triton=False)
        used = int(want[2][0])
        for sort in (False, True):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = moe.moe_align(ids, e, bm, use_triton=True, sort=sort)
            torch.cuda.synchronize()
            first[sort] = (time.perf_counter() - t0) * 1e3
            agree.append(int(got[2][0]) == used and torch.equal(got[0], want[0])
                         and torch.equal(got[1][:used // bm], want[1][:used // bm]))
        timed = []
        for c, w in variants:
            moe.ALIGN_CHUNK, moe.ALIGN_WARPS = c, w
            timed.append(gpu_us(lambda: moe.moe_align(ids, e, bm, use_triton=True, sort=False)))
        sort_us = gpu_us(lambda: moe.moe_align(ids, e, bm, use_triton=True, sort=True))
        torch_us = gpu_us(lambda: moe.moe_align(ids, e, bm, use_triton=False))
        print(f"{t * k:>6} {bm:>3} | {first[False]:>14.1f} {first[True]:>13.1f} | "
              + " ".join(f"{x:>16.1f}" for x in timed) + f" {sort_us:>8.1f} {torch_us:>8.1f} | {agree}", flush=True)


if __name__ == "__main__":
    main()
