"""--lora-modules (vLLM's server flag): adapters the server serves under their own model names.

Each value is `name=path`, or a JSON object {"name", "path", "base_model_name"} (vLLM's two forms). A request whose
`model` is such a name runs with that adapter; /v1/models lists each with `parent` (its base_model_name, else the
first served name) and `root` (its path). Every adapter is read and checked against the model before the engine
starts, so one that cannot run stops the server with a message naming it.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from voltllm.config import ConfigError
from voltllm.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: Optional[str] = None


def lora_module_arg(value: str) -> LoRAModulePath:
    """argparse type of one --lora-modules value."""
    text = value.strip()
    if "=" in text and "," not in text and not text.startswith("{"):
        name, _, path = text.partition("=")
        if not name or not path or "=" in path:
            raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: expected name=path or a JSON object "
                                             '{"name": ..., "path": ..., "base_model_name": ...}')
        return LoRAModulePath(name, path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: neither name=path nor a JSON object ({e})") \
            from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: the JSON form is an object")
    unknown = sorted(set(data) - {"name", "path", "base_model_name"})
    if unknown or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str) \
            or not data["name"] or not data["path"]:
        raise argparse.ArgumentTypeError(
            f"--lora-modules {value!r}: the JSON form needs a \"name\" and a \"path\" (strings), optionally "
            '"base_model_name"' + (f"; unknown keys: {', '.join(unknown)}" if unknown else ""))
    base = data.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: base_model_name must be a string")
    return LoRAModulePath(data["name"], data["path"], base)


def resolve_lora_modules(modules: Optional[Sequence[LoRAModulePath]], config: Any,
                         served_names: Sequence[str]) -> dict[str, LoRARequest]:
    """name -> LoRARequest for the server's --lora-modules, each adapter checked (ConfigError naming it)."""
    if not modules:
        return {}
    if config.lora is None:
        raise ConfigError("--lora-modules needs --enable-lora")
    from voltllm.lora.adapter import LoRAAdapterError, read_adapter

    out: dict[str, LoRARequest] = {}
    for i, m in enumerate(modules, start=1):
        if m.name in out:
            raise ConfigError(f"--lora-modules: the name {m.name!r} is given twice")
        if m.name in served_names:
            raise ConfigError(f"--lora-modules: {m.name!r} is already a served model name (--served-model-name); "
                              "give the adapter another name")
        if m.base_model_name is not None and m.base_model_name not in served_names:
            raise ConfigError(f"--lora-modules {m.name}: base_model_name {m.base_model_name!r} is not a served model "
                              f"name ({', '.join(served_names)})")
        req = LoRARequest(m.name, i, m.path, m.base_model_name)
        try:
            read_adapter(req, config.model.hf_config, config.lora.max_lora_rank, config.lora.lora_dtype)
        except LoRAAdapterError as e:
            raise ConfigError(f"--lora-modules {m.name}: {e}") from None
        out[m.name] = req
    return out
