"""A disk cache for the tokenizers that transformers converts from GGUF files.

A GGUF file holds no tokenizer.json. `AutoTokenizer.from_pretrained(dir, gguf_file=...)` reads the vocabulary and
merges out of the file's metadata and converts them, on every load: about 6-8 s for SmolLM2's 49K vocabulary, at every
start. Instead the converted tokenizer is saved once (save_pretrained) to `gguf-tokenizers/<key>` in voltllm's cache
(default_model.gguf_tokenizer_cache_dir()), and later loads of the same file read that tokenizer.json (well under 1 s).

- Key: a hash of the file's absolute path, size and mtime_ns, the transformers and tokenizers versions (another
  version may convert differently) and FORMAT_VERSION. A changed file or library gets a new entry.
- An entry appears whole or not at all: it is written to a temporary folder in the cache root and renamed into place.
  Two processes that race both convert; the one that renames second discards its copy.
- A cache that cannot be written (read-only home, full disk) costs only the conversion (one warning per process).
  An entry that cannot be read, or whose files no longer match the checksums recorded in it, is converted again and
  replaced. Writing an entry deletes the entries whose GGUF file is gone or has changed.
- What save_pretrained does not carry is put back on load: the backend tokenizer exactly as converted (a class with
  its own __init__, such as Qwen2Tokenizer, would otherwise rebuild its normalizer and pre-tokenizer from
  tokenizer.json's vocabulary: a qwen2 GGUF's tokenizer would gain an NFC normalizer), add_bos_token / add_eos_token
  (not saved; the BOS itself is in tokenizer.json's post-processor) and name_or_path.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Optional

logger = logging.getLogger("voltllm")

FORMAT_VERSION = 1  # bump when what an entry holds, or how it is read back, changes
META_FILE = "voltllm-gguf-tokenizer.json"  # written last: the stamp, the class, the flags, the files' sha256
_STALE_TMP_S = 24 * 3600  # temporary folders older than this were left by a process that died while writing
_warned_roots: set[str] = set()


# GGUF architectures voltllm reads whose config transformers cannot rebuild from the file: AutoTokenizer reads the
# config first and fails on them, so their tokenizer is converted by the class transformers gives voltllm's config
_NO_TRANSFORMERS_CONFIG = ("qwen3next", "qwen2vl", "qwen3vl", "qwen3vlmoe")


def build_gguf_tokenizer(path: str) -> Any:
    """The tokenizer as transformers converts it from the GGUF file (the slow path the cache saves)."""
    from transformers import AutoTokenizer

    from voltllm.model.loader.gguf_loader import gguf_architecture, gguf_config

    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    if gguf_architecture(path) in _NO_TRANSFORMERS_CONFIG:
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

        cls_name = TOKENIZER_MAPPING_NAMES.get(gguf_config(path).model_type) or "TokenizersBackend"
        return tokenizer_class_from_name(cls_name).from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _stamp(source: str) -> dict[str, Any]:
    import tokenizers
    import transformers

    st = os.stat(source)
    return {"format": FORMAT_VERSION, "source": source, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def cache_key(stamp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:32]


def cache_entry(path: str, cache_dir: Optional[str] = None) -> str:
    """The folder that holds (or will hold) the cached tokenizer of the GGUF file `path`."""
    return os.path.join(_root(cache_dir), cache_key(_stamp(os.path.abspath(path))))


def _root(cache_dir: Optional[str]) -> str:
    if cache_dir is None:
        from voltllm.model.loader.default_model import gguf_tokenizer_cache_dir

        cache_dir = gguf_tokenizer_cache_dir()
    return os.path.abspath(os.path.expanduser(cache_dir))


def load_gguf_tokenizer(path: str, cache_dir: Optional[str] = None) -> Any:
    """The tokenizer of the GGUF file `path`: from the cache when it holds this file's, else converted and cached.
    cache_dir: the cache root (default: default_model.gguf_tokenizer_cache_dir())."""
    root = _root(cache_dir)
    stamp = _stamp(os.path.abspath(path))
    entry = os.path.join(root, cache_key(stamp))
    tokenizer = _read(entry, stamp)
    if tokenizer is None:
        replace = os.path.lexists(entry)  # there but unreadable: replace it
        tokenizer = build_gguf_tokenizer(path)
        _write(tokenizer, root, entry, stamp, replace)
    else:
        tokenizer.name_or_path = os.path.dirname(path) or "."  # what the conversion gives
    return tokenizer


def _sha256(file: str) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read(entry: str, stamp: dict[str, Any]) -> Any:
    if not os.path.lexists(entry):
        return None
    try:
        with open(os.path.join(entry, META_FILE)) as f:
            meta = json.load(f)
        if {k: meta.get(k) for k in stamp} != stamp:
            raise ValueError(f"{META_FILE} is for {meta.get('source')!r}, not this file")
        files = meta["files"]
        if sorted(files) != sorted(n for n in os.listdir(entry) if n != META_FILE):
            raise ValueError(f"files {sorted(os.listdir(entry))}, expected {sorted(files)} and {META_FILE}")
        for name, digest in files.items():
            if _sha256(os.path.join(entry, name)) != digest:
                raise ValueError(f"{name} does not match its recorded sha256")
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer

        kwargs = {}
        if meta["class"] != "TokenizersBackend":  # a class of its own would rebuild the backend: hand it the saved one
            kwargs["tokenizer_object"] = Tokenizer.from_file(os.path.join(entry, "tokenizer.json"))
        tokenizer = AutoTokenizer.from_pretrained(entry, **kwargs)
        if type(tokenizer).__name__ != meta["class"]:
            raise ValueError(f"read back as {type(tokenizer).__name__}, converted as {meta['class']}")
        for flag in ("add_bos_token", "add_eos_token"):
            if bool(getattr(tokenizer, flag, False)) != meta[flag]:
                setattr(tokenizer, flag, meta[flag])
        return tokenizer
    except Exception as e:  # whatever is wrong with the entry, the GGUF file still has the tokenizer
        logger.warning("cached GGUF tokenizer %s is unreadable (%s: %s); converting %s again",
                       entry, type(e).__name__, e, stamp["source"])
        return None


def _write(tokenizer: Any, root: str, entry: str, stamp: dict[str, Any], replace: bool) -> None:
    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        tokenizer.save_pretrained(tmp)
        files = {name: _sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        meta = {**stamp, "class": type(tokenizer).__name__, "add_bos_token": bool(tokenizer.add_bos_token),
                "add_eos_token": bool(tokenizer.add_eos_token), "files": files}
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if replace and os.path.lexists(entry):
            _remove(entry, root)
        try:
            os.rename(tmp, entry)
            tmp = None
        except OSError:
            if not os.path.isdir(entry):
                raise
            # another process placed it first: keep theirs (the finally discards ours)
        _prune(root, keep=entry)
    except Exception as e:  # the cache is an optimization: the load goes on without it
        if root not in _warned_roots:
            _warned_roots.add(root)
            logger.warning("could not cache the GGUF tokenizer in %s (%s: %s); it will be converted again next "
                           "time", root, type(e).__name__, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: str, root: str) -> None:
    """Move `path` out of the way in one rename (readers see it whole or gone), then delete it."""
    aside = tempfile.mkdtemp(prefix=".old-", dir=root)
    try:
        os.rename(path, os.path.join(aside, "entry"))
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _prune(root: str, keep: str) -> None:
    """Delete the entries whose GGUF file is gone or has changed (nothing can use them again), and temporary folders
    left by processes that died while writing. Entries of other library versions for an unchanged file stay."""
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if name.startswith("."):
                if now - os.lstat(path).st_mtime > _STALE_TMP_S:
                    shutil.rmtree(path, ignore_errors=True)
                continue
            if path == keep:
                continue
            with open(os.path.join(path, META_FILE)) as f:
                meta = json.load(f)
            try:
                st = os.stat(meta["source"])
            except FileNotFoundError:
                st = None
            if st is None or (st.st_size, st.st_mtime_ns) != (meta["size"], meta["mtime_ns"]):
                _remove(path, root)
        except Exception as e:  # an entry being written or replaced meanwhile, a foreign file: leave it
            logger.debug("gguf tokenizer cache: left %s alone (%s)", path, e)
