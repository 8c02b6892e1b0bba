"""The host -> GPU copy rate from page-locked memory (cudaHostRegister, as the weight offloader and the KV cache's CPU
tier pin theirs), per copy size: what bounds a decode step whose layers are in CPU memory (--cpu-offload-gb)."""
from __future__ import annotations

import statistics

import torch

from voltllm.host_memory import page_lock, page_unlock


def main() -> None:
    size = 1 << 30
    host = torch.empty(size, dtype=torch.uint8)
    host.fill_(1)
    page_lock(host)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    try:
        for chunk in (64 << 20, 256 << 20, size):
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for at in range(0, size, chunk):
                    dev[at:at + chunk].copy_(host[at:at + chunk], non_blocking=True)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            rate = size / statistics.median(times) / 1e9
            print(f"host -> GPU, page-locked, {chunk >> 20} MiB copies: {rate:.1f} GB/s")
    finally:
        page_unlock(host)


if __name__ == "__main__":
    main()
