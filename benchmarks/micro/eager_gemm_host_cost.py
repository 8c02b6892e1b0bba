"""What an eager decode-batch GEMM costs the host (CUDA): session 66 found the 8B's --enforce-eager steps 1.3-1.7x
slower with the tuned Triton GEMM at 3-40 rows than with cuBLAS (docs/kernels.md "Session 66"), an eager step being
host-bound. This times, per call and per 8B projection shape, at 3 / 16 / 40 / 64 rows:
- host: wall time of CALLS back-to-back eager calls with no synchronisation inside (the launch queue stays far from
  full, so this is what the Python side and the driver cost the host), divided by CALLS;
- gpu: the same calls' GPU time from CUDA events around them (the launches queued behind a spin kernel, so the GPU
  runs them back to back), divided by CALLS;
for cuBLAS (F.linear), the decode-batch GEMM with a pointer tile and with a TMA tile (sm_90+), each checked against
cuBLAS first.

    PYTHONPATH=$PWD python3 benchmarks/micro/eager_gemm_host_cost.py [CALLS]

If the Triton forms cost the host tens of microseconds more per call than cuBLAS, eager steps (--enforce-eager,
batches above the largest graph, mixed steps) should keep cuBLAS whatever the graph-timed tuner chose.
"""
import sys
import time

import torch
import torch.nn.functional as F

from voltllm.kernels.batch_gemm import CONFIGS, TMA_CONFIGS, batch_gemm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (3, 16, 40, 64)


def _spin(us: float) -> None:
    """Keep the GPU busy for at least ~us (cycles at up to 2 GHz) so that the timed launches queue behind it."""
    torch.cuda._sleep(int(us * 2000))


def time_calls(fn, calls: int) -> tuple[float, float]:
    """(host us per call, GPU us per call) of `calls` eager calls of fn."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _spin(calls * 200)  # (longer than the host takes to queue them)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    forms = {"cublas": None, "ptr": CONFIGS[0]}
    if torch.cuda.get_device_capability() >= (9, 0):
        forms["tma"] = TMA_CONFIGS[0]
    print(f"{'shape':8} {'rows':>4} " + " ".join(f"{f + ' host/gpu us':>22}" for f in forms))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
        for rows in ROWS:
            x = torch.randn(rows, k, dtype=torch.float16, device="cuda")
            ref = F.linear(x, w).float()
            cells = []
            for form, config in forms.items():
                if config is None:
                    fn = lambda: F.linear(x, w)  # noqa: E731
                else:
                    fn = lambda c=config: batch_gemm(x, w, config=c)  # noqa: E731
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    assert err < 2e-3, (name, rows, form, err)
                host, gpu = time_calls(fn, calls)
                cells.append(f"{host:10.1f} / {gpu:8.1f}")
            print(f"{name:8} {rows:>4} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
