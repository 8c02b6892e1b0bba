"""Weights from a Hugging Face directory of .safetensors files (or a legacy pytorch_model.bin)."""
from __future__ import annotations

import glob
import os
from typing import Callable, Iterator, Optional

import torch


def safetensors_weights(path: str, only: Optional[Callable[[str], bool]] = None,
                        progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """only: the names to read (the others' data is never touched); progress: a bar over the files
    (--use-tqdm-on-load)."""
    from safetensors import safe_open

    from voltllm.model.loader.load_progress import load_progress

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
        if not bins:
            from voltllm.model.loader import ModelLoadError

            raise ModelLoadError(f"no .safetensors (or pytorch_model.bin) weights in {path}")
        for b in load_progress(bins, progress, "Loading pt checkpoint shards", "shard"):
            yield from ((n, t) for n, t in torch.load(b, map_location="cpu", weights_only=True).items()
                        if only is None or only(n))
        return
    for f in load_progress(files, progress, "Loading safetensors checkpoint shards", "shard"):
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                if only is None or only(name):
                    yield name, st.get_tensor(name)


def stored_elements(path: str, count: Callable[[str, int], int]) -> int:
    """Sum of count(name, elements) over the tensors of the directory's .safetensors files, read from their
    headers only (no tensor data)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += count(name, n)
    return total
