"""Models named by a Hugging Face Hub repo id (`voltllm serve Qwen/Qwen3-8B`), as vLLM takes them.

huggingface_hub (transformers' own dependency) fetches the files the engine reads, config, safetensors weights,
tokenizer files and chat templates (and the repo's Python files with --trust-remote-code), into its cache
(~/.cache/huggingface/hub, or --download-dir), resumable, with its progress bars. A repo already in the cache at
the asked revision is used without the network, so a server restarts offline. Authentication: --hf-token, else
what huggingface_hub finds itself (a `hf auth login` token, or HF_TOKEN: its behaviour, not ours).
A vision-language GGUF model named `owner/name:QUANT` comes with its projector (mmproj) file, as llama.cpp's
`-hf owner/name:QUANT` fetches it (fetch_projector).
"""
from __future__ import annotations

import glob
import logging
import os
import re
import sys
from typing import Iterable, Optional, Union

from voltllm.model.loader import ModelLoadError

# what the engine reads from a Hugging Face model repo: config, tokenizer files and chat templates, and the weights
# as safetensors (no *.bin / *.pt / *.gguf)
TOKENIZER_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
MODEL_PATTERNS = TOKENIZER_PATTERNS + ("*.safetensors",)

Token = Union[bool, str, None]
logger = logging.getLogger("voltllm")


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
               patterns: Optional[list[str]] = None, offline_first: bool = True,
               ignore: Optional[list[str]] = None) -> str:
    """The local snapshot directory of `repo_id` at `revision`: from the cache when it is there (no network),
    else downloaded. `patterns`: the files to fetch instead of a model's (config, tokenizer, safetensors); `ignore`:
    files those patterns match that are not to be fetched.
    Raises ModelLoadError with what went wrong and what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if patterns is None:
        patterns = list(TOKENIZER_PATTERNS if tokenizer_only else MODEL_PATTERNS)
        if trust_remote_code:
            patterns.append("*.py")
    kw = dict(revision=revision, cache_dir=download_dir, token=token, allow_patterns=patterns)
    if ignore:
        kw["ignore_patterns"] = ignore
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
               token: Token = None, projector: bool = False) -> tuple[str, Optional[str]]:
    """(the local path of the repo's one GGUF model of quantization `quant`, its projector file or None).
    The model (`quant` in any letter case, as uploaders name them) is fetched alone (a GGUF repo holds every
    quantization): a single `*<quant>.gguf` file, or the first part of a split one (`*<quant>-00001-of-0000N.gguf`,
    ..., at the top or in a folder per quantization, as big models come). projector: also fetch the vision projector
    of a model that takes images (fetch_projector); text-only models get none."""
    split = "-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]"
    # the tag ends the name after a separator (or is the whole name): :F16 must not fetch model-BF16.gguf too
    patterns = sorted({f"{lead}{q}{tail}.gguf" for q in (quant, quant.upper(), quant.lower())
                       for tail in ("", split) for lead in ("*[-._]", "", "*/")})
    from voltllm.model.loader.gguf_loader import first_split_file

    def complete(snapshot: str) -> bool:
        found = _gguf_models(snapshot, quant)
        try:
            return len(found) == 1 and bool(first_split_file(os.path.join(snapshot, found[0])))
        except ValueError:
            return False

    fetch = dict(patterns=patterns, ignore=[_ANY_PROJECTOR])  # (a projector with the same tag: fetch_projector's)
    path = fetch_repo(repo_id, revision, download_dir, token, **fetch)
    if not complete(path):  # a cached snapshot without this quantization (or some of its parts): fetch it
        path = fetch_repo(repo_id, revision, download_dir, token, offline_first=False, **fetch)
    found = _gguf_models(path, quant)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(found)})"
        raise ModelLoadError(f"Hugging Face repo {repo_id} has {what} .gguf model named *{quant}.gguf (or split as "
                             f"*{quant}-00001-of-0000N.gguf); name one quantization the repo holds (e.g. Q4_K_M), or "
                             "download the file and pass its path")
    try:
        model = first_split_file(os.path.join(path, found[0]))
    except ValueError as e:  # a split model whose parts did not all come
        raise ModelLoadError(f"Hugging Face repo {repo_id}: {e}") from None
    if not projector:
        return model, None
    from voltllm.model.loader.gguf_loader import gguf_architecture
    from voltllm.model.loader.gguf_mmproj import MMPROJ_LM_ARCHS

    try:
        if gguf_architecture(model) not in MMPROJ_LM_ARCHS:
            return model, None  # (a text-only model takes none)
    except (OSError, ValueError):
        return model, None  # (a file that is no readable GGUF: reading its config says so)
    return model, fetch_projector(repo_id, path, os.path.relpath(model, path), revision, download_dir, token)


_COMMIT = re.compile(r"[0-9a-f]{40}")
# gguf_mmproj.is_projector_name as a Hub file pattern ("mmproj" in any letter case)
_ANY_PROJECTOR = "*[mM][mM][pP][rR][oO][jJ]*"


def fetch_projector(repo_id: str, snapshot: str, model: str, revision: Optional[str] = None,
                    download_dir: Optional[str] = None, token: Token = None) -> Optional[str]:
    """The vision projector of the GGUF model `model` (a path relative to its fetched `snapshot`), chosen as llama.cpp
    chooses it (pick_projector): one already in the snapshot, without the network (a restart, or offline); else the
    repo's own, fetched alone into the same snapshot (pinned to its commit). None, with one warning line, when the
    repo holds none or it cannot be fetched (offline, network): the model then serves text only, as a vision GGUF
    file without a projector beside it does."""
    cached = pick_projector(_files_under(snapshot), model)
    if cached is not None:
        return os.path.join(snapshot, cached)
    pinned = os.path.basename(os.path.normpath(snapshot))
    pinned = pinned if _COMMIT.fullmatch(pinned) else revision
    text_only = "it serves text only; give its projector with --mmproj PATH for image input"
    from huggingface_hub import list_repo_files

    try:
        chosen = pick_projector(list_repo_files(repo_id, revision=pinned, token=token), model)
        if chosen is None:
            logger.warning("%s: a vision-language GGUF model, but the repo %s holds no projector (mmproj) file: %s",
                           model, repo_id, text_only)
            return None
        path = fetch_repo(repo_id, pinned, download_dir, token, patterns=[glob.escape(chosen)], offline_first=False)
    except (OSError, ModelLoadError) as e:  # (huggingface_hub's offline mode and HTTP errors are OSErrors)
        logger.warning("%s: its projector file could not be fetched from the Hugging Face Hub (%s: %s): %s",
                       model, type(e).__name__, str(e).rstrip(". "), text_only)
        return None
    file = os.path.join(path, chosen)
    if not os.path.isfile(file):
        logger.warning("%s: its projector file %s did not arrive from the Hugging Face Hub: %s", model, chosen,
                       text_only)
        return None
    return file


def _files_under(folder: str) -> list[str]:
    """Every file below `folder`, as "/"-separated paths relative to it (a Hub repo's listing)."""
    return sorted(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
                  for d, _, files in os.walk(folder) for f in files)


_QUANT_TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")


def _quant_bits(path: str) -> int:
    """The bits a GGUF file name's quantization tag gives (its last -/. separated word, first number: Q4_K_M 4,
    UD-Q8_K_XL 8, F16 / BF16 16, F32 32); 0 without one."""
    stem = _SPLIT_PART.sub("", os.path.basename(path)[: -len(".gguf")])
    tag = _QUANT_TAG.search(stem)
    bits = re.search(r"\d+", tag.group(1)) if tag else None
    return int(bits.group()) if bits else 0


def pick_projector(files: Iterable[str], model: str) -> Optional[str]:
    """The projector file, of a repo's `files` ("/"-separated paths), for its GGUF model `model`, by llama.cpp's rule
    for `-hf` (learnt from its common/download.cpp): of the projector files (gguf_mmproj.is_projector_name) in the
    model's folder or a folder above it, the nearest one to the model wins, then the one whose quantization bits
    are closest to the model's (for a Q4_K_M model a Q8_0 projector before F16, F16 before F32), then the first by
    name (BF16 before F16, both 16 bits). None when the repo holds none there."""
    from voltllm.model.loader.gguf_mmproj import is_projector_name

    model = model.replace(os.sep, "/")
    model_folder, bits = model.split("/")[:-1], _quant_bits(model)
    best, best_key = None, None
    for f in sorted(files):
        folder = f.split("/")[:-1]
        if not is_projector_name(f) or folder != model_folder[: len(folder)]:
            continue
        key = (-len(folder), abs(_quant_bits(f) - bits))
        if best_key is None or key < best_key:
            best, best_key = f, key
    return best


_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}$")


def _gguf_models(snapshot: str, quant: str) -> list[str]:
    """The GGUF models of quantization `quant` in a snapshot (paths relative to it): single files and split models
    (named by their first part), anywhere in the tree."""
    from voltllm.model.loader.gguf_mmproj import is_projector_name

    found = set()
    for folder, _, files in os.walk(snapshot):
        for f in files:
            if not f.lower().endswith(".gguf") or is_projector_name(f):  # (a vision projector file)
                continue
            stem = f[: -len(".gguf")]
            part = _SPLIT_PART.search(stem)
            if part is not None:
                stem = stem[: part.start()]
            if stem.lower() == quant.lower() or stem[-len(quant) - 1:-len(quant)] in ("-", ".", "_") and \
                    stem.lower().endswith(quant.lower()):
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
