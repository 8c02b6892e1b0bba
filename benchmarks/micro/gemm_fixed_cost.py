"""What one decode-batch GEMM launch costs beyond its bytes (GPU, sm_90+): chains of 36 GEMMs of [N, 4096] fp16 weights
at 64 rows (each its own weight: the L2 stays cold), N from 1024 to 32768, replayed from a CUDA graph with PDL off
and on; per N the fastest decode-batch tile (batch_gemm candidates) and cuBLAS.

    PYTHONPATH=$PWD python3 benchmarks/micro/gemm_fixed_cost.py [--prefetch | --stream] [--n N1,N2,...] [ROWS]

--n replaces the N values (e.g. `--n 4096,4224,6144,6336,12288,12672`: whole waves of 64- or 32-feature tiles on 132
SMs beside the 8B's shapes; session 74: time stays proportional to the bytes, no partial-wave cost).

A least-squares line t = a + bytes / b over the N values gives a, the fixed cost of one launch in a chain, and b, the
rate its bytes stream at. The 8B decode step at 64 rows runs 4 such GEMMs per layer (144 per step): a x 144 is what a
step could save if its GEMMs streamed as one.
"""
import statistics
import sys

import torch
import triton
import triton.language as tl

from voltllm.kernels import pdl
from voltllm.kernels.batch_gemm import CONFIGS, TMA_CONFIGS, batch_gemm
from voltllm.kernels.pdl import pdl_enter
from graph_timing import graph_median_us  # (beside this script)

K, CHAIN = 4096, 36
NS = (1024, 2048, 4096, 6144, 8192, 12288, 16384, 24576, 32768)


def chain_us(step) -> float:
    return graph_median_us(step, CHAIN)


@triton.jit
def _stream_kernel(W, Out, n_total, n_per_program, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Reads its program's n_per_program fp16 elements (evict-first, like the GEMMs' weights) and writes their sum:
    the bytes of a GEMM without its arithmetic."""
    pdl_enter(PDL)
    start = tl.program_id(0).to(tl.int64) * n_per_program
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, n_per_program, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        acc += tl.load(W + offs, mask=offs < n_total, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(Out + tl.program_id(0), tl.sum(acc))


def time_stream(n: int, on: bool) -> tuple:
    """(us per kernel, programs per SM) of the fastest streaming-read chain over [n, K] fp16 buffers."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bufs = [torch.randn(n * K, dtype=torch.float16, device="cuda") for _ in range(CHAIN)]
    out = torch.empty(sms * 8, dtype=torch.float32, device="cuda")
    pdl.configure(on)
    best = (float("inf"), None)
    for per_sm in (1, 2, 4, 8):
        programs = sms * per_sm
        per = -(-n * K // programs)
        per = -(-per // 4096) * 4096
        programs = -(-n * K // per)
        t = chain_us(lambda: [_stream_kernel[(programs,)](b, out, n * K, per, BLOCK=4096, num_warps=8,
                                                          **pdl.launch_options()) for b in bufs])
        best = min(best, (t, per_sm), key=lambda b: b[0])
    return best


def fit(points):
    """Least squares t = a + bytes / b: (a us, b TB/s)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1e-6 / slope


def time_shape(x: torch.Tensor, n: int, on: bool, prefetch=(0,)) -> tuple:
    """(us per GEMM, config) of the fastest candidate for a chain of [n, K] weights, PDL on or off; with prefetch
    sizes beyond 0 (PDL on), also {size: us} of the fastest Triton tile with that many weight elements per row
    prefetched into L2 before the PDL wait."""
    m = x.shape[0]
    ws = [torch.randn(n, K, dtype=torch.float16, device=x.device) * 0.02 for _ in range(CHAIN)]
    ys = [torch.empty(m, n, dtype=torch.float16, device=x.device) for _ in range(CHAIN)]
    ref = x.float() @ ws[0].float().t()
    pdl.configure(on)
    best = (chain_us(lambda: [torch.matmul(x, w.t(), out=y) for w, y in zip(ws, ys)]), "cublas")
    triton_best = (float("inf"), None)
    for cfg in (*CONFIGS, *TMA_CONFIGS):
        batch_gemm(x, ws[0], config=cfg, out=ys[0])
        if not ((ys[0].float() - ref).norm() / ref.norm()).item() < 2e-3:
            raise AssertionError(f"N {n} {cfg}: wrong result")
        t = chain_us(lambda cfg=cfg: [batch_gemm(x, w, config=cfg, out=y) for w, y in zip(ws, ys)])
        best = min(best, (t, cfg), key=lambda b: b[0])
        triton_best = min(triton_best, (t, cfg), key=lambda b: b[0])
    cfg = triton_best[1]
    with_prefetch = {p: chain_us(lambda p=p: [batch_gemm(x, w, config=cfg, out=y, prefetch_k=p)
                                              for w, y in zip(ws, ys)]) for p in prefetch if on}
    return best, triton_best, with_prefetch


def main_stream():
    rows = {}
    for n in NS:
        for on in (False, True):
            rows[(n, on)] = t, per_sm = time_stream(n, on)
            torch.cuda.empty_cache()
            print(f"stream N {n:>6} PDL {'on ' if on else 'off'}: {t:7.2f} us per kernel "
                  f"({n * K * 2 / 1e6 / t:4.2f} TB/s) {per_sm} programs per SM", flush=True)
    for on in (False, True):
        a, b = fit([(n * K * 2, rows[(n, on)][0]) for n in NS])
        print(f"stream PDL {'on ' if on else 'off'}: fixed cost per kernel a = {a:.2f} us, "
              f"streaming rate b = {b:.2f} TB/s")


def main(m: int, prefetch=(0,)):
    torch.manual_seed(0)
    x = torch.randn(m, K, dtype=torch.float16, device="cuda")
    rows = {}
    for n in NS:
        for on in (False, True):
            best, triton_best, with_prefetch = time_shape(x, n, on, prefetch)
            rows[(n, on)] = best
            torch.cuda.empty_cache()
            mb = n * K * 2 / 1e6
            print(f"m{m} N {n:>6} PDL {'on ' if on else 'off'}: {best[0]:7.2f} us per GEMM ({mb / best[0]:4.2f} TB/s) "
                  f"{best[1]}" + (f"; Triton {triton_best[1]} {triton_best[0]:.2f} us, with L2 prefetch of "
                                  + ", ".join(f"{p}: {t:.2f}" for p, t in with_prefetch.items()) if with_prefetch
                                  else ""), flush=True)
    for on in (False, True):
        a, b = fit([(n * K * 2, rows[(n, on)][0]) for n in NS])
        print(f"m{m} PDL {'on ' if on else 'off'}: fixed cost per GEMM a = {a:.2f} us, streaming rate b = {b:.2f} "
              f"TB/s; x 144 GEMMs per 8B step = {a * 144:.0f} us")


if __name__ == "__main__":
    # --prefetch: also the fastest Triton tile with 0 / 512 / 1024 / 4096 weight elements per row prefetched into L2
    # before the PDL wait
    # --stream: the same byte sizes read by a plain streaming kernel (no GEMM), for the fixed cost of any launch
    args = sys.argv[1:]
    if "--n" in args:
        i = args.index("--n")
        NS = tuple(int(v) for v in args[i + 1].split(","))
        del args[i:i + 2]
    args = [a for a in args if a not in ("--prefetch", "--stream")]
    if "--stream" in sys.argv:
        main_stream()
        sys.exit(0)
    main(int(args[0]) if args else 64, (0, 512, 1024, 4096) if "--prefetch" in sys.argv else (0,))
