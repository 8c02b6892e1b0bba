"""What every layer needs for one forward step besides its input: attention metadata and the caches."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from voltllm.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per attention layer, indexed by the layer's kv_index
    backend: AttentionBackend
    extra: dict[str, Any] = field(default_factory=dict)  # seam: recurrent-state slots for hybrid layers
    # --calculate-kv-scales: attention layers set their k/v scales from this step's K/V (the runner sets it on
    # its first real forward only; voltllm.attention.kv_spec.calc_kv_scales)
    calc_kv_scales: bool = False
    # --calculate-key-offsets: attention layers set their key offsets from this step's keys (same forward)
    calc_key_offsets: bool = False
