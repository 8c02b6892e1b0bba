"""Processed images and videos kept by the sha256 of their encoded bytes (vLLM's --mm-processor-cache-gb): a chat
resends its images and videos with every turn, and decoding, resizing and normalizing them again costs milliseconds
per image and far more per video. Least recently used first out, up to a byte budget; 0 keeps nothing."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Callable, TypeVar

V = TypeVar("V")


class ProcessedCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self._items: OrderedDict[tuple[str, bytes], tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # (the server processes a request's items on worker threads)

    def get_or_make(self, kind: str, data: bytes, make: Callable[[], V], size: Callable[[V], int]) -> V:
        """The processed item of `data` (encoded bytes of a `kind`): kept, or made by `make` and kept when it fits.
        Two threads making the same item at once both make it (no lock is held while making)."""
        if not self.max_bytes:
            return make()
        key = (kind, hashlib.sha256(data).digest())
        with self._lock:
            kept = self._items.get(key)
            if kept is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return kept[0]
            self.misses += 1
        value = make()
        n = int(size(value))
        if n > self.max_bytes:
            return value
        with self._lock:
            if key not in self._items:
                self._items[key] = (value, n)
                self.bytes += n
                while self.bytes > self.max_bytes:
                    self.bytes -= self._items.popitem(last=False)[1][1]
        return value

    def __len__(self) -> int:
        return len(self._items)
