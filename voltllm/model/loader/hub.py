"""Models named by a Hugging Face Hub repo id (`voltllm serve Qwen/Qwen3-8B`), as vLLM takes them.

huggingface_hub (transformers' own dependency) fetches the files the engine reads, config, safetensors weights,
tokenizer files and chat templates (and the repo's Python files with --trust-remote-code), into its cache
(~/.cache/huggingface/hub, or --download-dir), resumable, with its progress bars. A repo already in the cache at
the asked revision is used without the network, so a server restarts offline. Authentication: --hf-token, else
what huggingface_hub finds itself (a `hf auth login` token, or HF_TOKEN: its behaviour, not ours).
"""
from __future__ import annotations

import os
import re
import sys
from typing import Optional, Union

from voltllm.model.loader import ModelLoadError

# what the engine reads from a Hugging Face model repo: config, tokenizer files and chat templates, and the weights
# as safetensors (no *.bin / *.pt / *.gguf)
TOKENIZER_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
MODEL_PATTERNS = TOKENIZER_PATTERNS + ("*.safetensors",)

Token = Union[bool, str, None]


def looks_like_repo_id(name: str) -> bool:
    """A model argument that names a Hub repo ("owner/name", or a legacy bare "name") and no local path."""
    if not name or os.path.exists(os.path.expanduser(name)) or name.startswith((".", "/", "~")):
        return False
    if name.endswith(".gguf") or name.count("/") > 1 or "\\" in name:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def fetch_repo(repo_id: str, revision: Optional[str] = None, download_dir: Optional[str] = None,
               token: Token = None, trust_remote_code: bool = False, tokenizer_only: bool = False,
               patterns: Optional[list[str]] = None, offline_first: bool = True) -> str:
    """The local snapshot directory of `repo_id` at `revision`: from the cache when it is there (no network),
    else downloaded. `patterns`: the files to fetch instead of a model's (config, tokenizer, safetensors).
    Raises ModelLoadError with what went wrong and what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if patterns is None:
        patterns = list(TOKENIZER_PATTERNS if tokenizer_only else MODEL_PATTERNS)
        if trust_remote_code:
            patterns.append("*.py")
    kw = dict(revision=revision, cache_dir=download_dir, token=token, allow_patterns=patterns)
    at = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    if offline_first:
        try:
            return snapshot_download(repo_id, local_files_only=True, **kw)
        except LocalEntryNotFoundError:
            pass  # not cached yet
    where = download_dir or "the Hugging Face cache"
    print(f"voltllm: fetching {at} from the Hugging Face Hub into {where}", file=sys.stderr, flush=True)
    try:
        return snapshot_download(repo_id, **kw)
    except GatedRepoError:
        raise ModelLoadError(f"model {at} is gated on the Hugging Face Hub: accept its terms on the model page, "
                             "then pass --hf-token (or log in with `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"model {at} is neither a local path nor a repository on the Hugging Face Hub "
                             "(a private repository needs --hf-token)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"model {repo_id}: revision {revision!r} not found on the Hugging Face Hub") from None
    except OSError as e:  # network, disk, and huggingface_hub's HTTP errors (all OSErrors)
        raise ModelLoadError(f"model {at} is not a local path, and fetching it from the Hugging Face Hub failed: "
                             f"{type(e).__name__}: {str(e).rstrip('. ')}. Give a local model directory or .gguf file, "
                             "or check the network / --download-dir") from None


_GGUF_QUANT = re.compile(r"(?P<repo>[^:]+):(?P<quant>[A-Za-z0-9_]+)")


def gguf_quant_ref(name: str) -> Optional[tuple[str, str]]:
    """(repo id, quantization) of a `owner/name:QUANT` model argument (vLLM's way to pick one GGUF file of a
    repo, e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M); None for anything else."""
    m = _GGUF_QUANT.fullmatch(name or "")
    if m is None or not looks_like_repo_id(m.group("repo")):
        return None
    return m.group("repo"), m.group("quant")


def fetch_gguf(repo_id: str, quant: str, revision: Optional[str] = None, download_dir: Optional[str] = None,
               token: Token = None) -> str:
    """The local path of the repo's one GGUF model of quantization `quant` (any letter case, as uploaders name them),
    fetched alone (a GGUF repo holds every quantization): a single `*<quant>.gguf` file, or the first part of a split
    one (`*<quant>-00001-of-0000N.gguf`, ..., at the top or in a folder per quantization, as big models come)."""
    split = "-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]"
    patterns = sorted({f"*{q}{tail}.gguf" for q in (quant, quant.upper(), quant.lower()) for tail in ("", split)})
    from voltllm.model.loader.gguf_loader import first_split_file

    def complete(snapshot: str) -> bool:
        found = _gguf_models(snapshot, quant)
        try:
            return len(found) == 1 and bool(first_split_file(os.path.join(snapshot, found[0])))
        except ValueError:
            return False

    path = fetch_repo(repo_id, revision, download_dir, token, patterns=patterns)
    if not complete(path):  # a cached snapshot without this quantization (or some of its parts): fetch it
        path = fetch_repo(repo_id, revision, download_dir, token, patterns=patterns, offline_first=False)
    found = _gguf_models(path, quant)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(found)})"
        raise ModelLoadError(f"Hugging Face repo {repo_id} has {what} .gguf model named *{quant}.gguf (or split as "
                             f"*{quant}-00001-of-0000N.gguf); name one quantization the repo holds (e.g. Q4_K_M), or "
                             "download the file and pass its path")
    try:
        return first_split_file(os.path.join(path, found[0]))
    except ValueError as e:  # a split model whose parts did not all come
        raise ModelLoadError(f"Hugging Face repo {repo_id}: {e}") from None


_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}$")


def _gguf_models(snapshot: str, quant: str) -> list[str]:
    """The GGUF models of quantization `quant` in a snapshot (paths relative to it): single files and split models
    (named by their first part), anywhere in the tree."""
    found = set()
    for folder, _, files in os.walk(snapshot):
        for f in files:
            if not f.lower().endswith(".gguf") or f.lower().startswith("mmproj"):  # (a vision projector file)
                continue
            stem = f[: -len(".gguf")]
            part = _SPLIT_PART.search(stem)
            if part is not None:
                stem = stem[: part.start()]
            if stem.lower().endswith(quant.lower()):
                rel = os.path.relpath(os.path.join(folder, f), snapshot)
                found.add(re.sub(r"-\d{5}(-of-\d{5}\.gguf)$", r"-00001\1", rel) if part is not None else rel)
    return sorted(found)


def require_weights(path: str, repo_id: str) -> None:
    """A fetched model repo must hold a config and safetensors weights (GGUF repos hold many quantizations: the
    user picks one file)."""
    files = os.listdir(path)
    if "config.json" in files and any(f.endswith(".safetensors") for f in files):
        return
    raise ModelLoadError(f"Hugging Face repo {repo_id} has no config.json with safetensors weights (voltllm reads "
                         f"safetensors, or one .gguf file: name its quantization, {repo_id}:Q4_K_M, or download the "
                         ".gguf you want and pass its path)")
