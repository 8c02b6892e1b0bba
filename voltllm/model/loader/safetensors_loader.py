"""Weights from a Hugging Face directory of .safetensors files (or a legacy pytorch_model.bin)."""
from __future__ import annotations

import glob
import os
from typing import Callable, Iterable, Iterator, Optional

import torch

from voltllm.model.loader.load_options import MapLocation, kept_files


def weight_files(path: str, pattern: str, ignore: Iterable[str] = ()) -> list[str]:
    """The directory's files matching `pattern`, less those --ignore-patterns leaves out."""
    return kept_files(sorted(glob.glob(os.path.join(path, pattern))), path, ignore)


def safetensors_weights(path: str, only: Optional[Callable[[str], bool]] = None, progress: bool = False,
                        ignore: Iterable[str] = (), map_location: MapLocation = "cpu"
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """only: the names to read (the others' data is never touched); progress: a bar over the files
    (--use-tqdm-on-load); ignore: --ignore-patterns; map_location: where torch.load puts a .bin checkpoint's tensors
    first (--pt-load-map-location; for checkpoints that load only there), before they come to the CPU as all others."""
    from safetensors import safe_open

    from voltllm.model.loader.load_progress import load_progress

    files = weight_files(path, "*.safetensors", ignore)
    if not files:
        bins = weight_files(path, "pytorch_model*.bin", ignore)
        if not bins:
            from voltllm.model.loader import ModelLoadError

            present = glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin"))
            left_out = f" (--ignore-patterns {' '.join(ignore)} left out those there)" if present else ""
            raise ModelLoadError(f"no .safetensors (or pytorch_model.bin) weights in {path}{left_out}")
        for b in load_progress(bins, progress, "Loading pt checkpoint shards", "shard"):
            yield from ((n, t.cpu()) for n, t in torch.load(b, map_location=map_location, weights_only=True).items()
                        if only is None or only(n))
        return
    for f in load_progress(files, progress, "Loading safetensors checkpoint shards", "shard"):
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                if only is None or only(name):
                    yield name, st.get_tensor(name)


def stored_elements(path: str, count: Callable[[str, int], int], ignore: Iterable[str] = ()) -> int:
    """Sum of count(name, elements) over the tensors of the directory's .safetensors files (less those `ignore`
    leaves out), read from their headers only (no tensor data)."""
    from safetensors import safe_open

    total = 0
    for f in weight_files(path, "*.safetensors", ignore):
        with safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += count(name, n)
    return total
