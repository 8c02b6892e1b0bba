"""Where a model's decoder layers are built: on the device (the default) or in host memory.

Weight offloading (--cpu-offload-gb, worker/weight_offload.py) must never hold the whole model on the GPU: a model
that only fits with some of its layers in CPU memory would run out of GPU memory while it loads. So with offloading
on, the model builders construct every decoder layer under `host_layers()`: its tensors are allocated (and its
weights loaded) in CPU memory, and the offloader then moves the layers that stay on the GPU there, once their sizes
are known. A layer whose set-up depends on the GPU it will run on (a kernel limit by compute capability) asks
`execution_device()`, not where its tensors are.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Optional

import torch

_HOST_BUILD: ContextVar[Optional[torch.device]] = ContextVar("voltllm_host_layers", default=None)


@contextlib.contextmanager
def host_layers(execution_device: Optional[torch.device]) -> Iterator[None]:
    """Build decoder layers in CPU memory (for a model that will run on `execution_device`); None: as usual."""
    token = _HOST_BUILD.set(execution_device)
    try:
        yield
    finally:
        _HOST_BUILD.reset(token)


def layer_scope() -> contextlib.AbstractContextManager:
    """The allocation scope for one decoder layer's construction: CPU memory under host_layers(), else unchanged."""
    return torch.device("cpu") if _HOST_BUILD.get() is not None else contextlib.nullcontext()


def build_layer(cls, *args):
    """One decoder layer `cls(*args)`, allocated in layer_scope()."""
    with layer_scope():
        return cls(*args)


def execution_device() -> torch.device:
    """The device the layer being built will run on (the current default device outside host_layers())."""
    dev = _HOST_BUILD.get()
    return dev if dev is not None else torch.empty(0).device
