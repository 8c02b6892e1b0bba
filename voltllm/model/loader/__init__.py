"""Model sources: Hugging Face directories (config.json + safetensors + tokenizer) and GGUF files.

Everything downstream sees one shape: a transformers config, a tokenizer, and an iterator of
(HF parameter name, tensor) pairs, whatever the file format.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

from voltllm.model.loader.load_options import DEFAULT_IGNORE_PATTERNS


class ModelLoadError(ValueError):
    """The model path is missing, unreadable or of an unsupported kind."""


@dataclass(frozen=True)
class ModelSource:
    path: str  # directory or .gguf file
    kind: str  # "hf" | "gguf"
    # a Hub GGUF model (owner/name:QUANT): its repo id, and the vision projector fetched with it (None: not asked for,
    # a text-only model, or none to be had: hub.fetch_projector warned)
    hub_repo: Optional[str] = None
    mmproj: Optional[str] = None
    # the checkpoint's files left out (--ignore-patterns, load_options.py; default: original/*), and where
    # torch.load puts a legacy .bin checkpoint's tensors first (--pt-load-map-location)
    ignore_patterns: tuple[str, ...] = DEFAULT_IGNORE_PATTERNS
    pt_map_location: Any = "cpu"

    @property
    def tokenizer_path(self) -> str:
        return self.path


def resolve_model(model: Optional[str], revision: Optional[str] = None, download_dir: Optional[str] = None,
                  token: Any = None, trust_remote_code: bool = False, projector: bool = False,
                  ignore_patterns: tuple[str, ...] = DEFAULT_IGNORE_PATTERNS,
                  pt_map_location: Any = "cpu") -> ModelSource:
    """Turn a --model value into a source; None means the embedded default model. A name that is no local path
    but a Hugging Face Hub repo id is fetched (or found in the cache) first: loader/hub.py. projector: with an
    owner/name:QUANT vision-language model, fetch its projector file too (the engine's model, unless --mmproj,
    --no-mmproj or --language-model-only). ignore_patterns / pt_map_location: the source's load options (a Hub
    fetch leaves the ignored files out too)."""
    source = _resolve(model, revision, download_dir, token, trust_remote_code, projector, ignore_patterns)
    if source.kind == "hf":
        source = replace(source, ignore_patterns=tuple(ignore_patterns), pt_map_location=pt_map_location)
    return source


def _resolve(model: Optional[str], revision: Optional[str], download_dir: Optional[str], token: Any,
             trust_remote_code: bool, projector: bool, ignore_patterns: tuple[str, ...]) -> ModelSource:
    if model is None:
        from voltllm.model.loader.default_model import ensure_default_model

        model = ensure_default_model()
    from voltllm.model.loader import hub

    if (ref := hub.gguf_quant_ref(model)) is not None:  # owner/name:QUANT: one GGUF file of a repo
        path, mmproj = hub.fetch_gguf(*ref, revision, download_dir, token, projector=projector)
        return ModelSource(path=path, kind="gguf", hub_repo=ref[0], mmproj=mmproj)
    if hub.looks_like_repo_id(model):
        path = hub.fetch_repo(model, revision, download_dir, token, trust_remote_code, ignore=list(ignore_patterns))
        hub.require_weights(path, model)
        return ModelSource(path=path, kind="hf")
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"model file {model!r} is not a .gguf file")
        return ModelSource(path=_gguf_model_file(path), kind="gguf")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path=path, kind="hf")
        from voltllm.model.loader.gguf_mmproj import is_projector_name

        # (*mmproj*.gguf: llama.cpp's vision projector beside a model, not a model)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf") and not is_projector_name(f))
        models = sorted({_gguf_model_file(os.path.join(path, f)) for f in ggufs})  # a split model counts once
        if len(models) == 1:
            return ModelSource(path=models[0], kind="gguf")
        raise ModelLoadError(f"model directory {model!r} has no config.json (nor exactly one .gguf model: found "
                             f"{len(models)})")
    raise ModelLoadError(f"model {model!r} not found: give a local Hugging Face directory, a .gguf file or a "
                         "Hugging Face Hub repo id (owner/name)")


def _gguf_model_file(path: str) -> str:
    """The file a GGUF model is named by: the first part of a split one (it holds the metadata and tokenizer)."""
    from voltllm.model.loader.gguf_loader import first_split_file

    try:
        return first_split_file(path)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def resolve_model_for(model: Optional[str], args: Any) -> ModelSource:
    """resolve_model with the Hub flags of a parsed command line (--revision, --download-dir, --hf-token,
    --trust-remote-code), for the tools that read a model's config outside the engine (voltllm bench)."""
    return resolve_model(model, getattr(args, "revision", None), getattr(args, "download_dir", None),
                         getattr(args, "hf_token", None), bool(getattr(args, "trust_remote_code", False)))


def load_hf_config(source: ModelSource, trust_remote_code: bool = False) -> Any:
    if source.kind == "gguf":
        from voltllm.model.loader.gguf_loader import gguf_config

        return gguf_config(source.path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    _attach_modelopt_config(config, source.path)
    return config


def _attach_modelopt_config(config: Any, path: str) -> None:
    """ModelOpt exports may describe their quantization in hf_quant_config.json instead of config.json (vLLM reads
    it too): it becomes the config's quantization_config, with ModelOpt's method name."""
    import json

    file = os.path.join(path, "hf_quant_config.json")
    if getattr(config, "quantization_config", None) is not None or not os.path.isfile(file):
        return
    with open(file) as f:
        config.quantization_config = {"quant_method": "modelopt", **json.load(f)}


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """A directory's (or Hub repo's) tokenizer, or a GGUF file's: converted once by transformers, then read from
    voltllm's cache (gguf_tokenizer_cache.py)."""
    if path.endswith(".gguf") and os.path.isfile(path):
        from voltllm.model.loader.gguf_tokenizer_cache import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def iter_weights(source: ModelSource, hf_config: Any, keep_quantized: bool = False,
                 quantization: Optional[str] = None, only: Optional[Callable[[str], bool]] = None,
                 experts: Any = None, layers: Optional[Callable[[int], bool]] = None,
                 progress: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF parameter name, tensor) pairs, on the CPU, in the checkpoint's dtype. A quantized checkpoint's linear
    weights come as quantized_linear.PackedWeight with `keep_quantized` (GGUF blocks of the types kept quantized,
    4-bit AWQ / GPTQ layers, FP8 layers, NVFP4 layers, compressed-tensors int4 / int8 / FP8 layers, bitsandbytes
    4-bit / 8-bit layers), else dequantized; the quantized checkpoints' layers always as `<layer>.weight`.
    quantization "fp8" / "bitsandbytes" on an unquantized checkpoint quantizes its projections as they load.
    only: the stored tensor names to read (safetensors; e.g. a checkpoint's MTP module alone). experts: this rank's
    routed experts under expert parallelism (distributed.experts.ExpertShard): the other ranks' expert tensors are
    never read (safetensors) or never copied out of the file (GGUF). layers: the decoder layers to read, by index (a
    pipeline stage's, distributed/pipeline.py): the others' tensors are never read (names outside the decoder layers,
    the embeddings, the LM head, a vision tower or an MTP module, always are). progress: a bar over the files (GGUF:
    the tensors) read, on stderr (--use-tqdm-on-load)."""
    if source.kind == "gguf":
        from voltllm.model.loader.gguf_loader import gguf_weights

        yield from gguf_weights(source.path, hf_config, keep_quantized=keep_quantized, experts=experts, layers=layers,
                                progress=progress)
        return
    from voltllm.model.loader.bnb_checkpoint import bnb_scheme, bnb_weights, quantized_layers
    from voltllm.model.loader.compressed_tensors_checkpoint import ct_scheme, ct_weights
    from voltllm.model.loader.fp8_checkpoint import fp8_scheme, fp8_weights
    from voltllm.model.loader.int4_checkpoint import int4_scheme, int4_weights
    from voltllm.model.loader.nvfp4_checkpoint import nvfp4_scheme, nvfp4_weights
    from voltllm.model.loader.safetensors_loader import safetensors_weights

    if experts is not None:
        only = experts.reads if only is None else (lambda name, first=only: first(name) and experts.reads(name))
    if layers is not None:
        in_stage = _of_layers(layers)
        only = in_stage if only is None else (lambda name, first=only: first(name) and in_stage(name))
    stream = safetensors_weights(source.path, only, progress, source.ignore_patterns, source.pt_map_location)
    if (bnb := bnb_scheme(hf_config, quantization)) is not None:
        yield from bnb_weights(stream, bnb, quantized_layers(source.path) if bnb.bits == 4 and not bnb.at_load
                               else set(), keep_quantized)
    elif (scheme := int4_scheme(hf_config)) is not None:
        yield from int4_weights(stream, scheme, keep_quantized)
    elif (fp8 := fp8_scheme(hf_config, quantization)) is not None:
        yield from fp8_weights(stream, fp8, keep_quantized)
    elif (nvfp4 := nvfp4_scheme(hf_config)) is not None:
        yield from nvfp4_weights(stream, nvfp4, keep_quantized)
    elif (ct := ct_scheme(hf_config)) is not None:
        yield from ct_weights(stream, ct, keep_quantized)
    else:
        yield from stream


# a decoder layer's stored name: model.layers.N., model.language_model.layers.N., language_model.model.layers.N., ...
# (not an MTP module's mtp.layers.N. nor a vision tower's blocks)
_DECODER_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


def _of_layers(layers: Callable[[int], bool]) -> Callable[[str], bool]:
    """A stored-name filter that keeps names outside the decoder layers and the layers `layers` accepts."""
    def reads(name: str) -> bool:
        m = _DECODER_LAYER.match(name)
        return m is None or layers(int(m.group(1)))
    return reads
