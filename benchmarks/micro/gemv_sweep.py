"""Cold-L2 sweep of the skinny GEMM (voltllm.kernels.gemv) against cuBLAS at decode shapes (GPU only).

    PYTHONPATH=$PWD python3 benchmarks/micro/gemv_sweep.py

Weights are rotated over copies totalling > 400 MB (past the L2) and the calls are replayed from a CUDA
graph, as in decode (the start-up tuner's timing, worker/skinny_tuning.py). Prints per shape and row count
the cuBLAS time and the best tile config.
"""
import torch

from voltllm.kernels.gemv import CONFIGS, gemv
from voltllm.worker.skinny_tuning import graph_replay_ms

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096),  # qwen3-8b
          (960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # SmolLM2-135M


def main():
    torch.manual_seed(0)
    print(f"{'shape':>14} rows  {'cuBLAS us':>9} {'TB/s':>5}  {'triton us':>9} {'TB/s':>5}  best tile")
    for n, k in SHAPES:
        weights = [torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
                   for _ in range(max(2, int(400e6 // (n * k * 2)) + 1))]
        mb = n * k * 2 / 1e6
        for m in (1, 4):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            out = torch.empty(m, n, dtype=torch.float16, device="cuda")
            t_lib = graph_replay_ms(lambda w: torch.matmul(x, w.t(), out=out), weights, reps=30) * 1e3
            best = min((graph_replay_ms(lambda w: gemv(x, w, out=out, config=c), weights, reps=30) * 1e3, c)
                       for c in CONFIGS)
            print(f"{n:>6}x{k:<7} {m:>4}  {t_lib:9.1f} {mb / t_lib:5.2f}  {best[0]:9.1f} {mb / best[0]:5.2f}  {best[1]}")
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
