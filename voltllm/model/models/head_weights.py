"""Loading a speculative head's checkpoint tensors (EAGLE-1, EAGLE-3): one tensor into the module's own projections or
parameters, shape-checked, and the keys a complete checkpoint fills."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from voltllm.model.layers.linear import Linear
from voltllm.model.models.llama import layer_tp_part, stacked_target


def load_head_tensor(module: nn.Module, params: dict, name: str, tensor: torch.Tensor, head: str) -> str:
    """Put `tensor` (its checkpoint name in the module's own terms: q / k / v and gate / up are stacked here) into
    `module`; returns its key for expected_head_keys. ValueError naming `head` on a wrong shape or an unknown name.
    A head split over tensor-parallel ranks (`module.tp`) takes this rank's part of its decoder layers' projections
    (the whole tensor elsewhere: fc, norms, an own embedding or LM head)."""
    target, shard = stacked_target(name)
    module_name, _, kind = target.rpartition(".")
    sub = module.get_submodule(module_name) if module_name else None
    tp = getattr(module, "tp", None)
    if tp is not None and isinstance(sub, Linear) and module_name.startswith("layers.") and kind in ("weight", "bias") \
            and module_name.rpartition(".")[2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        layer = module.layers[int(module_name.split(".")[1])]
        tensor = layer_tp_part(layer.self_attn, module.config.intermediate_size, tp, module_name, kind, shard, tensor)
    if isinstance(sub, Linear) and kind in ("weight", "bias"):
        want = (sub.shard_sizes[shard], sub.in_features) if kind == "weight" else (sub.shard_sizes[shard],)
        if tuple(tensor.shape) != want or (kind == "bias" and sub.bias is None):
            raise ValueError(f"{head} weight {name}: shape {tuple(tensor.shape)}, expected "
                             f"{want if kind == 'weight' or sub.bias is not None else 'no bias'}")
        (sub.load_weight if kind == "weight" else sub.load_bias)(tensor, shard)
    elif target in params:
        if params[target].shape != tensor.shape:
            raise ValueError(f"{head} weight {name}: shape {tuple(tensor.shape)}, expected "
                             f"{tuple(params[target].shape)}")
        params[target].data.copy_(tensor)
    else:
        raise ValueError(f"unexpected weight {name!r} in the {head}'s checkpoint")
    return f"{target}#{shard}"


def expected_head_keys(module: nn.Module, param_names: Iterable[str]) -> set[str]:
    """The keys load_head_tensor returns for a complete checkpoint: every projection's weight (and bias) shards, and
    the named parameters."""
    keys = {f"{n}.{kind}#{i}" for n, m in module.named_modules() if isinstance(m, Linear)
            for kind in ("weight", "bias") if kind == "weight" or m.bias is not None for i in range(len(m.shard_sizes))}
    return keys | {f"{n}#0" for n in param_names}


def check_complete(loaded: set[str], want: set[str], head: str) -> None:
    missing = sorted(want - loaded)
    if missing:
        raise ValueError(f"the {head}'s checkpoint is incomplete: no {missing[0].split('#')[0]} (and "
                         f"{len(missing) - 1} more)")
