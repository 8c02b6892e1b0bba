"""The host -> GPU copy rate from page-locked memory (cudaHostRegister, as the weight offloader and the KV cache's CPU
tier pin theirs), per copy size: what bounds a decode step whose layers are in CPU memory (--cpu-offload-gb). Then
whether a CUDA tensor can view that host memory in place (__cuda_array_interface__ over the registered pointer: the
zero-copy reads of vLLM's UVA offloading), and the rate at which a GPU kernel reads it so."""
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
        zero_copy(host)
    finally:
        page_unlock(host)


class _HostView:
    """What torch.as_tensor needs to wrap a registered host pointer as a CUDA tensor."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": (t.numel(),), "typestr": "|u1", "data": (t.data_ptr(), False),
                                         "version": 3, "strides": None}


def zero_copy(host: torch.Tensor) -> None:
    try:
        view = torch.as_tensor(_HostView(host), device="cuda")
    except Exception as e:  # noqa: BLE001 - the answer is the point
        print(f"zero-copy view of registered host memory: refused ({type(e).__name__}: {e})")
        return
    ok = bool((view[: 1 << 20].to(torch.int32).sum() == host[: 1 << 20].to(torch.int32).sum()).item())
    words = view.view(torch.int32)
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        words.sum()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    print(f"zero-copy view of registered host memory: {view.device}, values {'match' if ok else 'DIFFER'}; a GPU "
          f"reduction reads it at {host.numel() / statistics.median(times) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
