"""Greedy sampling's row argmax: voltllm.kernels.argmax.row_argmax against torch.argmax (GPU).

    PYTHONPATH=$PWD python3 benchmarks/micro/argmax_rows.py

Logits of the bench's shapes (rows x vocabulary, fp16), replayed from a CUDA graph over rotated buffers (past the
L2, as a decode step meets them fresh from lm_head); every case checks that both give the same indices first.
"""
import torch

from voltllm.kernels.argmax import row_argmax
from voltllm.worker.skinny_tuning import graph_replay_ms

CASES = [(1, 151936), (16, 151936), (64, 151936), (64, 49152), (1, 49152)]


def main():
    torch.manual_seed(0)
    for rows, vocab in CASES:
        bufs = [torch.randn(rows, vocab, dtype=torch.float16, device="cuda")
                for _ in range(max(2, int(200e6 // (rows * vocab * 2)) + 1))]
        assert torch.equal(row_argmax(bufs[0]), bufs[0].argmax(-1))
        t_torch = graph_replay_ms(lambda x: x.argmax(-1), bufs, reps=30) * 1e3
        t_ours = graph_replay_ms(row_argmax, bufs, reps=30) * 1e3
        print(f"{rows:>3} x {vocab:<6} torch {t_torch:6.2f} us  row_argmax {t_ours:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
