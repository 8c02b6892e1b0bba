"""Decoder layers kept in CPU memory and streamed to the GPU as each forward reaches them (--cpu-offload-gb,
--offload-group-size; the flags: voltllm/weight_offload_config.py).

Set-up (once, after the weights are loaded; the model's decoder layers were built in CPU memory,
model/layer_placement.py):
1. Every tensor reachable from each decoder layer is found: parameters, buffers, and the tensors the layer keeps
   outside them (the planes of weights kept quantized, a MoE layer's stacked experts), through sub-modules,
   dataclasses, lists and dicts. Tensors are grouped by the storage they view.
2. A storage is offloadable when only that layer reaches it (not another layer, not the model outside its layers:
   the rotary tables every layer shares stay), no buffer views it (buffers are state: fp8 KV scales), and, with
   --cpu-offload-params, one of its tensors' names matches.
3. The layers to offload are chosen (evenly spread until --cpu-offload-gb is covered, or the group rule), every
   other storage built in CPU memory moves to the GPU, and each offloaded layer's storages are packed into one
   page-locked host buffer. Its tensors are re-pointed (`tensor.data = view`) at the same offsets of one of
   `prefetch_step + 1` GPU staging slots, so the kernels, and CUDA graphs captured later, read the slot. A storage
   that is still alive afterwards is a tensor this walk did not find: set-up stops with an error rather than run with
   a stale copy.

Each forward: the first layer's pre-hook forks a copy stream that copies the first `prefetch_step` offloaded layers
into their slots; an offloaded layer's pre-hook makes the compute stream wait for its copy, then starts the copy of
the offloaded layer `prefetch_step` places later into the slot the previous offloaded layer just finished with. All
of this is stream work recorded in order, so a decode CUDA graph captures the copies too (the copy stream joins
the capture through events and is joined back before the layer that needs it). With prefetch_step 0, or off the
GPU, each layer's copy runs on the compute stream just before it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from voltllm.weight_offload_config import WeightOffloadConfig, matches

logger = logging.getLogger("voltllm")

ALIGN = 256  # bytes: a storage's start in a slot (TMA descriptors and vector loads need 16)
# names a MoE layer's experts have in vLLM's checkpoints ("mlp.experts.w2_weight"), so --cpu-offload-params experts
# selects them here too
_EXPERT_ATTRS = {"w13": "experts.w13_weight", "w2": "experts.w2_weight", "qexperts": "experts"}
# nn.Module attributes that are bookkeeping, not state the layer computes with
_MODULE_INTERNALS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}


@dataclass
class _Found:
    path: str
    tensor: torch.Tensor
    buffer: bool


def _storage_key(t: torch.Tensor) -> Optional[tuple[str, int]]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr()) if s.nbytes() else None


def reachable_tensors(root: Any, skip: frozenset = frozenset()) -> list[_Found]:
    """Every tensor object reachable from `root` (see the module docstring), each once, with a dotted name."""
    out: list[_Found] = []
    seen: set[int] = set(skip)

    def walk(obj: Any, path: str) -> None:
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(_Found(path.rstrip("."), obj, False))
            # a view keeps its base tensor (and so the base's storage) alive: re-point that too
            walk(obj._base, path + "_base.")
            return
        if isinstance(obj, nn.Module):
            from voltllm.model.layers.moe import SparseMoE

            in_moe = isinstance(obj, SparseMoE)

            def name(n: str) -> str:
                return f"{path}{_EXPERT_ATTRS.get(n, n) if in_moe else n}"
            for table, is_buffer in ((obj._parameters, False), (obj._buffers, True)):
                for n, t in table.items():
                    if t is not None and id(t) not in seen:
                        seen.add(id(t))
                        out.append(_Found(name(n), t, is_buffer))
                        walk(t._base, name(n) + "._base.")
            for n, m in obj._modules.items():
                walk(m, name(n) + ".")
            for n, v in vars(obj).items():
                if n not in _MODULE_INTERNALS and not n.startswith("_forward") and not n.startswith("_backward"):
                    walk(v, name(n) + ".")
            return
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}{i}.")
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}{k}.")
        elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("voltllm."):
            fields = (vars(obj) if hasattr(obj, "__dict__")
                      else {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
            for n, v in fields.items():
                walk(v, f"{path}{n}.")

    walk(root, "")
    return out


@dataclass
class _Group:
    """The tensors viewing one storage."""
    key: tuple[str, int]
    tensors: list[_Found]
    nbytes: int

    @property
    def storage(self) -> torch.UntypedStorage:
        return self.tensors[0].tensor.untyped_storage()

    def bytes_view(self) -> torch.Tensor:
        """The storage as a flat uint8 tensor."""
        t = self.tensors[0].tensor
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(self.storage, 0, (self.nbytes,), (1,))

    def repoint(self, region: torch.Tensor) -> None:
        """Make every tensor of the group view `region` (uint8, nbytes) as it viewed its storage."""
        for f in self.tensors:
            t = f.tensor
            typed = region.view(t.dtype)
            with torch.no_grad():
                # (as_strided's offset counts from the start of the storage, not of the view)
                t.data = torch.as_strided(typed, t.size(), t.stride(), typed.storage_offset() + t.storage_offset())


def _groups(found: list[_Found]) -> dict[tuple[str, int], _Group]:
    groups: dict[tuple[str, int], _Group] = {}
    for f in found:
        key = _storage_key(f.tensor)
        if key is None:
            continue
        g = groups.get(key)
        if g is None:
            groups[key] = _Group(key, [f], f.tensor.untyped_storage().nbytes())
        else:
            g.tensors.append(f)
    return groups


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class OffloadPlan:
    """Which layers go to CPU memory and what of each."""
    layers: list[int]  # offloaded decoder layers, in forward order
    groups: dict[int, list[_Group]]  # their offloadable storages
    layer_bytes: list[int]  # every layer's offloadable bytes (index: layer)


def _saved(sizes: list[int], picked: list[int], cfg: WeightOffloadConfig) -> int:
    """GPU bytes freed by offloading `picked`: their bytes, less the staging slots (prefetch: as many as
    prefetch_step + 1, each as large as the largest offloaded layer; uva: none)."""
    total = sum(sizes[i] for i in picked)
    if cfg.backend == "uva" or not picked:
        return total
    return total - min(cfg.slots, len(picked)) * max(sizes[i] for i in picked)


def choose_layers(sizes: list[int], cfg: WeightOffloadConfig) -> list[int]:
    """The decoder layers to offload: vLLM's group rule (the last num_in_group of every group_size), or the fewest
    evenly spread layers whose offloading frees at least the budget of GPU memory, the staging slots counted (all of
    them when none does)."""
    n = len(sizes)
    if cfg.group_size > 0:
        return [i for i in range(n) if i % cfg.group_size >= cfg.group_size - cfg.num_in_group]
    for count in range(1, n + 1):
        picked = sorted({min(n - 1, int((k + 0.5) * n / count)) for k in range(count)})
        if _saved(sizes, picked, cfg) >= cfg.budget_bytes:
            return picked
    return list(range(n))


def plan_offload(model: nn.Module, cfg: WeightOffloadConfig) -> OffloadPlan:
    """Find each layer's offloadable storages (module docstring, steps 1-2) and choose the layers."""
    layers = model.layers
    outside = {k for k in _groups(reachable_tensors(model, skip=frozenset({id(layers)})))}
    per_layer = [_groups(reachable_tensors(layer)) for layer in layers]
    reach_count: dict[tuple[str, int], int] = {}
    for groups in per_layer:
        for key in groups:
            reach_count[key] = reach_count.get(key, 0) + 1
    offloadable: dict[int, list[_Group]] = {}
    for i, groups in enumerate(per_layer):
        offloadable[i] = [
            g for key, g in groups.items()
            if key not in outside and reach_count[key] == 1 and not any(f.buffer for f in g.tensors)
            and (not cfg.params or any(matches(f"model.layers.{i}.{f.path}", cfg.params) for f in g.tensors))]
    sizes = [sum(_aligned(g.nbytes) for g in offloadable[i]) for i in range(len(layers))]
    chosen = [i for i in choose_layers(sizes, cfg) if sizes[i] > 0]
    saved = _saved(sizes, chosen, cfg)
    if chosen and saved < cfg.budget_bytes:
        logger.warning("weight offloading: every decoder layer's offloadable weights free %.2f GiB of GPU memory, less "
                       "than --cpu-offload-gb %.2f", saved / 2**30, cfg.budget_bytes / 2**30)
    if chosen and saved <= 0:
        raise RuntimeError(f"weight offloading: the {len(chosen)} offloaded layer(s) would free no GPU memory (their "
                           f"{min(cfg.slots, len(chosen))} staging slot(s) take as much); offload more layers or "
                           "lower --offload-prefetch-step")
    return OffloadPlan(chosen, {i: offloadable[i] for i in chosen}, sizes)


def _packed(groups: list[_Group]) -> tuple[torch.Tensor, list[int]]:
    """One layer's offloadable storages copied into one host buffer at aligned offsets (the buffer, the offsets)."""
    offsets, at = [], 0
    for g in groups:
        offsets.append(at)
        at = _aligned(at + g.nbytes)
    host = torch.empty(at, dtype=torch.uint8)
    for g, start in zip(groups, offsets):
        host[start:start + g.nbytes].copy_(g.bytes_view())
    return host, offsets


class HostResidentLayers:
    """--offload-backend uva: the offloaded layers' storages stay in page-locked host memory and their tensors view
    it in place (host_memory.device_view), so kernels read them over the bus; no slots, no hooks. Off the GPU the
    tensors simply view the host buffers."""

    num_slots = prefetch = slot_bytes = staging_bytes = 0

    def __init__(self, plan: OffloadPlan, device: torch.device):
        self.order = list(plan.layers)
        self.host: list[torch.Tensor] = []
        for layer in self.order:
            host, offsets = _packed(plan.groups[layer])
            if device.type == "cuda":
                from voltllm.host_memory import device_view, page_lock_for

                page_lock_for(self, host)
                base = device_view(host, device)
            else:
                base = host
            for g, at in zip(plan.groups[layer], offsets):
                g.repoint(base[at:at + g.nbytes])
            self.host.append(host)
        self.layer_bytes = [h.numel() for h in self.host]

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.layer_bytes)

    def remove(self) -> None:
        pass


class LayerStreamer:
    """The offloaded layers' host copies, the GPU staging slots and the forward hooks that fill them (module
    docstring)."""

    def __init__(self, layers: nn.ModuleList, plan: OffloadPlan, prefetch_step: int, device: torch.device):
        self.device = device
        self.order = list(plan.layers)
        self.position = {layer: j for j, layer in enumerate(self.order)}
        n = len(self.order)
        self.num_slots = max(1, min(prefetch_step + 1, n))
        self.prefetch = self.num_slots - 1
        # each offloaded layer's storages at aligned offsets, the same in its host buffer and in its slot; packed and
        # re-pointed a layer at a time, so host memory holds one layer twice at most
        self.layer_bytes = [plan.layer_bytes[layer] for layer in self.order]
        self.slot_bytes = max(self.layer_bytes, default=0)
        self.slots = torch.empty((self.num_slots, self.slot_bytes), dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        self.host: list[torch.Tensor] = []
        for j, layer in enumerate(self.order):
            host, offsets = _packed(plan.groups[layer])
            for g, at in zip(plan.groups[layer], offsets):
                g.repoint(self.slots[j % self.num_slots, at:at + g.nbytes])
            if pin:
                from voltllm.host_memory import page_lock_for

                page_lock_for(self, host)
            self.host.append(host)
        for j in range(self.num_slots):  # valid weights before the first forward (start-up tuners time these GEMMs)
            self._copy(j)
        self.stream = torch.cuda.Stream(device) if pin and self.prefetch > 0 else None
        self.copied = [torch.cuda.Event() for _ in self.order] if self.stream is not None else []
        self._hooks = [layers[i].register_forward_pre_hook(functools.partial(self._before, i))
                       for i in sorted(set(self.order) | {0})]

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def staging_bytes(self) -> int:
        return self.slots.numel()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _copy(self, j: int) -> None:
        n = self.layer_bytes[j]
        self.slots[j % self.num_slots, :n].copy_(self.host[j], non_blocking=True)

    def _prefetch(self, j: int) -> None:
        # the slot's previous user ran before everything the compute stream has queued so far
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._copy(j)
        self.copied[j].record(self.stream)

    def _before(self, layer: int, module: nn.Module, args: Any) -> None:
        if layer == 0 and self.stream is not None:  # a forward starts: fill the slots ahead of the first layers
            for j in range(min(self.prefetch, len(self.order))):
                self._prefetch(j)
        j = self.position.get(layer)
        if j is None:
            return
        if self.stream is None:
            self._copy(j)
            return
        torch.cuda.current_stream(self.device).wait_event(self.copied[j])
        if j + self.prefetch < len(self.order):
            self._prefetch(j + self.prefetch)


def _move_to(groups: Iterator[_Group], device: torch.device) -> None:
    for g in groups:
        region = torch.empty(g.nbytes, dtype=torch.uint8, device=device)
        region.copy_(g.bytes_view())
        g.repoint(region)


def check_host_room(model_path: str) -> None:
    """Before the decoder layers are built in CPU memory: the checkpoint's weight files (a bound on what they take
    there) must fit the memory the host has available, or loading would end in the kernel's OOM killer."""
    import os

    from voltllm.cache.cpu_offload import host_available_bytes

    available = host_available_bytes()
    if available is None or not os.path.exists(model_path):
        return
    files = [model_path] if os.path.isfile(model_path) else [
        os.path.join(model_path, f) for f in os.listdir(model_path) if f.endswith((".safetensors", ".gguf", ".bin"))]
    size = sum(os.path.getsize(f) for f in files)
    if size > available:
        raise RuntimeError(f"weight offloading builds the decoder layers in CPU memory first: the checkpoint's "
                           f"{size / 2**30:.1f} GiB of weights do not fit the {available / 2**30:.1f} GiB this host "
                           "has available (MemAvailable in /proc/meminfo)")


def install_weight_offload(model: nn.Module, cfg: WeightOffloadConfig,
                           device: torch.device) -> Union[LayerStreamer, HostResidentLayers]:
    """Offload the layers the plan chooses and move every other host-built tensor to `device` (module docstring);
    returns the LayerStreamer whose hooks now run in every forward (prefetch), or the HostResidentLayers (uva)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    plan = plan_offload(model, cfg)
    if not plan.layers:
        why = (f" (--cpu-offload-params {' '.join(cfg.params)} matches none)" if cfg.params else
               f" (--offload-group-size {cfg.group_size} with {len(model.layers)} layers picks none)"
               if cfg.group_size > len(model.layers) else "")
        raise RuntimeError("weight offloading: no decoder layer holds a tensor it could offload" + why)
    offloaded = {g.key for gs in plan.groups.values() for g in gs}
    everything = _groups(reachable_tensors(model))
    watch = [StorageWeakRef(g.storage) for g in everything.values()
             if g.key in offloaded or (g.tensors[0].tensor.device != device)]
    _move_to((g for key, g in everything.items() if key not in offloaded and g.tensors[0].tensor.device != device),
             device)
    streamer = (HostResidentLayers(plan, device) if cfg.backend == "uva"
                else LayerStreamer(model.layers, plan, cfg.prefetch_step, device))
    # the model keeps what its tensors now view (host buffers, their registration, the slots) alive as long as itself
    model.weight_offload_holder = streamer
    del everything, plan
    alive = sum(not w.expired() for w in watch)
    if alive:
        streamer.remove()
        raise RuntimeError(f"weight offloading: {alive} weight storage(s) are still referenced by something the "
                           "offloader cannot re-point (a tensor cached outside the model's modules); not starting "
                           "with stale copies")
    return streamer


def describe(streamer: Union[LayerStreamer, HostResidentLayers], num_layers: int) -> str:
    gib = 2**30
    if isinstance(streamer, HostResidentLayers):
        return (f"{len(streamer.order)} of {num_layers} decoder layers ({streamer.offloaded_bytes / gib:.2f} GiB) in "
                "CPU memory, read in place over the bus (--offload-backend uva); GPU memory saved "
                f"{streamer.offloaded_bytes / gib:.2f} GiB")
    saved = streamer.offloaded_bytes - streamer.staging_bytes
    return (f"{len(streamer.order)} of {num_layers} decoder layers ({streamer.offloaded_bytes / gib:.2f} GiB) in CPU "
            f"memory, copied to {streamer.num_slots} GPU staging slot(s) of {streamer.slot_bytes / gib:.2f} GiB "
            f"{streamer.prefetch} layer(s) ahead; GPU memory saved {saved / gib:.2f} GiB; every forward copies "
            f"{streamer.offloaded_bytes / gib:.2f} GiB over the bus")
