"""Which decoder layers attend over a sliding window, read from a checkpoint's config as transformers reads it.

transformers marks each layer in `layer_types` ("sliding_attention" / "full_attention"; qwen2 / qwen3 derive them from
`max_window_layers`) and keeps `sliding_window` only while `use_sliding_window` is on (it sets None otherwise). A
sliding layer's query at position p sees the keys at p - window + 1 .. p (voltllm.attention.backend).
"""
from __future__ import annotations

from typing import Any, Optional


def _window(cfg: Any) -> int:
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return 0
    return 0 if getattr(cfg, "use_sliding_window", True) is False else window


def layer_window(cfg: Any, idx: int) -> int:
    """Decoder layer idx's window; 0: it attends to the whole context."""
    window = _window(cfg)
    types = getattr(cfg, "layer_types", None)
    if not window or types is None:
        return window  # (a config with a window and no layer types: every layer slides)
    return window if idx < len(types) and types[idx] == "sliding_attention" else 0


def model_window(cfg: Any) -> Optional[int]:
    """The window of a config whose layers include sliding ones, else None."""
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    windows = {layer_window(cfg, i) for i in range(layers)} - {0}
    return windows.pop() if windows else None


def turn_off(cfg: Any) -> None:
    """Every layer of `cfg` attends to the whole context from now on (--disable-sliding-window)."""
    cfg.sliding_window = None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        cfg.layer_types = ["full_attention"] * len(types)
