"""What the device can do: cpu / sm70 / sm75 / sm80 / sm90 -> capability, native types, tensor cores, dtype.

Facts (DESIGN.md, "SM70 discipline"; PTX ISA target notes; Triton 3.6):
- sm_70 (V100) and sm_75 (T4, RTX 20xx): fp16 tensor cores usable by vendor libraries (cuBLAS, torch SDPA),
  but Triton's `tl.dot` lowers to FMA instructions there; no bf16, no fp8 (Triton refuses its fp8 types).
- sm_80+ (A100, RTX 30xx/40xx): bf16; `tl.dot` uses mma. sm_89 (L4, RTX 40xx) adds fp8 (e4m3/e5m2).
- sm_90 (H100/H200): fp8, wgmma/TMA. sm_100+ (Blackwell) adds fp4 (e2m1) — reported as route "sm90" here
  (no kernel of ours needs more than sm_90 yet), with native_fp4 set.

`--compat sm70|sm75` forces the compat route on any GPU: `Platform.route` is then the forced route while
`hardware_route` and `capability` stay the real chip's. This module only describes; the kernels choose
their paths from the resolved EngineConfig (voltllm.config) and the attention backend.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import torch

ROUTES = ("cpu", "sm70", "sm75", "sm80", "sm90")
COMPAT_ROUTES = ("sm70", "sm75")


def capability_route(capability: Optional[tuple[int, int]]) -> str:
    """The kernel route of a compute capability (None = CPU); 'unsupported' below sm_70."""
    if capability is None:
        return "cpu"
    cap = tuple(capability)
    if cap < (7, 0):
        return "unsupported"  # Triton and the torch builds we target stop at sm_70
    if cap < (7, 5):
        return "sm70"  # 7.0 V100, 7.2 Xavier
    if cap < (8, 0):
        return "sm75"
    if cap < (9, 0):
        return "sm80"  # 8.0 A100, 8.6/8.7 Ampere, 8.9 Ada
    return "sm90"


def auto_compat(capability: Optional[tuple[int, int]]) -> str:
    """The compat route `--compat auto` picks (voltllm.config._resolve_compat uses it): sm70 / sm75 on those chips;
    none on the CPU, sm_80+, and below sm_70 (unsupported: the configuration refuses such a GPU)."""
    if capability is None or tuple(capability) >= (8, 0) or tuple(capability) < (7, 0):
        return "none"
    major, minor = capability
    return "sm70" if major == 7 and minor < 5 else "sm75"


def route_capability(capability: Optional[tuple[int, int]], compat: str) -> Optional[tuple[int, int]]:
    """The capability kernel choices by capability (row limits, tile tables) should assume: under a compat route
    (sm70 / sm75, forced or not) the route's chip, so the H200 runs the V100's / T4's dispatch; else the chip's."""
    if capability is None:
        return None
    return {"sm70": (7, 0), "sm75": (7, 5)}.get(compat, tuple(capability))


@dataclass(frozen=True)
class Platform:
    # effective kernel route: cpu | sm70 | sm75 | sm80 | sm90 (a forced --compat wins), or unsupported (below sm_70:
    # described for `voltllm check`, refused by the configuration)
    route: str
    hardware_route: str  # the chip's own route (differs from `route` under a forced --compat)
    device: str  # "cpu", "cuda:0"
    name: str  # device name ("cpu" on the CPU)
    capability: Optional[tuple[int, int]]  # the chip's compute capability (None on the CPU)
    compat: str  # none | sm70 | sm75: the route for GPUs without native bf16/fp8
    native_bf16: bool  # of the effective route (the compat route never creates bf16)
    native_fp8: bool  # hardware e4m3/e5m2 conversions and mma, on the effective route
    native_fp4: bool
    triton_tensor_cores: bool  # Triton tl.dot becomes mma/wgmma on this chip (sm_80+)
    vendor_tensor_cores: bool  # cuBLAS / torch SDPA use fp16 tensor cores (sm_70+)
    recommended_dtype: str  # float32 on the CPU, float16 on the compat route, else bfloat16 (or the checkpoint's)
    torch_has_arch: Optional[bool]  # the installed torch build ships kernels for this chip (None: unknown/CPU)
    sm_count: Optional[int] = None
    total_memory_gib: Optional[float] = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def is_cuda(self) -> bool:
        return self.capability is not None

    @property
    def is_compat(self) -> bool:
        return self.compat != "none"

    @property
    def forced_compat(self) -> bool:
        """--compat sm70/sm75 on a chip that has the native features (e.g. the H200 test runs)."""
        return self.is_compat and self.hardware_route not in COMPAT_ROUTES

    def to_dict(self) -> dict:
        d = asdict(self)
        d["capability"] = list(self.capability) if self.capability else None
        d["sm"] = f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else None
        d["notes"] = list(self.notes)
        d["forced_compat"] = self.forced_compat
        return d


def platform_for(capability: Optional[tuple[int, int]], compat: str = "auto", device: str = "",
                 name: str = "", torch_arch_list: Optional[list[str]] = None, sm_count: Optional[int] = None,
                 total_memory_gib: Optional[float] = None) -> Platform:
    """Describe a device from its capability alone (pure: tests call it for every route)."""
    hw = capability_route(capability)
    if compat == "auto":
        compat = auto_compat(capability)
    if compat not in ("none",) + COMPAT_ROUTES:
        raise ValueError(f"compat must be auto, none, sm70 or sm75, got {compat!r}")
    notes: list[str] = []
    if capability is None:
        compat = "none"  # the CPU has no compat route: it runs the plain-PyTorch reference
        return Platform(route="cpu", hardware_route="cpu", device=device or "cpu", name=name or "cpu",
                        capability=None, compat="none", native_bf16=False, native_fp8=False, native_fp4=False,
                        triton_tensor_cores=False, vendor_tensor_cores=False, recommended_dtype="float32",
                        torch_has_arch=None, notes=("CPU: reference PyTorch routes; half types are slow and "
                                                    "imprecise on CPUs, so dtype auto is float32",))
    cap = tuple(capability)
    route = compat if compat != "none" else hw
    hw_bf16 = cap >= (8, 0)
    hw_fp8 = cap >= (8, 9)
    hw_fp4 = cap >= (10, 0)
    compat_on = compat != "none"
    if hw == "unsupported":
        notes.append(f"sm_{cap[0]}{cap[1]} is below sm_70: Triton and the supported torch builds do not target it; "
                     "voltllm refuses to start on it (use --device cpu)")
    if compat_on and hw not in COMPAT_ROUTES + ("unsupported",):
        notes.append(f"--compat {compat} forced on sm_{cap[0]}{cap[1]}: the compat kernels run here (FMA decode "
                     "attention, fp16, software fp8), but Triton still compiles for this chip, so tl.dot in "
                     "prefill attention uses its tensor cores; a real sm_70/75 would run it on FMA")
    if hw in COMPAT_ROUTES:
        notes.append("tl.dot lowers to FMA here (no tensor cores for Triton); cuBLAS and torch SDPA still use "
                     "the fp16 tensor cores")
    has_arch = None
    if torch_arch_list is not None:
        has_arch = _arch_listed(cap, torch_arch_list)
        if not has_arch:
            notes.append(_missing_arch_text(cap, torch_arch_list))
    return Platform(route=route, hardware_route=hw, device=device or "cuda", name=name or "cuda",
                    capability=cap, compat=compat,
                    native_bf16=hw_bf16 and not compat_on, native_fp8=hw_fp8 and not compat_on,
                    native_fp4=hw_fp4 and not compat_on,
                    triton_tensor_cores=cap >= (8, 0), vendor_tensor_cores=cap >= (7, 0),
                    recommended_dtype="float16" if (compat_on or not hw_bf16) else "bfloat16",
                    torch_has_arch=has_arch, sm_count=sm_count, total_memory_gib=total_memory_gib,
                    notes=tuple(notes))


def _missing_arch_text(cap: tuple[int, int], arch_list: list[str]) -> str:
    return (f"this torch build lists {', '.join(arch_list) or 'no archs'}, not sm_{cap[0]}{cap[1]}: install a build "
            "that ships it (V100: a CUDA 12.6 build)")


def torch_arch_error(plat: Platform) -> Optional[str]:
    """Why the installed torch cannot run on this GPU (None: it can, or it is unknown): the engine's refusal at
    start, naming the fix `voltllm check` prints as a note."""
    if plat.torch_has_arch is not False or plat.capability is None:
        return None
    return (f"{plat.name} (sm_{plat.capability[0]}{plat.capability[1]}): "
            + _missing_arch_text(plat.capability, _torch_arch_list() or []) + f"; the installed torch is "
            f"{torch.__version__}")


def _torch_arch_list() -> Optional[list[str]]:
    """torch's compiled GPU archs; None when unknown (an empty list says nothing either: a build without the
    flags recorded)."""
    try:
        archs = list(torch.cuda.get_arch_list())
    except Exception:  # noqa: BLE001 - older builds / odd environments
        return None
    return archs or None


def _arch_listed(cap: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether torch's arch list can run this chip: a cubin of its major version at or below its minor (an sm_86
    build runs on sm_89: cuda's binary compatibility within a major version; sm_90a-style cubins only on their own
    chip), or a compute_XY (PTX, JIT-compiled) at or below it."""
    for a in arch_list:
        kind, _, num = a.partition("_")
        specific = num.endswith(("a", "f"))
        try:
            v = int(num.rstrip("af"))
        except ValueError:
            continue
        arch = (v // 10, v % 10)
        if kind == "sm" and (arch == cap or (not specific and arch[0] == cap[0] and arch[1] <= cap[1])):
            return True
        if kind == "compute" and arch <= cap:
            return True
    return False


def detect(device: Union[str, torch.device, None] = "auto", compat: str = "auto") -> Platform:
    """The platform of a device ('auto': the first GPU, else the CPU)."""
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type != "cuda":
        return platform_for(None, compat="none", device=str(dev))
    if not torch.cuda.is_available():
        raise RuntimeError(f"{dev}: no CUDA GPU is visible")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    arch_list = _torch_arch_list()
    return platform_for((props.major, props.minor), compat=compat, device=f"cuda:{index}", name=props.name,
                        torch_arch_list=arch_list, sm_count=props.multi_processor_count,
                        total_memory_gib=round(props.total_memory / 2**30, 2))


def make_current(device: torch.device) -> None:
    """Make a CUDA device with an index this process's current one. Triton launches, new streams, graph captures and
    bare synchronize() calls all act on the current device, not on their tensors': an engine on cuda:1 (--device
    cuda:1, a data-parallel engine past the first) would otherwise launch on cuda:0."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def for_config(config: Any) -> Platform:
    """The platform of a resolved EngineConfig (its device and its resolved compat route)."""
    return detect(config.device.device, config.device.compat)
