"""Chained block hashes for prefix caching.

hash(block i) = H(hash(block i-1) | token ids of block i | extra keys). Extra keys (a cache salt, a LoRA adapter's
key: its name and the engine's serial number of that load, lora/manager.py LoRAKey) go into the first block, so
different tenants, and different adapters (or an adapter and the base model: their KV differ), never share blocks;
the chain carries them into every later block. A reloaded adapter (removed, or loaded in place) is a new key, so the
blocks its old weights computed are never read for it. The adapter's key is tagged (("lora", name, serial)) so that
no cache salt can stand for it. An image's placeholder tokens are the same ids whatever the image: each block holding
some of them carries the image's content hash (tagged ("image", hash)), so prompts that differ only in their images
share no block from the first image on.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Any, Optional, Sequence

NONE_HASH = b"voltllm-root"


def hash_block(parent: Optional[bytes], token_ids: Sequence[int], extra_keys: Optional[tuple] = None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def first_block_keys(cache_salt: Optional[str] = None, lora_key: Optional[tuple] = None) -> Optional[tuple]:
    """The first block's extra keys (None without any: the hashes of plain requests do not change)."""
    keys = ((cache_salt,) if cache_salt else ()) + ((("lora", *lora_key),) if lora_key else ())
    return keys or None


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        cache_salt: Optional[str] = None, lora_key: Optional[tuple] = None,
                        image_spans: Sequence[tuple[int, int, bytes]] = ()) -> None:
    """Append the hashes of newly full blocks of token_ids to hashes (in place). image_spans: (start, end, content
    hash) of the prompt's images' placeholder tokens."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i > 0 else None
        extra = first_block_keys(cache_salt, lora_key) if i == 0 else None
        lo, hi = i * block_size, (i + 1) * block_size
        images = tuple(("image", h) for start, end, h in image_spans if start < hi and end > lo)
        if images:
            extra = (extra or ()) + images
        hashes.append(hash_block(parent, token_ids[lo:hi], extra))


def extend_request_hashes(req: Any, block_size: int) -> None:
    """extend_block_hashes for an engine Request: its tokens, salt, adapter key and images."""
    extend_block_hashes(req.block_hashes, req.all_token_ids, block_size, req.cache_salt, req.lora_key,
                        req.image_spans)
