"""vLLM's weight-offloading flags, resolved to a WeightOffloadConfig (what worker/weight_offload.py runs).

vLLM has two forms: `--cpu-offload-gb N` (its "uva" backend: N GiB of parameters per GPU kept in CPU memory and read
over the bus in place) and group offloading (`--offload-group-size G --offload-num-in-group n`: the last n decoder
layers of every G, prefetched `--offload-prefetch-step` layers ahead). Both choose whole decoder layers here
(`--cpu-offload-gb`: the fewest evenly spread ones holding at least N GiB; the group flags: vLLM's rule), and both
backends are built:
- prefetch (the default, `auto`): the layers live in page-locked CPU memory and are copied into GPU staging slots
  ahead of their turn, on a copy stream, while the layers before them compute. Every forward moves every offloaded
  byte once, whatever the batch.
- uva (`--offload-backend uva`): the kernels read the offloaded weights in place over the bus. No staging slots; a
  decode step reads each weight it uses once, and a MoE layer's unused experts not at all (with `--cpu-offload-params
  experts`, only the routed experts cross the bus), but a prompt's GEMMs read each weight tile many times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from voltllm.config import ConfigError

OFFLOAD_BACKENDS = ("auto", "prefetch", "uva")


@dataclass(frozen=True)
class WeightOffloadConfig:
    budget_bytes: int  # --cpu-offload-gb in bytes: offload at least this much (0: layers chosen by group)
    group_size: int  # --offload-group-size (0: by budget)
    num_in_group: int  # --offload-num-in-group: the last n layers of every group
    prefetch_step: int  # --offload-prefetch-step: offloaded layers copied ahead (0: each copied as its turn comes)
    params: tuple[str, ...]  # --cpu-offload-params: only tensors whose names hold one of these segment runs
    backend: str = "prefetch"  # prefetch (staging slots) | uva (read in place)

    @property
    def slots(self) -> int:
        """GPU staging slots (the layer that runs and those prefetched after it)."""
        return self.prefetch_step + 1


def _count(flag: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{flag} must be an integer >= {least}, got {value!r}")
    return value


def offload_params(value: Any) -> tuple[str, ...]:
    """--cpu-offload-params as names: a list / set of strings, or one string of comma- or space-separated names."""
    if value is None:
        return ()
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    names = []
    for item in items:
        parts = [p.strip() for p in item.split(",")] if isinstance(item, str) else [item]
        for part in parts:
            if part == "" and isinstance(item, str) and item.strip():
                continue  # (a trailing comma)
            if not isinstance(part, str) or not part or part.strip(".") != part or ".." in part or " " in part:
                raise ConfigError(f"--cpu-offload-params: {part!r} is not a parameter name segment (e.g. experts, "
                                  "mlp.experts, self_attn.qkv_proj, layers.3)")
            names.append(part)
    return tuple(dict.fromkeys(names))


def resolve_weight_offload(cpu_offload_gb: Any, cpu_offload_params: Any, backend: str, group_size: Any,
                           num_in_group: Any, prefetch_step: Any, enable_lora: bool) -> Optional[WeightOffloadConfig]:
    """The flags as a WeightOffloadConfig (None: no offloading), or a ConfigError naming the flag."""
    if backend not in OFFLOAD_BACKENDS:
        raise ConfigError(f"--offload-backend {backend!r}: not a backend (auto, prefetch, uva)")
    if isinstance(cpu_offload_gb, bool) or not isinstance(cpu_offload_gb, (int, float)) \
            or not math.isfinite(cpu_offload_gb) or cpu_offload_gb < 0:
        raise ConfigError(f"--cpu-offload-gb must be a number of GiB >= 0, got {cpu_offload_gb!r}")
    group_size = _count("--offload-group-size", group_size, 0)
    num_in_group = _count("--offload-num-in-group", num_in_group, 1)
    prefetch_step = _count("--offload-prefetch-step", prefetch_step, 0)
    params = offload_params(cpu_offload_params)
    if group_size > 0:
        if backend == "uva":
            raise ConfigError("--offload-group-size with --offload-backend uva: group offloading is the prefetch "
                              "backend's (vLLM's too); give --cpu-offload-gb for uva, or drop --offload-backend")
        if num_in_group > group_size:
            raise ConfigError(f"--offload-num-in-group {num_in_group} must be <= --offload-group-size {group_size}")
        if prefetch_step < 1:
            raise ConfigError("--offload-prefetch-step must be >= 1 with --offload-group-size (group offloading "
                              "always prefetches)")
    elif cpu_offload_gb == 0:
        if params:
            raise ConfigError("--cpu-offload-params chooses what --cpu-offload-gb or --offload-group-size offloads; "
                              "give one of them")
        return None
    if enable_lora:
        raise ConfigError("weight offloading (--cpu-offload-gb / --offload-group-size) with --enable-lora is not "
                          "built: the adapters' GPU slots live in the offloaded projections; drop one of them")
    budget = 0 if group_size > 0 else int(cpu_offload_gb * 2**30)
    return WeightOffloadConfig(budget_bytes=budget, group_size=group_size, num_in_group=num_in_group,
                               prefetch_step=prefetch_step, params=params,
                               backend="uva" if backend == "uva" else "prefetch")


def matches(path: str, patterns: Sequence[str]) -> bool:
    """Whether a tensor's dotted name holds one of `patterns` as whole segments (vLLM's rule: "experts" and
    "experts.w2" match "mlp.experts.w2", "expert" and "w" do not)."""
    segs = path.split(".")
    for pattern in patterns:
        want = pattern.split(".")
        n = len(want)
        if any(segs[i:i + n] == want for i in range(len(segs) - n + 1)):
            return True
    return False
