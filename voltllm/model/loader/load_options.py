"""vLLM's weight-file load options: --ignore-patterns (files of the checkpoint left out, on the Hub and on disk) and
--pt-load-map-location (where torch.load puts a legacy .bin checkpoint's tensors first)."""
from __future__ import annotations

import fnmatch
import os
from typing import Any, Iterable, Union

# the original/ folder: Meta's consolidated weights, which some repos carry beside the Hugging Face shards. vLLM's
# default says "original/**/*", which under fnmatch (huggingface_hub's matching, and ours) misses the folder's own
# files; fnmatch's '*' crosses folders, so "original/*" leaves all of it out
DEFAULT_IGNORE_PATTERNS = ("original/*",)

MapLocation = Union[str, dict]


def ignore_patterns_of(value: Any, flag: str = "--ignore-patterns") -> tuple[str, ...]:
    """The patterns of a flag value: glob patterns relative to the model's directory (a list, or one string); none
    given (None, []) is vLLM's default. An empty pattern is refused: it would say nothing."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return DEFAULT_IGNORE_PATTERNS
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, str) for p in items):
        raise ValueError(f"{flag}: expected glob patterns (strings), got {value!r}")
    patterns = tuple(p.strip() for p in items)
    if any(not p for p in patterns):
        raise ValueError(f"{flag}: an empty pattern in {value!r}")
    return patterns


def is_ignored(path: str, root: str, patterns: Iterable[str]) -> bool:
    """Whether `path` (a file under `root`) matches a pattern, matched against its path relative to `root` with '/'
    separators, as huggingface_hub matches a repo's files (fnmatch: '*' crosses folders)."""
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    return any(fnmatch.fnmatch(rel, p) for p in patterns)


def kept_files(files: Iterable[str], root: str, patterns: Iterable[str]) -> list[str]:
    patterns = tuple(patterns)
    return [f for f in files if not is_ignored(f, root, patterns)]


def map_location_of(value: Any, flag: str = "--pt-load-map-location") -> MapLocation:
    """torch.load's map_location from a flag value: a device ("cpu", "cuda", "cuda:1") or a JSON object mapping the
    checkpoint's devices to others ({"cuda:1": "cuda:0"}), as vLLM takes it."""
    import torch

    if value is None:
        return "cpu"
    if isinstance(value, str) and value.lstrip().startswith("{"):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: not valid JSON ({e.msg} at character {e.pos}): {value!r}") from None
    pairs = value.items() if isinstance(value, dict) else [("", value)]
    for source, target in pairs:
        if not isinstance(source, str) or not isinstance(target, str):
            raise ValueError(f"{flag}: expected a device name or a JSON object of device names, got {value!r}")
        for name in ((source, target) if isinstance(value, dict) else (target,)):
            try:
                torch.device(name)
            except RuntimeError:
                raise ValueError(f"{flag}: {name!r} is not a device (e.g. cpu, cuda, cuda:0)") from None
    return dict(value) if isinstance(value, dict) else value
