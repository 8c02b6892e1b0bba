"""Chained block hashes for prefix caching.

hash(block i) = H(hash(block i-1) | token ids of block i | extra keys). Extra keys (a cache salt, a LoRA adapter's
key: its name and the engine's serial number of that load, lora/manager.py LoRAKey) go into the first block, so
different tenants, and different adapters (or an adapter and the base model: their KV differ), never share blocks;
the chain carries them into every later block. A reloaded adapter (removed, or loaded in place) is a new key, so the
blocks its old weights computed are never read for it. The adapter's key is tagged (("lora", name, serial)) so that
no cache salt can stand for it. An image's placeholder tokens are the same ids whatever the image: each block holding
some of them carries the image's content hash (tagged ("image", hash)), so prompts that differ only in their images
share no block from the first image on. A prompt given as embedding rows (engine/prompt_embeds.py) carries its rows'
hashes the same way (one per 16 rows): the request's content spans.

The hash function is --prefix-caching-hash-algo's (HASH_ALGOS): voltllm's own blake2b-128 by default, or one of
vLLM's four, each over the same three parts. The `_cbor` forms hash a canonical CBOR encoding of
(parent, token ids, extra keys) as vLLM's do (reproducible outside Python); the others hash the parts' bytes.
"""
from __future__ import annotations

import bisect
import hashlib
from array import array
from typing import Any, Optional, Sequence

NONE_HASH = b"voltllm-root"
DEFAULT_HASH_ALGO = "blake2b"
# --prefix-caching-hash-algo's choices -> the package each needs beyond the standard library (None: none)
HASH_ALGOS = {"blake2b": None, "sha256": None, "sha256_cbor": "cbor2", "xxhash": "xxhash", "xxhash_cbor": "xxhash"}


def check_hash_algo(algo: str) -> None:
    """Refuse an unknown algorithm, or one whose packages are not installed, saying what to do (ValueError)."""
    if algo not in HASH_ALGOS:
        raise ValueError(f"--prefix-caching-hash-algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")
    needs = [m for m in (HASH_ALGOS[algo], "cbor2" if algo.endswith("_cbor") else None) if m]
    for module in dict.fromkeys(needs):
        try:
            __import__(module)
        except ImportError:
            raise ValueError(f"--prefix-caching-hash-algo {algo} needs the {module} package: pip install {module}"
                             ) from None


def hash_block(parent: Optional[bytes], token_ids: Sequence[int], extra_keys: Optional[tuple] = None,
               algo: str = DEFAULT_HASH_ALGO) -> bytes:
    if algo == DEFAULT_HASH_ALGO:
        h = hashlib.blake2b(digest_size=16)
        h.update(parent or NONE_HASH)
        h.update(array("q", token_ids).tobytes())
        if extra_keys:
            h.update(repr(extra_keys).encode())
        return h.digest()
    if algo.endswith("_cbor"):
        import cbor2  # (installed: check_hash_algo ran at start-up)

        data = cbor2.dumps([parent or NONE_HASH, list(token_ids), _cbor_value(extra_keys)], canonical=True)
    else:
        data = b"".join((parent or NONE_HASH, array("q", token_ids).tobytes(),
                         repr(extra_keys).encode() if extra_keys else b""))
    if algo.startswith("sha256"):
        return hashlib.sha256(data).digest()
    import xxhash

    return xxhash.xxh3_128_digest(data)


def _cbor_value(value: Any) -> Any:
    """Extra keys for CBOR: strings, ints and bytes as they are, tuples as arrays, anything else by its repr()."""
    if value is None or isinstance(value, (str, int, bytes)):
        return value
    if isinstance(value, (tuple, list)):
        return [_cbor_value(v) for v in value]
    return repr(value)


def first_block_keys(cache_salt: Optional[str] = None, lora_key: Optional[tuple] = None) -> Optional[tuple]:
    """The first block's extra keys (None without any: the hashes of plain requests do not change)."""
    keys = ((cache_salt,) if cache_salt else ()) + ((("lora", *lora_key),) if lora_key else ())
    return keys or None


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        cache_salt: Optional[str] = None, lora_key: Optional[tuple] = None,
                        content_spans: Sequence[tuple[int, int, bytes]] = (), algo: str = DEFAULT_HASH_ALGO) -> None:
    """Append the hashes of newly full blocks of token_ids to hashes (in place). content_spans: (start, end, content
    hash) of the prompt's images' placeholder tokens (or of its embedding rows: engine/prompt_embeds.py), in order,
    not overlapping; algo: --prefix-caching-hash-algo's."""
    num_full = len(token_ids) // block_size
    # (a 32K-row embeddings prompt has 2K spans: each block finds its own by bisection, not by a scan of them all)
    ends = [end for _, end, _ in content_spans] if content_spans and num_full > len(hashes) else None
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i > 0 else None
        extra = first_block_keys(cache_salt, lora_key) if i == 0 else None
        lo, hi = i * block_size, (i + 1) * block_size
        contents: list = []
        if ends is not None:
            j = bisect.bisect_right(ends, lo)  # the first span ending past lo
            while j < len(content_spans) and content_spans[j][0] < hi:
                contents.append(("image", content_spans[j][2]))
                j += 1
        if contents:
            extra = (extra or ()) + tuple(contents)
        hashes.append(hash_block(parent, token_ids[lo:hi], extra, algo))


def extend_request_hashes(req: Any, block_size: int, algo: str = DEFAULT_HASH_ALGO) -> None:
    """extend_block_hashes for an engine Request: its tokens, salt, adapter key and images."""
    extend_block_hashes(req.block_hashes, req.all_token_ids, block_size, req.cache_salt, req.lora_key,
                        req.content_spans, algo)
