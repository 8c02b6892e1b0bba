"""Page-locking host tensors in place, for asynchronous copies between them and a GPU, and CUDA tensors that read
them in place.

torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two (40 GiB would lock 64), so
the big host buffers (the KV cache's CPU tier, offloaded weights) are ordinary CPU tensors registered with
cudaHostRegister instead, and unregistered when their owner is collected. With unified virtual addressing a
registered buffer's address is valid on the GPU too: `device_view` wraps it as a CUDA tensor (through
__cuda_array_interface__), whose kernels then read host memory over the bus (weights offloaded with
--offload-backend uva). Kernels that must not take such memory (TMA descriptors) ask `in_host_memory`.
"""
from __future__ import annotations

import bisect
import weakref

import torch

# [start, end) of the host buffers device_view has wrapped (sorted by start)
_VIEWED: list[tuple[int, int]] = []


def page_lock(t: torch.Tensor) -> None:
    """Pin a contiguous CPU tensor in place (cudaHostRegister)."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister failed (CUDA error {code})")


def page_unlock(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already; the process frees it anyway
        pass


def page_lock_for(owner: object, t: torch.Tensor) -> None:
    """Pin `t` now and unpin it when `owner` is collected (the finalizer holds `t`, not `owner`)."""
    page_lock(t)
    weakref.finalize(owner, page_unlock, t)


class _CudaArray:
    """The __cuda_array_interface__ of a registered host buffer (bytes), for torch.as_tensor."""

    def __init__(self, t: torch.Tensor, nbytes: int):
        self.host = t  # (torch keeps this object alive with the tensor it wraps, and so the host buffer)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (t.data_ptr(), False),
                                         "version": 3, "strides": None}


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor on `device` over the bytes of `t`, a contiguous CPU tensor page-locked with page_lock: GPU
    kernels read it in place over the bus (the view keeps `t` alive; the caller keeps it registered as long). Under
    unified virtual addressing (64-bit Linux, every GPU voltllm runs on) a registered buffer's host address is also
    its device address."""
    nbytes = t.numel() * t.element_size()
    with torch.cuda.device(device):
        view = torch.as_tensor(_CudaArray(t, nbytes), device=device)
    span = (t.data_ptr(), t.data_ptr() + nbytes)
    bisect.insort(_VIEWED, span)
    weakref.finalize(t, _forget, span)
    return view


def _forget(span: tuple[int, int]) -> None:
    i = bisect.bisect_left(_VIEWED, span)
    if i < len(_VIEWED) and _VIEWED[i] == span:
        del _VIEWED[i]


def in_host_memory(t: torch.Tensor) -> bool:
    """Whether a CUDA tensor's data lies in a host buffer device_view wrapped."""
    if not _VIEWED:
        return False
    ptr = t.data_ptr()
    i = bisect.bisect_right(_VIEWED, (ptr, float("inf"))) - 1
    return i >= 0 and _VIEWED[i][0] <= ptr < _VIEWED[i][1]
