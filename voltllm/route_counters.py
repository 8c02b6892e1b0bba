"""Route call counters behind the acceleration report (voltllm.acceleration): process-wide hooks on the
fused / GDN kernel launchers and Triton's compile cache, and per-runner counters that `instrument(runner)`
installs on the runner's own objects. A replayed CUDA graph runs no Python, so for the routes inside the
graph the counters add DecodeGraphs.replays x the calls one eager forward makes, and PromptGraphs.replays x the
non-attention calls of one eager prompt forward (their attention runs eagerly between the pieces, so it is counted
as it runs; see voltllm.acceleration's docstring for the rules); nothing is counted while a graph is being captured.
"""
from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Callable, Optional

import torch


ROUTES = ("attention_prefill", "attention_decode", "kv_codec", "linear", "sampler", "cuda_graphs",
          "compile_cache", "fused_elementwise", "gdn_decode", "gdn_prefill", "moe", "kv_offload", "weight_offload")
# routes whose calls happen inside the model forward (so inside a decode CUDA graph)
_FORWARD_ROUTES = ("attention_prefill", "attention_decode", "kv_codec", "linear", "fused_elementwise", "gdn_decode",
                   "gdn_prefill", "moe")
_FUSED_FNS = ("rms_norm", "fused_add_rms_norm", "rope_inplace", "qk_norm_rope_inplace", "silu_and_mul",
              "gated_rms_norm_heads")
_GDN_FNS = ("causal_conv1d_decode", "gated_delta_rule_decode")
_GDN_PREFILL_FNS = ("gated_delta_rule_chunked",)
_GDN_CONV_FNS = ("causal_conv1d_prefill",)
_MOE_FNS = ("moe_route",)  # one Triton router launch per sparse-MoE layer forward, whichever expert kernels follow

_GLOBAL = {"fused_elementwise": 0, "gdn_decode": 0, "gdn_prefill": 0, "moe": 0}  # process-wide kernel launcher calls
_CUDA = torch.cuda.is_available()
_COUNTERS: "weakref.WeakKeyDictionary[Any, RouteCounters]" = weakref.WeakKeyDictionary()


def _capturing() -> bool:
    return _CUDA and torch.cuda.is_current_stream_capturing()


# -- process-wide hooks: fused / GDN launchers, Triton's compile cache --------------------------------
def _count_global(key: str, fn: Callable) -> Callable:
    if getattr(fn, "_voltllm_counted", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _capturing():
            _GLOBAL[key] += 1
        return fn(*args, **kwargs)

    wrapper._voltllm_counted = True  # type: ignore[attr-defined]
    return wrapper


def install_global_hooks() -> None:
    """Count the fused-elementwise, GDN decode / prefill (conv1d, chunked delta rule) and MoE router launchers (module
    attributes the layers call); idempotent."""
    import importlib

    for mod_name, key, names in (("voltllm.kernels.fused", "fused_elementwise", _FUSED_FNS),
                                 ("voltllm.kernels.gdn_decode", "gdn_decode", _GDN_FNS),
                                 ("voltllm.kernels.gdn_chunk", "gdn_prefill", _GDN_PREFILL_FNS),
                                 ("voltllm.kernels.gdn_conv", "gdn_prefill", _GDN_CONV_FNS),
                                 ("voltllm.kernels.moe_decode", "moe", _MOE_FNS)):
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - Triton missing: those routes never run
            continue
        for name in names:
            fn = getattr(mod, name, None)
            if fn is not None:
                setattr(mod, name, _count_global(key, fn))
    compile_cache.start()


class CompileCacheTracker:
    """Triton's on-disk cache: its directory, entries at start, entries written since, kernels loaded since.

    A kernel specialization that Triton loads (jit_post_compile_hook: after a disk hit or a compile) and that
    adds no new cache entry was a disk hit; each new entry is a compile that missed (and is now cached)."""

    def __init__(self) -> None:
        self.started = False
        self.dir: Optional[str] = None
        self.existed = False
        self.entries0: set[str] = set()
        self.loaded = 0

    @staticmethod
    def cache_dir() -> Optional[str]:
        try:
            from triton import knobs

            return str(knobs.cache.dir)
        except Exception:  # noqa: BLE001 - no Triton
            return None

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self.dir = self.cache_dir()
        self.existed = bool(self.dir) and os.path.isdir(self.dir)
        self.entries0 = self._entries()
        try:
            from triton import knobs

            prev = knobs.runtime.jit_post_compile_hook

            def hook(*args: Any, **kwargs: Any) -> Any:
                self.loaded += 1
                return prev(*args, **kwargs) if prev is not None else None

            knobs.runtime.jit_post_compile_hook = hook
        except Exception:  # noqa: BLE001
            pass

    def _entries(self) -> set[str]:
        try:
            return set(os.listdir(self.dir)) if self.dir else set()
        except OSError:
            return set()

    def status(self) -> dict:
        d = self.dir or self.cache_dir()
        exists = bool(d) and os.path.isdir(d)
        writable = bool(d) and _writable(d)
        out = {"dir": d, "exists": exists, "writable": writable, "tracking": self.started}
        if self.started:
            now = self._entries()
            new = len(now - self.entries0)
            out.update(existed_at_start=self.existed, entries_at_start=len(self.entries0), entries_now=len(now),
                       kernels_loaded=self.loaded, compiled=min(new, self.loaded) if self.loaded else new,
                       disk_hits=max(0, self.loaded - new))
            out["hit"] = (None if self.loaded == 0 else new == 0)
        return out


def _writable(path: str) -> bool:
    p = os.path.abspath(path)
    while not os.path.exists(p):  # Triton creates the directory on first use
        parent = os.path.dirname(p)
        if parent == p:
            return False
        p = parent
    return os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK)


compile_cache = CompileCacheTracker()


# -- per-runner counters ----------------------------------------------------------------------------
def _count_gdn_layers(runner: Any) -> int:
    model = getattr(runner, "model", None)
    if model is None:
        return 0
    from voltllm.model.layers.gdn import GatedDeltaNet

    return sum(isinstance(m, GatedDeltaNet) for m in model.modules())


class RouteCounters:
    """Eager call counts of one runner, plus the per-forward template used for CUDA-graph replays."""

    def __init__(self, runner: Any):
        self.eager = dict.fromkeys(ROUTES, 0)
        self.forwards = 0
        self.template: Optional[dict[str, int]] = None
        self.template_source: Optional[str] = None
        self.prefill_template: Optional[dict[str, int]] = None  # one eager prompt forward's calls
        self.global0 = dict(_GLOBAL)
        graphs = getattr(runner, "graphs", None)
        self.replays0 = int(getattr(graphs, "replays", 0) or 0)
        self.prompt_replays0 = int(getattr(getattr(runner, "prompt_graphs", None), "replays", 0) or 0)
        self.runner_ref = weakref.ref(runner)
        self.gdn_layers = _count_gdn_layers(runner)

    def current(self) -> dict[str, int]:
        c = dict(self.eager)
        for k, v in _GLOBAL.items():
            c[k] += v - self.global0[k]
        return c

    def on_forward(self, before: dict[str, int], after: dict[str, int]) -> None:
        self.forwards += 1
        delta = {k: after[k] - before[k] for k in _FORWARD_ROUTES}
        if delta["attention_prefill"] > 0:
            self.prefill_template = delta
        if delta["attention_prefill"] == 0 and delta["attention_decode"] > 0:
            self.template, self.template_source = delta, "eager decode forward"
        elif self.template_source != "eager decode forward" and delta["attention_prefill"] > 0:
            t = dict(delta)
            t["attention_decode"] += t.pop("attention_prefill")
            t["attention_prefill"] = 0
            # a prefill runs the GDN layers' chunked / reference path; a replayed decode step calls each
            # GDN decode launcher once per layer
            t["gdn_decode"] = len(_GDN_FNS) * self.gdn_layers
            t["gdn_prefill"] = 0
            self.template, self.template_source = t, "eager prefill forward (attention calls as decode calls)"

    def replays(self) -> int:
        runner = self.runner_ref()
        graphs = getattr(runner, "graphs", None) if runner is not None else None
        return int(getattr(graphs, "replays", 0) or 0) - self.replays0 if graphs is not None else 0

    def prompt_replays(self) -> int:
        """Prompt steps replayed from piecewise graphs (their attention calls are eager, so counted as such)."""
        runner = self.runner_ref()
        graphs = getattr(runner, "prompt_graphs", None) if runner is not None else None
        return int(getattr(graphs, "replays", 0) or 0) - self.prompt_replays0 if graphs is not None else 0

    def calls(self) -> dict[str, dict[str, Optional[int]]]:
        cur = self.current()
        cur["cuda_graphs"] = self.forwards  # eager forwards: steps that ran without a graph
        replays = self.replays()
        prompt = self.prompt_replays()
        out: dict[str, dict[str, Optional[int]]] = {}
        for r in ROUTES:
            if r == "cuda_graphs":
                graph: Optional[int] = replays + prompt
            elif r in _FORWARD_ROUTES:
                graph = replays * self.template.get(r, 0) if self.template else (0 if replays == 0 else None)
                if graph is not None and prompt and r not in ("attention_prefill", "attention_decode", "kv_codec"):
                    graph = prompt * self.prefill_template[r] + graph if self.prefill_template else None
            else:
                graph = 0
            out[r] = {"eager": cur[r], "graph": graph, "total": None if graph is None else cur[r] + graph}
        out["compile_cache"] = {"eager": compile_cache.loaded, "graph": 0, "total": compile_cache.loaded}
        return out


def _wrap_method(obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    fn = getattr(obj, name)
    if getattr(fn, "_voltllm_counted", False):
        return
    wrapped = make(fn)
    wrapped._voltllm_counted = True  # type: ignore[attr-defined]
    setattr(obj, name, wrapped)


def instrument(runner: Any) -> RouteCounters:
    """Start counting this runner's routes (idempotent); returns its counters."""
    existing = _COUNTERS.get(runner)
    if existing is not None:
        return existing
    install_global_hooks()
    c = RouteCounters(runner)
    fp8_cache = kv_is_fp8(runner)

    def attn(fn: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any):
            if not _capturing():
                meta = kwargs["meta"] if "meta" in kwargs else args[4]
                c.eager["attention_decode" if meta.is_pure_decode else "attention_prefill"] += 1
                if fp8_cache:
                    c.eager["kv_codec"] += 1
            return fn(*args, **kwargs)
        return forward

    def counted(key: str) -> Callable[[Callable], Callable]:
        def make(fn: Callable) -> Callable:
            def call(*args: Any, **kwargs: Any) -> Any:
                if not _capturing():
                    c.eager[key] += 1
                return fn(*args, **kwargs)
            return call
        return make

    def model_forward(fn: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if _capturing():
                return fn(*args, **kwargs)
            before = c.current()
            out = fn(*args, **kwargs)
            c.on_forward(before, c.current())
            return out
        return forward

    _wrap_method(runner.backend, "forward", attn)
    _wrap_method(runner.sampler, "sample", counted("sampler"))
    _wrap_method(runner.sampler, "sample_argmax", counted("sampler"))
    _wrap_method(runner.sampler, "argmax_output", counted("sampler"))
    from voltllm.model.layers.linear import Linear

    for mod in runner.model.modules():
        if isinstance(mod, Linear):
            _wrap_method(mod, "forward", counted("linear"))
    _wrap_method(runner.model, "forward", model_forward)
    _COUNTERS[runner] = c
    return c


def counters_of(runner: Any) -> Optional[RouteCounters]:
    return _COUNTERS.get(runner)


def kv_is_fp8(runner: Any) -> bool:
    caches = getattr(runner, "kv_caches", None) or []
    return bool(caches) and caches[0].dtype in (torch.uint8,) + tuple(
        getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
