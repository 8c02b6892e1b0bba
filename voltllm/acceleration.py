"""The acceleration report: for the running configuration, which route each stage takes, and how often.

Routes: attention_prefill, attention_decode, kv_codec, linear, sampler, cuda_graphs, compile_cache,
fused_elementwise, gdn_decode / gdn_prefill for hybrid (Gated DeltaNet) models, and moe for sparse-MoE
models. Each has `enabled` (the
accelerated GPU route runs), `expected` (this configuration should have it: `--require-acceleration` refuses to
start when an expected route is disabled), `impl`, `reason`, and call counters.

Counters (voltllm/route_counters.py, re-exported here). `instrument(runner)` wraps, on that runner's own objects,
the attention backend's forward (one call per attention layer; prefill vs decode by the step's metadata), every
Linear's forward, the sampler and the model's forward; and, process-wide, the public launchers of
voltllm.kernels.fused, voltllm.kernels.gdn_decode, voltllm.kernels.gdn_conv, voltllm.kernels.gdn_chunk and
voltllm.kernels.moe_decode's router (one call per MoE layer forward). A
replayed CUDA graph runs no Python, so for the routes inside the graph the report adds DecodeGraphs.replays x the
calls one eager forward makes (learned from the eager forwards the runner runs: a pure-decode forward when one was
seen, else a prefill forward with its attention calls counted as decode calls, which is what a graph replay runs).
Nothing is counted while a graph is being captured (capture records work, it does not run it). Counters are
`eager`, `graph` and `total` per route.

Without a runner (before the model loads), `build_report(config)` predicts the routes from the
configuration alone; `require_acceleration(config)` uses that to refuse at start-up (exit 2).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from voltllm.platform import Platform, for_config
from voltllm.route_counters import (ROUTES, compile_cache, counters_of, install_global_hooks, instrument,
                                    kv_is_fp8)

# the counters' entry points are used through this module (acceleration.instrument(runner), ...)
__all__ = ["ROUTES", "build_report", "compile_cache", "format_report", "install_global_hooks", "instrument",
           "refusal_message", "require_acceleration"]


# -- the report -------------------------------------------------------------------------------------
def _backend_routes(runner: Any, device: torch.device) -> Optional[dict]:
    fn = getattr(getattr(runner, "backend", None), "routes", None) if runner is not None else None
    if fn is None:
        return None
    try:
        r = fn(device)
    except Exception:  # noqa: BLE001 - a report must not fail on a backend's description
        return None
    return r if isinstance(r, dict) and {"prefill", "decode"} <= set(r) else None


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _is_hybrid_config(hf_config: Any) -> bool:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    types = getattr(text, "layer_types", None) or []
    return any(t == "linear_attention" for t in types) or getattr(hf_config, "model_type", "") in (
        "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def _is_moe_config(hf_config: Any) -> bool:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(getattr(text, "num_experts", 0) or 0) > 0


def _has_quantized_experts(runner: Any, config: Any) -> bool:
    """Whether the MoE layers hold quant_moe.QuantExperts (predicted without a runner: weights kept quantized)."""
    if runner is None:
        return getattr(config.model, "quantized_weights", "") == "quantized"
    model = getattr(runner, "model", None)
    return model is not None and any(getattr(m, "qexperts", None) is not None for m in model.modules())


def _has_moe_layers(runner: Any) -> bool:
    from voltllm.model.layers.moe import SparseMoE

    model = getattr(runner, "model", None)
    return model is not None and any(isinstance(m, SparseMoE) for m in model.modules())


def _route(enabled: bool, expected: bool, impl: str, reason: str, **extra: Any) -> dict:
    return dict(enabled=bool(enabled), expected=bool(expected), impl=impl, reason=reason, **extra)


def _triton_gemm_note(runner: Any) -> str:
    """Where start-up timing (worker/skinny_tuning.py) chose the Triton GEMMs over cuBLAS."""
    if runner is None:
        return ""
    model = runner.model
    head_w = getattr(model, "logits_weight", None)  # the LM head counts once, through the model's own choices
    layers = [m for m in model.modules() if hasattr(m, "skinny") and getattr(m, "weight", None) is not head_w]
    head_batch = getattr(model, "logits_batch", None) or {}
    one = sum(1 for m in layers if m.skinny) + (1 if getattr(model, "logits_skinny", None) else 0)
    rows = sorted({r for m in layers for r in (getattr(m, "batch_gemm", None) or {})} | set(head_batch))
    many = sum(1 for m in layers if getattr(m, "batch_gemm", None)) + (1 if head_batch else 0)
    head_argmax = sorted(getattr(model, "logits_argmax", None) or {})  # (the greedy LM head's argmax epilogue)
    argmax_note = (f"; greedy batches' argmax in the LM head's epilogue at rows {_row_ranges(head_argmax)}"
                   if head_argmax else "")
    if not one and not many:
        return argmax_note
    fold = getattr(model, "norm_fold", None)  # (model/norm_fold.py, chosen by timing the layer stack)
    return (f"; Triton GEMMs where start-up timing beat cuBLAS: skinny (1 row) on {one} layers"
            + (f", decode-batch (rows {_row_ranges(rows)}) on {many} layers" if many else "")
            + (f"; RMSNorms folded into the decode-batch GEMMs at rows {_row_ranges(sorted(fold.configs))}"
               if fold is not None else "") + argmax_note)


def _row_ranges(rows: list[int]) -> str:
    """Sorted row counts as ranges: [2, 3, 4, 8] -> '2-4, 8'."""
    spans: list[list[int]] = []
    for r in rows:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _gdn_prefill_route(runner: Any, config: Any, plat: Platform, cpu_reason: str) -> tuple[str, str]:
    """(impl, reason) of the chunked gated delta rule: its dot precision is the runner's (or predicted)."""
    if plat.capability is None:
        return "torch chunked form (gdn_ref)", cpu_reason
    from voltllm.kernels.gdn_chunk import precision_for

    layers = [m for m in runner.model.modules() if type(m).__name__ == "GatedDeltaNet"] if runner is not None else []
    precision = (layers[0].chunk_precision if layers
                 else precision_for(config.model.dtype, plat.capability, config.device.compat != "none"))
    from voltllm.model.layers.gdn import _CHUNK_UNFIT_DEVICES
    if runner is not None and getattr(runner, "device", None) in _CHUNK_UNFIT_DEVICES:
        return ("Triton causal conv1d + torch chunked gated delta rule (gdn_ref)",
                "the Triton chunk kernels need more shared memory per block than this GPU has (docs/sm70.md)")
    kind = {"tf32x3": "3xTF32 tensor-core (fp32-level)", "tf32": "tf32 tensor-core"}.get(precision, "exact fp32 FMA")
    impl = f"Triton causal conv1d + chunked gated delta rule ({kind} products)"
    why = ("prefill and mixed batches, every size" if precision != "ieee" else
           "prefill and mixed batches; a step whose every request computes >= 256 tokens runs the delta rule in the "
           "torch chunked form (faster than the FMA products there)")
    return impl, why


def _weight_offload_route(cfg: Any, runner: Any, cuda: bool) -> dict:
    """--cpu-offload-gb / --offload-group-size: decoder layers in CPU memory (worker/weight_offload.py). On CUDA the
    host buffers must be page-locked: the prefetch copies are then asynchronous, and uva's in-place reads possible."""
    impl = ("decoder layers in page-locked host memory, read in place over the bus (--offload-backend uva)"
            if cfg.backend == "uva" else
            f"decoder layers in page-locked host memory, copied into {cfg.slots} GPU staging slots "
            f"{cfg.prefetch_step} layer(s) ahead on a copy stream (prefetch)")
    held = getattr(runner, "weight_offload", None) if runner is not None else None
    if held is None:
        return _route(runner is None and cuda, cuda, impl, "predicted: page-locked host buffers" if runner is None
                      else "no offloaded layer was set up" if cuda else _cpu_note())
    gib = round(held.offloaded_bytes / 2**30, 3)
    tally = f"; {len(held.order)} layers ({gib} GiB) offloaded, {held.num_slots} staging slots"
    return _route(cuda, cuda, impl, ("page-locked (cudaHostRegister)" if cuda else _cpu_note()) + tally,
                  layers=len(held.order), gib=gib, slots=held.num_slots)


def _kv_offload_route(config: Any, runner: Any, cuda: bool) -> dict:
    """--kv-offloading-size: the prefix cache's CPU tier. On CUDA its copies are asynchronous only from page-locked
    host memory (else each one stalls the stream on a host copy)."""
    impl = ("host slots of whole KV blocks, copied on the runner's stream before each step's forward "
            "(worker/kv_offload.py)")
    store = getattr(runner, "kv_offload", None) if runner is not None else None
    if store is None:
        return _route(runner is None and cuda, cuda, impl, "predicted: page-locked host slots" if runner is None
                      else "no host store was built" if cuda else _cpu_note(), gib=config.cache.kv_offloading_size)
    extra = dict(slots=store.num_slots, gib=round(store.nbytes / 2**30, 3), pinned=store.pinned,
                 blocks_saved=store.blocks_saved, blocks_loaded=store.blocks_loaded)
    tally = (f"; {store.num_slots} slots ({extra['gib']} GiB), {store.blocks_saved} blocks saved, "
             f"{store.blocks_loaded} loaded")
    if not cuda:
        return _route(False, False, impl, _cpu_note() + tally, **extra)
    return _route(store.pinned, True, impl, ("page-locked (cudaHostRegister): asynchronous copies" if store.pinned
                  else "host slots are not page-locked: every copy waits for the host") + tally, **extra)


def _cpu_note() -> str:
    return "CPU: plain tensor copies between host memory and the CPU KV cache"


def build_report(config: Any, runner: Any = None, platform: Optional[Platform] = None) -> dict:
    """The report dict (JSON-ready). With a runner: its actual routes and counters; without: predicted."""
    from voltllm import __version__

    plat = platform or for_config(config)
    dev = config.device
    cuda = dev.device.type == "cuda"
    dtype = str(config.model.dtype).replace("torch.", "")
    hybrid = bool(getattr(runner, "is_hybrid", False)) if runner is not None else _is_hybrid_config(
        config.model.hf_config)
    backend_name = (runner.backend.name if runner is not None else
                    ("TORCH_REF" if not cuda or (dev.attention_backend or "").upper() == "TORCH_REF"
                     else "TRITON_ATTN"))
    triton_attn = cuda and backend_name == "TRITON_ATTN"
    kv_dtype = config.cache.kv_cache_dtype
    fp8 = kv_is_fp8(runner) if runner is not None else kv_dtype.startswith("fp8")
    routes: dict[str, dict] = {}
    backend_routes = _backend_routes(runner, dev.device) if triton_attn else None
    cpu_reason = "CPU: the plain-PyTorch reference runs (no accelerator)"

    # attention
    forced_ref = "--attention-backend TORCH_REF forces the plain-PyTorch reference"
    if not cuda:
        routes["attention_prefill"] = _route(False, False, "TORCH_REF: torch SDPA per request, fp32", cpu_reason)
        routes["attention_decode"] = _route(False, False, "TORCH_REF: torch SDPA per request, fp32", cpu_reason)
    elif not triton_attn:
        routes["attention_prefill"] = _route(False, True, "TORCH_REF", forced_ref)
        routes["attention_decode"] = _route(False, True, "TORCH_REF", forced_ref)
    else:
        # as the backend chooses (TritonAttentionBackend._use_sdpa_prefill): the compat route, or a chip below sm_80
        # under --compat none
        below_sm80 = plat.capability is not None and tuple(plat.capability) < (8, 0)
        sdpa = ("SDPA" in backend_routes["prefill"]) if backend_routes else (
            (dev.compat != "none" or below_sm80) and _has_module("voltllm.attention.compat_backend"))
        if sdpa:
            where = (f"the {dev.compat} route" if dev.compat != "none" else
                     f"on sm_{plat.capability[0]}{plat.capability[1]} the native route" if below_sm80 else "the route")
            routes["attention_prefill"] = _route(
                True, True, backend_routes["prefill"] if backend_routes else
                "bridge pages to an fp16 workspace + torch SDPA efficient attention",
                f"{where} sends compute-bound prefill to a vendor kernel (fp16 tensor cores "
                "on sm_70+), since Triton's tl.dot is FMA on sm_70/75", tensor_cores=plat.vendor_tensor_cores)
        else:
            tc = plat.triton_tensor_cores
            routes["attention_prefill"] = _route(
                True, True, backend_routes["prefill"] if backend_routes else
                "Triton paged_prefill (flash-style tiles, online softmax in fp32)",
                "tl.dot on tensor cores" if tc else
                "tl.dot lowers to FMA on this chip (no tensor cores for Triton)", tensor_cores=tc)
        cap = plat.capability
        use_tc = getattr(runner.backend, "use_tensor_cores", None) if runner is not None else (
            False if dev.compat != "none" else None)
        use_dot = use_tc if use_tc is not None else (cap is not None and tuple(cap) >= (8, 0))
        lanes = bool(getattr(runner.backend, "fma_lanes", False)) if runner is not None else False
        why = ("tensor cores (tl.dot), split-KV" if use_dot else
               f"CUDA-core FMA in fp32 ({'per-lane' if lanes else 'per-row'} online softmax), split-KV: "
               + (f"the {dev.compat} route keeps decode off tensor cores" if dev.compat != "none"
                  else "no Triton tensor cores on this chip"))
        routes["attention_decode"] = _route(
            True, True, backend_routes["decode"] if backend_routes else "Triton paged_decode (GQA group per program)",
            why, tensor_cores=bool(use_dot))

    # KV codec
    if fp8:
        sw = dev.compat != "none" or not plat.native_fp8
        impl = (backend_routes or {}).get("kv_cache") or (
            f"{kv_dtype}: " + ("software fp8 codec (integer bit ops, uint8 pages)" if sw else "fp8 KV cache"))
        scales = ("per-layer scales from the first forward's K/V amax (--calculate-kv-scales; checkpoint scales "
                  "take precedence)" if getattr(config.cache, "calculate_kv_scales", False)
                  else "per-layer scales from the checkpoint, else 1.0")
        if getattr(config.cache, "calculate_key_offsets", False):
            scales += "; keys stored centered on the first forward's per-channel mean (--calculate-key-offsets)"
        routes["kv_codec"] = _route(
            cuda, cuda, impl,
            f"KV pages are fp8 with {scales}" if cuda else cpu_reason)
    elif kv_dtype.startswith("fp8"):
        routes["kv_codec"] = _route(False, cuda, kv_dtype, "the fp8 KV cache is not wired into this engine yet")
    else:
        routes["kv_codec"] = _route(False, False, f"none (KV cache in {dtype})",
                                    f"--kv-cache-dtype {kv_dtype}: the KV cache keeps the model dtype; no codec")

    # linear
    methods = sorted({type(m.method).__name__ for m in runner.model.modules() if hasattr(m, "method")}) \
        if runner is not None else ["UnquantizedLinearMethod"]
    quant = config.quantization or getattr(config.model, "quantization", None)
    kept = bool(getattr(runner, "keep_quantized", False)) if runner is not None else \
        getattr(config.model, "quantized_weights", "") == "quantized"
    impl = ", ".join(methods) + (f" ({quant} weights dequantized to {dtype} at load)" if quant and not kept else "")
    if cuda and kept:
        from voltllm.model.layers.quantized_linear import FMA_MAX_ROWS, MMA_MAX_ROWS, describe_quantized

        held = f"; holds {describe_quantized(runner.model)}" if runner is not None else ""
        decode = (f"dequant-GEMV (Triton: fp32 FMA or packed fp16, tile timed at start-up) up to {FMA_MAX_ROWS} "
                  f"rows, the tensor-core GEMV (sm_80+, not --compat) up to {MMA_MAX_ROWS} where timed faster, "
                  f"then the tiled dequant-GEMM")
        nvfp4 = "NVFP4 E2M1 with E4M3 group scales (decoded in software)"
        kinds = {"gguf": "GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / Q3_K / Q2_K / IQ4_XS / IQ4_NL",
                 "fp8": "FP8 E4M3 (decoded in software)", "modelopt_fp4": nvfp4}.get(quant, f"{quant} 4-bit groups")
        if quant == "compressed-tensors":
            from voltllm.model.loader.compressed_tensors_checkpoint import describe

            kinds = describe(config.model.hf_config)
        elif quant in ("awq", "gptq"):  # 4-bit, or GPTQ's 8-bit (int8 planes)
            from voltllm.model.loader.int4_checkpoint import int4_scheme

            scheme = int4_scheme(config.model.hf_config)
            kinds = f"{quant} {scheme.bits if scheme is not None else 4}-bit groups"
        routes["linear"] = _route(True, True, impl + f" ({kinds} kept quantized)",
                                  f"{decode}; larger steps dequantize one weight at a time to {dtype} for cuBLAS; "
                                  f"other layouts dequantized at load{held}")
    elif cuda:
        routes["linear"] = _route(True, True, impl, f"torch F.linear -> cuBLAS {dtype} GEMM" + (
            " (fp16 tensor cores on sm_70+)" if dtype == "float16" else "") + _triton_gemm_note(runner))
    else:
        routes["linear"] = _route(False, False, impl, "CPU: torch F.linear on the CPU BLAS")

    # sampler
    routes["sampler"] = _route(cuda, cuda, "voltllm.sampling.Sampler (batched torch ops)",
                               "on the device, no host syncs: sampled ids copied back asynchronously"
                               if cuda else cpu_reason)

    # CUDA graphs
    if not cuda:
        routes["cuda_graphs"] = _route(False, False, "none", "CPU: no CUDA graphs")
    else:
        expected = not dev.enforce_eager
        if dev.enforce_eager:
            on, why = False, "--enforce-eager (or cudagraph_mode NONE / -O0)"
        elif not triton_attn:
            on, why = False, f"attention backend {backend_name} is not graph-capturable"
        else:
            on, why = True, "decode steps replay captured graphs (logits and sampling stay eager)"
        graphs = getattr(runner, "graphs", None) if runner is not None else None
        sizes = list(getattr(graphs, "sizes", []) or [])
        if runner is not None:
            captured = graphs is not None and bool(getattr(graphs, "graphs", None))
            if on and not captured:
                on, why = False, "no decode graph was captured"
            elif captured:
                why = f"decode batches of {sizes[0]}..{sizes[-1]} rows ({len(sizes)} sizes) replay captured graphs"
        prompt = getattr(runner, "prompt_graphs", None) if runner is not None else None
        prompt_sizes = list(getattr(prompt, "sizes", []) or [])
        if prompt_sizes and on:
            why += (f"; prompt steps of up to {prompt_sizes[-1]} tokens replay piecewise graphs (attention eager "
                    "between them)")
        routes["cuda_graphs"] = _route(on, expected, "torch.cuda.CUDAGraph per decode batch size (+ piecewise "
                                       "prompt graphs per token bucket)", why, batch_sizes=sizes,
                                       prompt_token_sizes=prompt_sizes)

    # compile cache
    cc = compile_cache.status()
    if not cuda:
        routes["compile_cache"] = _route(False, False, "Triton on-disk cache", "CPU: no Triton kernels run", **cc)
    else:
        ok = cc["writable"]
        if not ok:
            why = f"Triton's cache dir {cc['dir']} is not writable: kernels recompile on every start"
        elif cc.get("hit") is True:
            why = f"warm: {cc['kernels_loaded']} kernel specializations loaded from the disk cache"
        elif cc.get("hit") is False:
            why = (f"{cc['compiled']} of {cc['kernels_loaded']} kernel specializations compiled this start "
                   f"(now cached), {cc['disk_hits']} from the disk cache")
        else:
            why = "cache dir usable; no Triton kernel loaded since tracking began"
        routes["compile_cache"] = _route(ok, True, "Triton on-disk cache ($TRITON_CACHE_DIR)", why, **cc)

    # fused elementwise
    routes["fused_elementwise"] = _route(
        cuda, cuda,
        "Triton RMSNorm(+residual), QK-norm+RoPE, RoPE, SiLU-and-mul, GDN gated norm (voltllm.kernels.fused)"
        if cuda else "torch elementwise ops (norm, RoPE, SiLU)",
        "one launch each instead of a chain of torch elementwise kernels" if cuda else cpu_reason)

    if hybrid:
        routes["gdn_decode"] = _route(
            cuda, cuda, "Triton conv1d step + gated delta rule step (fp32 state, FMA)",
            "decode-only batches (prefill and mixed batches: gdn_prefill)" if cuda else cpu_reason)
        routes["gdn_prefill"] = _route(cuda, cuda, *_gdn_prefill_route(runner, config, plat, cpu_reason))

    if _has_moe_layers(runner) if runner is not None else _is_moe_config(config.model.hf_config):
        from voltllm.kernels.moe_decode import SMALL_MAX_PAIRS

        if _has_quantized_experts(runner, config):  # quant_moe.QuantExperts: the dense expert kernels do not run
            from voltllm.model.layers.quant_moe import PAIR_LAUNCH_MAX_TOKENS

            impl = (f"Triton router (one launch); quantized experts: up to {PAIR_LAUNCH_MAX_TOKENS} tokens one "
                    "dequant-GEMM launch per projection over the (token, expert) pairs, else the grouped tiled "
                    "dequant-GEMM (long prompts: per-expert dequantize + cuBLAS); the shared expert runs apart"
                    if cuda else "torch router + experts dequantized one at a time (torch reference)")
        else:
            impl = (f"Triton router (one launch); up to {SMALL_MAX_PAIRS} (token, expert) pairs: two unsorted expert "
                    "GEMV launches with the shared expert, else the grouped GEMM (sort, gate_up + SiLU, down)" if cuda
                    else "torch router + reference experts (one GEMM pair per expert with tokens)")
        routes["moe"] = _route(cuda, cuda, impl,
                               "no loop over experts, no host sync, CUDA-graph safe" if cuda else cpu_reason)

    if getattr(config.cache, "kv_offloading_size", None):
        routes["kv_offload"] = _kv_offload_route(config, runner, cuda)
    if getattr(config, "weight_offload", None) is not None:
        routes["weight_offload"] = _weight_offload_route(config.weight_offload, runner, cuda)

    counters = counters_of(runner) if runner is not None else None
    calls = counters.calls() if counters is not None else None
    for name, r in routes.items():
        r["calls"] = calls.get(name) if calls else None
    disabled = [{"route": n, "reason": r["reason"]} for n, r in routes.items() if r["expected"] and not r["enabled"]]
    report = {
        "object": "acceleration_report",
        "voltllm_version": __version__,
        "source": "engine" if runner is not None else "config (predicted; no model loaded)",
        "platform": plat.to_dict(),
        "configuration": {
            "model": str(config.model.model), "architecture": config.model.architecture, "hybrid": hybrid,
            "device": str(dev.device), "compat": dev.compat, "dtype": dtype, "kv_cache_dtype": kv_dtype,
            "calculate_kv_scales": bool(getattr(config.cache, "calculate_kv_scales", False)),
            "calculate_key_offsets": bool(getattr(config.cache, "calculate_key_offsets", False)),
            "attention_backend": backend_name, "enforce_eager": dev.enforce_eager,
            "quantization": quant, "require_acceleration": bool(getattr(dev, "require_acceleration", False)),
        },
        "expected": ("nothing: on the CPU every stage runs the plain-PyTorch reference" if not cuda else
                     ", ".join(n for n, r in routes.items() if r["expected"])),
        "ok": not disabled,
        "disabled_expected": disabled,
        "routes": routes,
    }
    if counters is not None:
        report["counters"] = {"eager_model_forwards": counters.forwards, "graph_replays": counters.replays(),
                              "prompt_graph_replays": counters.prompt_replays(),
                              "per_replay": counters.template, "per_replay_source": counters.template_source}
    return report


def refusal_message(report: dict) -> str:
    lines = [f"--require-acceleration: {len(report['disabled_expected'])} route(s) this configuration expects "
             "are disabled:"]
    lines += [f"  {d['route']}: {d['reason']}" for d in report["disabled_expected"]]
    return "\n".join(lines)


def require_acceleration(config: Any, runner: Any = None) -> dict:
    """Raise ConfigError naming each expected-but-disabled route; returns the report when all are on."""
    from voltllm.config import ConfigError

    report = build_report(config, runner)
    if not report["ok"]:
        raise ConfigError(refusal_message(report))
    return report


def _calls_text(calls: Optional[dict]) -> str:
    if not calls:
        return "-"
    g = calls["graph"]
    if g is None:
        return f"{calls['eager']} + ?"
    return f"{calls['total']}" if not g else f"{calls['eager']} + {g} = {calls['total']}"


def format_report(report: dict) -> str:
    """A plain-text table of the report (voltllm check)."""
    p, c = report["platform"], report["configuration"]
    chip = p["name"] + (f" ({p['sm']}, route {p['route']})" if p["sm"] else "")
    lines = [f"device {c['device']}: {chip}; compat {c['compat']}; dtype {c['dtype']}; "
             f"KV {c['kv_cache_dtype']}; attention {c['attention_backend']}",
             f"model {c['model']} ({c['architecture']}{', hybrid' if c['hybrid'] else ''}); source: {report['source']}",
             f"native bf16 {_yn(p['native_bf16'])}, fp8 {_yn(p['native_fp8'])}; tensor cores: Triton "
             f"{_yn(p['triton_tensor_cores'])}, cuBLAS/SDPA {_yn(p['vendor_tensor_cores'])}; "
             f"recommended dtype {p['recommended_dtype']}"]
    lines += [f"note: {n}" for n in p["notes"]]
    rows = [("route", "enabled", "expected", "calls (eager + graph)", "implementation / reason")]
    for name, r in report["routes"].items():
        rows.append((name, _yn(r["enabled"]), _yn(r["expected"]), _calls_text(r["calls"]),
                     f"{r['impl']} — {r['reason']}"))
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    lines.append("")
    for row in rows:
        lines.append("  ".join(row[i].ljust(w[i]) for i in range(4)) + "  " + row[4])
    if "counters" in report:
        k = report["counters"]
        lines.append(f"\neager model forwards {k['eager_model_forwards']}, CUDA-graph replays {k['graph_replays']}, "
                     f"prompt-graph replays {k.get('prompt_graph_replays', 0)}"
                     + (f"; per replay: {k['per_replay']} ({k['per_replay_source']})" if k["per_replay"] else ""))
    cc = report["routes"]["compile_cache"]
    lines.append(f"Triton cache: {cc.get('dir')} ({'exists' if cc.get('exists') else 'absent'})")
    lines.append(f"expected on this configuration: {report['expected']}")
    lines.append("ok: no expected route is disabled" if report["ok"] else
                 "DISABLED but expected: " + "; ".join(f"{d['route']} ({d['reason']})"
                                                      for d in report["disabled_expected"]))
    return "\n".join(lines)


def _yn(v: Any) -> str:
    return "yes" if v else "no"
