"""vLLM's --compilation-config (-cc), -O / --optimization-level and --cuda-graph-sizes, mapped onto voltllm's CUDA
graphs.

voltllm never compiles the model with torch.compile (its kernels are Triton and PyTorch ops, launched as written), so
of vLLM's compilation config only the CUDA-graph part has a meaning here. voltllm has two kinds of graphs:
- decode graphs (worker/cuda_graphs.py): a decode batch's whole forward, attention included, captured once per batch
  size and replayed on batches padded up to the next size: vLLM's FULL graphs for decode batches;
- piecewise prompt graphs (worker/prompt_graphs.py): prompt and mixed steps replayed piece by piece, with attention
  run eagerly between the pieces: vLLM's PIECEWISE graphs for the other batches (attention-only models).
So vLLM's default cudagraph_mode FULL_AND_PIECEWISE is voltllm's default, FULL_DECODE_ONLY keeps the decode graphs
alone and NONE captures none. FULL (every batch captured whole) becomes FULL_AND_PIECEWISE, as vLLM itself does for
attention backends that cannot capture mixed batches whole; PIECEWISE (piecewise graphs for decode batches too) is not
built.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

logger = logging.getLogger("voltllm")


class CompilationConfigError(ValueError):
    """A compilation config voltllm cannot honour; the message names the key (or flag) and why."""


# cudagraph modes voltllm builds, and what -O N asks for (vLLM's optimization levels: -O2 is the default, -O3 the same)
BUILT_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
VLLM_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
LEVEL_MODES = {0: "NONE", 1: "PIECEWISE", 2: "FULL_AND_PIECEWISE", 3: "FULL_AND_PIECEWISE"}

# vLLM's compilation modes (`mode`, and the older `level`): only 0 / NONE, no torch.compile, is what voltllm does
_COMPILE_MODES = {"NONE": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_TRACE_ONCE": 2, "VLLM_COMPILE": 3}
_NO_TORCH_COMPILE = "voltllm does not compile the model with torch.compile (its Triton kernels run as written)"
# vLLM keys that configure torch.compile / Inductor alone
_TORCH_COMPILE_KEYS = frozenset({
    "backend", "custom_ops", "splitting_ops", "compile_sizes", "compile_ranges_split_points", "inductor_compile_config",
    "inductor_passes", "pass_config", "use_inductor", "use_inductor_graph_partition", "dynamic_shapes_config",
    "compile_mm_encoder", "debug_dump_path", "cache_dir", "compile_cache_save_format"})
# vLLM keys about CUDA graphs that voltllm has no counterpart for
_GRAPH_KEYS_NOT_BUILT = {
    "cudagraph_num_of_warmups": "voltllm runs each batch size twice before capturing it (not configurable)",
    "cudagraph_copy_inputs": "voltllm's graphs always read the runner's persistent input buffers",
    "use_cudagraph": "an older vLLM key: use cudagraph_mode (NONE turns CUDA graphs off)",
    "full_cuda_graph": "an older vLLM key: use cudagraph_mode (FULL_AND_PIECEWISE is the default)",
}
_SIZE_KEYS = ("cudagraph_capture_sizes",)
_MAX_SIZE_KEYS = ("max_cudagraph_capture_size", "max_capture_size")  # (max_capture_size: vLLM's older name)
KNOWN_KEYS = frozenset({"mode", "level", "cudagraph_mode", *_SIZE_KEYS, *_MAX_SIZE_KEYS})


@dataclass(frozen=True)
class CudaGraphConfig:
    """The CUDA graphs the runner captures (DeviceConfig.cuda_graphs)."""

    mode: str = "FULL_AND_PIECEWISE"  # one of BUILT_MODES
    # the decode graphs' batch sizes (sorted); None: voltllm's buckets (1, 2, 4, 8, then every 16) up to
    # max_capture_size. Sizes above a graph set's row capacity are not captured; larger batches run eagerly
    capture_sizes: Optional[tuple[int, ...]] = None
    max_capture_size: Optional[int] = None  # None: cuda_graphs.GRAPH_ROWS_LIMIT

    @property
    def decode_graphs(self) -> bool:
        return self.mode != "NONE"

    @property
    def prompt_graphs(self) -> bool:
        return self.mode == "FULL_AND_PIECEWISE"


def parse_compilation_config(value: Any) -> dict:
    """--compilation-config as a dict: a JSON object (or dict), or a bare number, vLLM's short form of {"mode": N}."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise CompilationConfigError(f"--compilation-config must be a JSON object: {e}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return {"mode": value}
    if not isinstance(value, dict):
        raise CompilationConfigError(f"--compilation-config must be a JSON object, got {type(value).__name__}")
    return dict(value)


def resolve_cuda_graphs(compilation_config: Any = None, optimization_level: Optional[int] = None,
                        cuda_graph_sizes: Optional[Sequence[int]] = None,
                        cudagraph_capture_sizes: Optional[Sequence[int]] = None,
                        max_cudagraph_capture_size: Optional[int] = None,
                        enforce_eager: bool = False) -> CudaGraphConfig:
    """The graphs to capture, from vLLM's flags: -O N sets the mode's default, an explicit cudagraph_mode wins over it,
    --enforce-eager over both (as in vLLM). The sizes are as given; fit_to_batch_budget fits them to the step budget
    once that is known."""
    cc = parse_compilation_config(compilation_config)
    _check_keys(cc)
    level = 2 if optimization_level is None else optimization_level
    if isinstance(level, bool) or level not in LEVEL_MODES:
        raise CompilationConfigError(f"-O / --optimization-level must be 0, 1, 2 or 3, got {optimization_level!r}")
    explicit = cc.get("cudagraph_mode")
    mode = _mode_name(explicit) if explicit is not None else LEVEL_MODES[level]
    sizes = _capture_sizes(cc, cuda_graph_sizes, cudagraph_capture_sizes)
    top = _max_capture_size(cc, max_cudagraph_capture_size)
    if enforce_eager:
        return CudaGraphConfig("NONE")
    if mode == "PIECEWISE":
        asked = "--compilation-config cudagraph_mode PIECEWISE" if explicit is not None else "-O1"
        raise CompilationConfigError(
            f"{asked}: piecewise CUDA graphs for decode batches are not built (voltllm's decode graphs hold the "
            "whole forward, attention included; only prompt and mixed steps replay piecewise graphs). Use -O2 / "
            "FULL_AND_PIECEWISE (the default: both kinds), FULL_DECODE_ONLY (decode graphs alone) or -O0 / NONE")
    if mode == "FULL":
        logger.warning("--compilation-config cudagraph_mode FULL: prompt and mixed steps cannot be captured whole here "
                       "(their attention depends on each step's sequences), so they replay piecewise graphs: "
                       "FULL_AND_PIECEWISE")
        mode = "FULL_AND_PIECEWISE"
    if mode == "NONE":
        return CudaGraphConfig("NONE")
    return CudaGraphConfig(mode, None if sizes is None else tuple(sizes), top)


def _check_keys(cc: dict) -> None:
    for key, value in cc.items():
        if key in ("mode", "level"):
            _check_compile_mode(key, value)
        elif key in _TORCH_COMPILE_KEYS:
            raise CompilationConfigError(f"--compilation-config {key}: a torch.compile setting; {_NO_TORCH_COMPILE}")
        elif key == "cudagraph_specialize_lora":
            if value is not False:  # (vLLM's default is true: separate graphs for batches without adapters)
                raise CompilationConfigError(
                    f"--compilation-config cudagraph_specialize_lora {json.dumps(value)}: graphs specialized for "
                    "batches with and without LoRA adapters are not built: with --enable-lora every graph computes "
                    "the adapters' terms (a token without one adds zero); false is what runs")
        elif key in _GRAPH_KEYS_NOT_BUILT:
            raise CompilationConfigError(f"--compilation-config {key}: not built ({_GRAPH_KEYS_NOT_BUILT[key]})")
        elif key not in KNOWN_KEYS:
            raise CompilationConfigError(f"--compilation-config {key}: unknown key (voltllm reads cudagraph_mode, "
                                         "cudagraph_capture_sizes, max_cudagraph_capture_size and mode / level 0 or 3)")


def _check_compile_mode(key: str, value: Any) -> None:
    """mode / level: 0 (NONE) and 3 (VLLM_COMPILE, vLLM's default: its own optimized forward, which voltllm's
    kernels are here) say what voltllm does; 1 and 2 ask for stock torch.compile / Dynamo pipelines."""
    number = _COMPILE_MODES.get(value.upper()) if isinstance(value, str) and key == "mode" else value
    if number in (0, 3) and not isinstance(number, bool):
        return
    if number in (1, 2) and not isinstance(number, bool):
        raise CompilationConfigError(f"--compilation-config {key} {value}: a torch.compile mode; {_NO_TORCH_COMPILE}. "
                                     f"Drop \"{key}\" (or give 0: no compilation, which is what voltllm does)")
    names = " or ".join(("0 to 3", ", ".join(_COMPILE_MODES))) if key == "mode" else "0 to 3"
    raise CompilationConfigError(f"--compilation-config {key} must be {names}, got {value!r}")


def _mode_name(value: Any) -> str:
    name = value.upper() if isinstance(value, str) else None
    if name not in VLLM_MODES:
        raise CompilationConfigError(f"--compilation-config cudagraph_mode must be one of {', '.join(VLLM_MODES)}, "
                                     f"got {value!r}")
    return name


def _capture_sizes(cc: dict, cuda_graph_sizes: Optional[Sequence[int]],
                   cudagraph_capture_sizes: Optional[Sequence[int]]) -> Optional[list[int]]:
    sources = (("--compilation-config cudagraph_capture_sizes", cc.get("cudagraph_capture_sizes")),
               ("--cudagraph-capture-sizes", cudagraph_capture_sizes), ("--cuda-graph-sizes", cuda_graph_sizes))
    given = [(name, v) for name, v in sources if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise CompilationConfigError(f"{given[0][0]} and {given[1][0]} both set the CUDA graph batch sizes; give one")
    name, sizes = given[0]
    if not isinstance(sizes, (list, tuple)) or not sizes or not all(_is_size(s) for s in sizes):
        raise CompilationConfigError(f"{name} must be a non-empty list of batch sizes >= 1, got {sizes!r}")
    if name == "--cuda-graph-sizes" and len(sizes) == 1:  # vLLM's: one value is the largest of its usual ladder
        return sorted({1, 2, 4} | set(range(8, sizes[0] + 1, 8)))
    return sorted(set(sizes))


def _max_capture_size(cc: dict, flag_value: Optional[int]) -> Optional[int]:
    given = {v for v in [cc.get(k) for k in _MAX_SIZE_KEYS] + [flag_value] if v is not None}
    if len(given) > 1:
        raise CompilationConfigError(f"max_cudagraph_capture_size is given twice, with different values: "
                                     f"{sorted(given)}")
    if not given:
        return None
    top = given.pop()
    if not _is_size(top):
        raise CompilationConfigError(f"max_cudagraph_capture_size must be a batch size >= 1, got {top!r}")
    return top


def fit_to_batch_budget(graphs: CudaGraphConfig, max_num_batched_tokens: int) -> CudaGraphConfig:
    """As vLLM: capture sizes above --max-num-batched-tokens are dropped (no step has that many rows), a
    max_cudagraph_capture_size given beside the sizes must be the largest kept, and one given alone is capped by the
    budget."""
    budget, sizes, top = max_num_batched_tokens, graphs.capture_sizes, graphs.max_capture_size
    if sizes is None:
        return replace(graphs, max_capture_size=None if top is None else min(top, budget))
    kept = tuple(s for s in sizes if s <= budget)
    if not kept:
        raise CompilationConfigError(f"cudagraph_capture_sizes {list(sizes)}: every size is above "
                                     f"--max-num-batched-tokens {budget}, so no step could replay them")
    if len(kept) < len(sizes):
        logger.warning("cudagraph_capture_sizes above --max-num-batched-tokens %d are dropped: %s", budget,
                       [s for s in sizes if s > budget])
    if top is not None and top != kept[-1]:
        raise CompilationConfigError(f"max_cudagraph_capture_size {top} must be the largest of cudagraph_capture_sizes "
                                     f"({kept[-1]}); give one of them")
    return replace(graphs, capture_sizes=kept, max_capture_size=kept[-1])


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
