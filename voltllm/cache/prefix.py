"""Chained block hashes for prefix caching.

hash(block i) = H(hash(block i-1) | token ids of block i | extra keys). Extra keys (a cache salt, and
later multimodal or LoRA ids) go into the first block so different tenants never share blocks.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

NONE_HASH = b"voltllm-root"


def hash_block(parent: Optional[bytes], token_ids: Sequence[int], extra_keys: Optional[tuple] = None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        cache_salt: Optional[str] = None) -> None:
    """Append the hashes of newly full blocks of token_ids to hashes (in place)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i > 0 else None
        extra = (cache_salt,) if (i == 0 and cache_salt) else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
