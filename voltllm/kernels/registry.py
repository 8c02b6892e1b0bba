"""Registry of Triton kernels with the compile specs the sm_70/sm_75 gate needs.

Every Triton kernel that the compat route can launch registers here, next to its definition, with
one or more representative specializations (argument types and constexpr values). `voltllm check
--sm70` cross-compiles each of them for sm_70 and sm_75; a test fails when a compat kernel exists
that is not registered.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CompileSpec:
    signature: dict[str, str]  # arg name -> Triton type ("*fp16", "i32", "fp32", "constexpr")
    constexprs: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    # False: a form of a compat kernel that only the native route launches (the gate skips it; kernel tests still
    # compile it), e.g. the decode attention's tl.dot route, which sm_70 / sm_75 never take
    compat: bool = True


@dataclass
class KernelEntry:
    name: str
    fn: Any  # triton.runtime.JITFunction
    specs: list[CompileSpec]
    compat: bool = True  # launched on the compat (SM70/SM75) route
    # its caller copes with "out of shared memory" (smaller tiles, then a torch form), so a spec may need more
    # than a V100 / T4 block has: the sm70 gate reports the size instead of failing it
    shared_fallback: bool = False


REGISTRY: dict[str, KernelEntry] = {}


def register_kernel(name: str, fn: Any, specs: list[CompileSpec], compat: bool = True,
                    shared_fallback: bool = False) -> Any:
    if name in REGISTRY and REGISTRY[name].fn is not fn:
        raise ValueError(f"kernel {name!r} registered twice")
    REGISTRY[name] = KernelEntry(name=name, fn=fn, specs=list(specs), compat=compat, shared_fallback=shared_fallback)
    return fn
