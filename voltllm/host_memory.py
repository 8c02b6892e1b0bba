"""Page-locking host tensors in place, for asynchronous copies between them and a GPU.

torch's pinned allocator (`pin_memory=True`) rounds every allocation up to a power of two (40 GiB would lock 64), so
the big host buffers (the KV cache's CPU tier, offloaded weights) are ordinary CPU tensors registered with
cudaHostRegister instead, and unregistered when their owner is collected.
"""
from __future__ import annotations

import weakref

import torch


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
