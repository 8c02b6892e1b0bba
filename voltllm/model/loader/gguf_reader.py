"""The gguf library's reader, opened so that parsing a header costs half the time.

GGUFReader parses a header by slicing its memory map once or twice per value, and slicing an np.memmap runs Python
(numpy's memmap.__array_finalize__ and __getitem__) per slice; a header that holds a tokenizer is ~250K slices
(SmolLM2-135M's 49,152 tokens and merges: 3.9 s on this project's CPU machine, and `voltllm serve` parses it in the
API process and again in the engine's). The reader here slices a plain ndarray view of the same map instead (2.0 s
there): the same fields and tensors, whose data are then ndarray views (the map stays open as their base)."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np


@functools.cache
def _plain_view_reader() -> type:
    from gguf.gguf_reader import GGUFReader

    class PlainViewReader(GGUFReader):
        # GGUFReader.__init__ assigns its np.memmap to self.data, then parses through self.data
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._plain_data = mapped.view(np.ndarray)

    return PlainViewReader


def open_gguf(path: str) -> Any:
    """A read-only gguf.GGUFReader of `path` (a PlainViewReader)."""
    return _plain_view_reader()(path, "r")
