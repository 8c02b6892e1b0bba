"""--use-tqdm-on-load (vLLM's, on by default): a progress bar on stderr over what a checkpoint load walks (its
safetensors / .bin files, a GGUF file's tensors), advancing as the loader moves on to the next one."""
from __future__ import annotations

from typing import Iterable, TypeVar

T = TypeVar("T")


def load_progress(items: Iterable[T], enabled: bool, desc: str, unit: str) -> Iterable[T]:
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit=unit, dynamic_ncols=True)
