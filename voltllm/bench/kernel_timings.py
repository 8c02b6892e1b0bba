"""`voltllm bench --scenario kernels`: the GDN and MoE Triton kernels against their torch references at a
model's real layer shapes (cases: voltllm/bench/kernel_cases.py). No engine is built.

Per case, on one set of fresh random inputs (seeded):
- agreement: kernel and reference run on the same inputs (state pools copied for each); relerr =
  ||kernel - ref||_2 / ||ref||_2 per output (output rows and the updated state), the largest is reported;
  ok when it is <= 1e-3 (fp32) or 2e-2 (fp16 / bf16).
- time: CUDA events around each call, median of --kernel-iters calls after 3 warm-up calls (the first
  compiles); before every timed call a 256 MiB buffer is read, so the call finds none of its data in L2
  (H200 L2: about 50 MB) and memory-bound kernels are timed at HBM speed. `ms` is the call as the layer makes it
  (eager: host-side launch work included when the GPU outruns it); `graph_ms` is the same call replayed from
  a CUDA graph (device time only; null when the call cannot be captured). The reference (`ref_ms`,
  --kernel-ref-iters calls) is timed the same way, eager. speedup = ref_ms / ms.
- rates: bytes_moved / time (graph_ms when there is one, else ms) against the measured copy bandwidth
  (memory-bound cases), FLOPs / time against the measured half-precision matmul rate (cases whose FLOPs
  run on tensor cores).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from typing import Any, Callable, Optional

import torch

from voltllm.bench import limits as L
from voltllm.bench import record as R
from voltllm.bench.kernel_cases import KernelCase, LayerShapes, Sizes, build_cases

logger = logging.getLogger("voltllm.bench")

FLUSH_BYTES = 256 << 20


def _fork(inputs: dict, mutable: tuple[str, ...]) -> dict:
    return {**inputs, **{k: inputs[k].clone() for k in mutable}}


def relerr(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||got - ref||_2 / ||ref||_2, max |got - ref|), in fp32."""
    d = got.float() - ref.float()
    denom = ref.float().norm().item()
    num = d.norm().item()
    return (num / denom if denom > 0 else num), (d.abs().max().item() if d.numel() else 0.0)


def compare(case: KernelCase, inputs: dict) -> dict:
    """Run kernel and reference on the same inputs; relative errors per output."""
    got = case.triton(_fork(inputs, case.mutable))
    ref = case.ref(_fork(inputs, case.mutable))
    parts, max_abs = {}, {}
    for name, r in ref.items():
        parts[name], max_abs[name] = relerr(got[name], r)
    return {"relerr": max(parts.values()), "relerr_parts": parts, "max_abs_err": max_abs}


class Timer:
    """Per-call times in ms: CUDA events on a GPU (an L2 flush before each call), perf_counter on the CPU."""

    def __init__(self, device: torch.device, flush_bytes: int = FLUSH_BYTES):
        self.device = device
        self.cuda = device.type == "cuda"
        self._buf = torch.zeros(flush_bytes // 4, dtype=torch.float32, device=device) if (
            self.cuda and flush_bytes) else None
        self._sink = torch.empty((), dtype=torch.float32, device=device)

    def flush(self) -> None:
        if self._buf is not None:
            torch.sum(self._buf, dim=0, out=self._sink)  # a read through L2: evicts what the last call left

    def samples_ms(self, fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        if not self.cuda:
            out = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        with torch.cuda.device(self.device):
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            torch.cuda.synchronize()
            for s, e in zip(starts, ends):
                self.flush()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def graph_samples_ms(self, fn: Callable[[], Any], iters: int) -> list[float]:
        """The call captured once in a CUDA graph, each replay timed (device time, no launch overhead)."""
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            from voltllm.worker.cuda_graphs import gc_paused

            with gc_paused(), torch.cuda.graph(graph, stream=side):  # (this card's stream, not the process-wide one)
                fn()
            try:
                return self.samples_ms(graph.replay, iters, warmup=1)
            finally:
                torch.cuda.synchronize()
                del graph


def _tol(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 2e-2


def run_case(case: KernelCase, timer: Timer, gen: torch.Generator, dtype: torch.dtype, iters: int, ref_iters: int,
             warmup: int = 3, dev: Optional[L.DeviceLimits] = None, graphs: bool = True) -> dict:
    inputs = case.make(gen)
    row: dict[str, Any] = {"kernel": case.kernel, "case": case.label, "dtype": R.dtype_name(dtype)}
    row.update(compare(case, inputs))  # also the first call of each side (Triton compiles here)
    row["tol"] = _tol(dtype)
    row["ok"] = bool(row["relerr"] <= row["tol"])
    work = _fork(inputs, case.mutable)
    samples = timer.samples_ms(lambda: case.triton(work), iters, warmup)
    row.update(ms=statistics.median(samples), ms_samples=samples, graph_ms=None)
    if timer.cuda and graphs:
        try:
            g = timer.graph_samples_ms(lambda: case.triton(work), iters)
            row.update(graph_ms=statistics.median(g), graph_ms_samples=g)
        except Exception as e:  # noqa: BLE001 - not capturable: keep the eager time
            torch.cuda.synchronize(timer.device)
            row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    ref = timer.samples_ms(lambda: case.ref(work), ref_iters, min(warmup, 1))
    row.update(ref_ms=statistics.median(ref), ref_ms_samples=ref)
    row["speedup"] = row["ref_ms"] / row["ms"] if row["ms"] > 0 else None
    t_s = (row["graph_ms"] or row["ms"]) / 1e3
    row["rate_from"] = "graph_ms" if row["graph_ms"] else "ms"
    nbytes = float(case.bytes_moved(inputs)) if case.bytes_moved else None
    flops = float(case.flops(inputs)) if case.flops else None
    row.update(memory_bound=case.memory_bound, bytes=nbytes, flops=flops, GBps=None, copy_ratio=None, TFLOPs=None,
               matmul_ratio=None)
    if nbytes and t_s > 0:
        row["GBps"] = nbytes / t_s / 1e9
        if dev is not None and case.memory_bound:
            row["copy_ratio"] = row["GBps"] / dev.copy_GBps
    if flops and t_s > 0:
        row["TFLOPs"] = flops / t_s / 1e12
        if dev is not None and case.tensor_cores:
            row["matmul_ratio"] = row["TFLOPs"] / dev.matmul_TFLOPs
    row.update(iters=iters, ref_iters=ref_iters)
    return row


def run_cases(cases: list[KernelCase], device: torch.device, dtype: torch.dtype, iters: int = 20,
              ref_iters: int = 5, warmup: int = 3, seed: int = 0, dev: Optional[L.DeviceLimits] = None,
              flush_bytes: int = FLUSH_BYTES, graphs: bool = True) -> list[dict]:
    timer = Timer(device, flush_bytes)
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for case in cases:
        logger.info("kernel %s %s", case.kernel, case.label)
        row = run_case(case, timer, gen, dtype, iters, ref_iters, warmup, dev, graphs)
        logger.info("  %.4g ms (graph %s), reference %.4g ms, relerr %.2e%s", row["ms"],
                    f"{row['graph_ms']:.4g}" if row["graph_ms"] else "-", row["ref_ms"], row["relerr"],
                    "" if row["ok"] else "  MISMATCH")
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fmt(v: Optional[float], pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{v:.0%}"
    return f"{v:.2e}" if abs(v) < 1e-3 and v != 0 else (f"{v:.4f}" if abs(v) < 1 else f"{v:.4g}")


def format_kernel_table(rows: list[dict], title: str = "") -> str:
    head = ["kernel", "case", "ms", "graph ms", "ref ms", "speedup", "relerr", "GB/s", "of copy", "TFLOP/s",
            "of matmul", ""]
    body = [[r["kernel"], r["case"], _fmt(r["ms"]), _fmt(r["graph_ms"]), _fmt(r["ref_ms"]),
             _fmt(r["speedup"]), f"{r['relerr']:.1e}", _fmt(r["GBps"]), _fmt(r["copy_ratio"], True),
             _fmt(r["TFLOPs"]), _fmt(r["matmul_ratio"], True), "" if r["ok"] else "MISMATCH"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
    return "\n".join(lines)


# -- the scenario -----------------------------------------------------------------------------------
_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32,
           "float32": torch.float32}


def resolve_dtype(flag: str, hf_config: Any) -> torch.dtype:
    if flag in _DTYPES:
        return _DTYPES[flag]
    cfg = getattr(getattr(hf_config, "text_config", None) or hf_config, "dtype", None)
    cfg = _DTYPES.get(cfg, cfg) if isinstance(cfg, str) else cfg
    return cfg if cfg in (torch.float16, torch.bfloat16) else torch.float16


def _device(flag: str) -> torch.device:
    dev = torch.device("cuda" if flag == "auto" and torch.cuda.is_available() else
                       ("cpu" if flag == "auto" else flag))
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("--scenario kernels times the Triton kernels with CUDA events and needs a CUDA GPU "
                         f"(device {dev}); on the CPU their agreement with the references is checked by the "
                         "Triton-interpreter tests (tests/unit/test_*_interp.py)")
    return dev


def run_kernels_scenario(args: argparse.Namespace) -> int:
    from voltllm.bench.shapes import materialize
    from voltllm.model.loader import load_hf_config, resolve_model_for

    device = _device(args.device)
    if args.kernel_iters < 1 or args.kernel_ref_iters < 1:
        raise ValueError("--kernel-iters and --kernel-ref-iters must be >= 1")
    shape = None
    with tempfile.TemporaryDirectory(prefix="voltllm-bench-") as tmp:
        source = args.model
        if args.random_weights:
            source = materialize(args.random_weights, tmp)
            shape = args.random_weights if source.startswith(tmp) else None
        if not source:
            raise ValueError("--scenario kernels needs the model's shape: --random-weights NAME|DIR or a model path")
        hf_config = load_hf_config(resolve_model_for(source, args), args.trust_remote_code)
    shapes = LayerShapes.from_config(hf_config)
    if shapes.gdn is None and shapes.moe is None:
        raise ValueError("--scenario kernels: this model has no Gated DeltaNet or MoE layer (try "
                         "--random-weights qwen3.5-27b-shape or qwen3.5-35b-a3b-shape)")
    dtype = resolve_dtype(args.dtype, hf_config)
    dev = None
    if not args.no_limits:
        dev = L.measure_device(device, dtype, args.limit_copy_mib, args.limit_matmul_n, args.limit_iters)
        logger.info("copy %.0f GB/s (read + write), %s matmul %.1f TFLOP/s", dev.copy_GBps, dev.matmul_dtype,
                    dev.matmul_TFLOPs)
    cases, shared = build_cases(shapes, dtype, device, Sizes(), args.kernels)
    try:
        rows = run_cases(cases, device, dtype, args.kernel_iters, args.kernel_ref_iters, seed=args.prompt_seed,
                         dev=dev)
    finally:
        for s in shared:
            s.release()
    text = getattr(hf_config, "text_config", None) or hf_config
    label = shape or str(args.random_weights or args.model).rstrip("/").split("/")[-1]
    report: dict[str, Any] = {
        "gpu": R.gpu_name(device), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"source": args.random_weights or args.model, "shape": shape,
                  "model_type": getattr(text, "model_type", None), "dtype": R.dtype_name(dtype),
                  "layers": shapes.to_json()},
        "metrics": {"all_ok": all(r["ok"] for r in rows),
                    "speedup": {f"{r['kernel']}/{r['case']}": r["speedup"] for r in rows},
                    "kernels": rows},
        "limit": {"copy_GBps": dev.copy_GBps if dev else None, "matmul_TFLOPs": dev.matmul_TFLOPs if dev else None,
                  **({"device": dev.to_json()} if dev else {})},
        "config": {"device": str(device), "iters": args.kernel_iters, "ref_iters": args.kernel_ref_iters,
                   "warmup": 3, "l2_flush_bytes": FLUSH_BYTES, "seed": args.prompt_seed,
                   "timing": "CUDA events per call, median; L2 flushed before each call"},
    }
    ordered = R.finish(report, args, f"{label}-{R.dtype_name(dtype)}-kernels-{time.strftime('%Y%m%d-%H%M%S')}")
    path = R.write_json(ordered, args.output_dir, f"{ordered['name']}.json")
    title = (f"voltllm bench --scenario kernels: {label} {R.dtype_name(dtype)} on {ordered['gpu']} "
             f"(commit {str(ordered['commit'])[:12]})")
    print()
    print(format_kernel_table(rows, title))
    if dev:
        print(f"\nlimits: copy {dev.copy_GBps:.4g} GB/s (read + write), {dev.matmul_dtype} matmul "
              f"{dev.matmul_TFLOPs:.4g} TFLOP/s; rates use graph ms where there is one")
    print(f"\nwrote {path}")
    return 0 if ordered["metrics"]["all_ok"] else 1
