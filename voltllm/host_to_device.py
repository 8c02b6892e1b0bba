"""Host -> device copies that do not make the host wait for the GPU.

A copy from pageable host memory synchronizes the stream (torch waits for it to finish), so every step that
uploads a small index tensor that way stalls the host until the GPU has drained its queue: no CPU / GPU overlap
(async scheduling). Staging through pinned memory with a non-blocking copy keeps the copy in stream order without
the wait; torch's pinned-memory allocator keeps the staging buffer alive until the copy has run.
"""
from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` (itself off CUDA), copied without a stream sync."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without a stream sync."""
    return upload(torch.tensor(values, dtype=dtype), device)
