"""Pick, per weight shape and decode row count, cuBLAS or a Triton GEMM for decode-sized matmuls, by timing
both: the skinny GEMM (kernels/gemv.py) at one row, the decode-batch GEMM (kernels/batch_gemm.py) at the
CUDA-graph batch sizes from 2 to 64 rows.

Decode at small batch is a weight-streaming problem; which implementation streams faster depends on the
GPU, the shape and the library version, so the runner measures it once at start (a few ms per shape)
instead of assuming it. Timings replay a CUDA graph and rotate over every layer's weight of that shape:
a decode step reads each weight once from HBM, and timing one weight again and again would measure the
L2 cache instead (a 4096x4096 fp16 weight is 32 MiB; an H200's L2 holds 50 MiB).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from voltllm.model.layers.linear import Linear, UnquantizedLinearMethod
from voltllm.worker.cuda_graphs import gc_paused

logger = logging.getLogger("voltllm")

L2_FLUSH_BYTES = 256 << 20  # stream at least this much between two reads of the same weight


def graph_replay_ms(fn, weights: list[torch.Tensor], reps: int = 24) -> float:
    """Per-call time of fn over the rotation, replayed from a CUDA graph: decode replays graphs too, and
    timing Python launches would measure the (slow) host instead of the kernel."""
    for w in weights[:3]:
        fn(w)  # compile / pick algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # (a stream of the weights' card: torch's default capture stream is process-wide, on the first card that captured)
    with gc_paused(), torch.cuda.graph(graph, stream=torch.cuda.Stream(device=weights[0].device)):
        for i in range(reps):
            fn(weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (2 * reps)


def _rotation(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The shape's weights, plus scratch copies when there are too few of them to leave L2 cold. The copies
    are views of one buffer filled by one launch (a small weight needs thousands: 8 KB -> 32768)."""
    w = weights[0]
    per = w.numel() * w.element_size()
    need = -(-L2_FLUSH_BYTES // per)
    if len(weights) >= need or per >= L2_FLUSH_BYTES:
        return weights
    pool = torch.empty((need - len(weights), *w.shape), dtype=w.dtype, device=w.device).normal_(0, 0.02)
    return weights + list(pool.unbind(0))


def _fastest(weights: list[torch.Tensor], x: torch.Tensor, configs, run,
             silu_mul: bool = False, gated: bool = False) -> tuple[float, object, float]:
    """(cuBLAS ms, best Triton config or None, its ms) for y = x w^T over the rotation; `run(x, w, cfg)` is the
    Triton GEMM. A config whose result differs from cuBLAS's is never chosen. With silu_mul (a down projection:
    x = [gate | up]) both sides do what the model runs: the SiLU*mul kernel then cuBLAS, against the Triton GEMM
    with the activation in its prologue. With gated (a gate_up projection whose output feeds the SiLU*mul) the
    library side is cuBLAS then the SiLU*mul kernel, and `run` must return the activation."""
    from voltllm.model.layers.activation import silu_and_mul

    w = weights[0]
    if silu_mul:
        lib = lambda w_: F.linear(silu_and_mul(x), w_)  # noqa: E731
    elif gated:
        lib = lambda w_: silu_and_mul(F.linear(x, w_))  # noqa: E731
    else:
        lib = lambda w_: F.linear(x, w_)  # noqa: E731
    t_lib = graph_replay_ms(lib, weights)
    ref = lib(w).float()
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    best, t_tri = None, float("inf")
    for cfg in configs:
        try:  # a tile this GPU cannot hold (shared memory, registers) is no candidate
            err = (run(x, w, cfg).float() - ref).norm() / ref.norm().clamp_min(1e-6)
        except (OutOfResources, PTXASError, CompilationError) as e:
            logger.debug("GEMM config %s skipped for %s: %s", cfg, tuple(w.shape), e)
            continue
        if err.item() > 1e-2:
            continue
        t = graph_replay_ms(lambda w_: run(x, w_, cfg), weights)
        if t < t_tri:
            best, t_tri = cfg, t
    return t_lib, best, t_tri


def _silu_kernel_then(weights: list[torch.Tensor], x: torch.Tensor, configs, run_plain) -> tuple[float, object, float]:
    """A down projection (x = [gate | up]) as the SiLU*mul kernel followed by the plain Triton GEMM (`run_plain(x, w,
    cfg)` gets the activation), against the SiLU*mul kernel + cuBLAS: (cuBLAS ms, best config, its ms)."""
    from voltllm.model.layers.activation import silu_and_mul

    return _fastest(weights, x, configs, lambda x_, w_, cfg: run_plain(silu_and_mul(x_), w_, cfg), silu_mul=True)


def _prologue_or_silu_kernel(weights: list[torch.Tensor], x: torch.Tensor, configs, run_plain, best, t_tri: float,
                             kind: str) -> tuple[bool, object, float, str, object, float]:
    """A down projection (x = [gate | up]) whose Triton GEMM with the activation in its prologue timed `t_tri`
    (config `best`): also time the SiLU*mul kernel followed by the plain Triton GEMM (`run_plain(x, w, cfg)`); the
    prologue recomputes the activation in every program. Returns (prologue kept, config, ms, log note) and the
    SiLU kernel + plain GEMM's own best config and ms (the MLP-level gated choice uses them)."""
    _, best_split, t_split = _silu_kernel_then(weights, x, configs, run_plain)
    note = f" (silu*mul in the prologue {t_tri * 1e3:.1f} us, SiLU kernel + {kind} {t_split * 1e3:.1f} us)"
    choice = (False, best_split, t_split) if t_split < t_tri else (True, best, t_tri)
    return (*choice, note, best_split, t_split)


def _time_group(weights: list[torch.Tensor], k: int, silu: bool, rows: int, configs, gemm,
                kind: str, prologue: bool = True) -> tuple[torch.Tensor, float, object, float, bool, str, dict]:
    """Time one weight shape at `rows` rows as the model runs it: cuBLAS against the Triton GEMM `gemm(x, w,
    config=, silu_mul=)`, and for a down projection (silu) both forms of its activation (only the SiLU kernel +
    plain GEMM without `prologue`). Returns (x, cuBLAS ms, best config, its ms, activation in the prologue, log
    note, the timings the MLP-level choice needs)."""
    x = torch.randn(rows, 2 * k if silu else k, dtype=weights[0].dtype, device=weights[0].device)
    if silu and not prologue:
        t_lib, best, t_tri = _silu_kernel_then(weights, x, configs, lambda x_, w_, cfg: gemm(x_, w_, config=cfg))
        rec = {"best": best, "t_tri": t_tri, "best_split": best, "t_split": t_tri}
        return x, t_lib, best, t_tri, False, f" (SiLU kernel + {kind})", rec
    t_lib, best, t_tri = _fastest(weights, x, configs, lambda x_, w_, cfg: gemm(x_, w_, config=cfg, silu_mul=silu),
                                  silu)
    fused, note, rec = True, "", {"best": best, "t_tri": t_tri}
    if silu:
        fused, best, t_tri, note, best_split, t_split = _prologue_or_silu_kernel(
            weights, x, configs, lambda x_, w_, cfg: gemm(x_, w_, config=cfg), best, t_tri, kind)
        rec.update(best_split=best_split, t_split=t_split)
    return x, t_lib, best, t_tri, fused, note, rec


def _line(n: int, k: int, itemsize: int, t_lib: float, best, t_tri: float, use) -> str:
    gbps = lambda t: n * k * itemsize / t / 1e6  # noqa: E731
    return (f"{n}x{k}: cuBLAS {t_lib * 1e3:.1f} us ({gbps(t_lib):.0f} GB/s), best triton {best} "
            f"{t_tri * 1e3:.1f} us ({gbps(t_tri):.0f} GB/s) -> {'triton' if use else 'cuBLAS'}")


def _unquantized_groups(model: torch.nn.Module) -> dict[tuple[int, int, bool], list]:
    """fp16/bf16 CUDA Linears by (N, K, silu_mul_input): down projections run a different kernel variant."""
    groups: dict[tuple[int, int, bool], list] = {}
    for mod in model.modules():
        if isinstance(mod, Linear) and isinstance(mod.method, UnquantizedLinearMethod):
            if mod.weight.dtype in (torch.float16, torch.bfloat16) and mod.weight.is_cuda:
                groups.setdefault((*mod.weight.shape, mod.silu_mul_input), []).append(mod)
    return groups


def _groups_with_logits(model: torch.nn.Module) -> dict[tuple[int, int, bool], list]:
    """_unquantized_groups plus the model's dense fp16/bf16 LM-head weight (`logits_weight`; tied heads too), whose
    entry is the model itself: the tuners set its `logits_skinny` / `logits_batch`."""
    groups = _unquantized_groups(model)
    logits_w = getattr(model, "logits_weight", None)
    if logits_w is not None and logits_w.is_cuda and logits_w.dtype in (torch.float16, torch.bfloat16):
        groups.setdefault((*logits_w.shape, False), []).append(model)
    return groups


def _group_weights(model: torch.nn.Module, mods: list) -> list[torch.Tensor]:
    return [m.logits_weight if m is model else m.weight for m in mods]


def _gated_pairs(model: torch.nn.Module) -> list[tuple[Linear, Linear]]:
    """(gate_up, down) of each unquantized MLP whose gate_up output feeds silu(gate) * up into its down projection."""
    pairs = []
    for mod in model.modules():
        gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if isinstance(gu, Linear) and isinstance(down, Linear) and gu.silu_mul_output and down.silu_mul_input \
                and all(isinstance(m.method, UnquantizedLinearMethod) for m in (gu, down)):
            pairs.append((gu, down))
    return pairs


def _key(n: int, k: int, silu_mul: bool, *rest) -> tuple:
    return (n, k, *rest, "silu_mul") if silu_mul else (n, k, *rest)


# Inside a decode step a Triton GEMV with PDL overlaps its launch and ramp with its predecessor; cuBLAS does not.
# Measured on the H200 (benchmarks/results/pdl-gemv-chain-2d9bf0d.txt): the 8B batch-1 chain with cuBLAS for qkv
# was 72 us slower over 36 calls (2 us per call) than with the Triton GEMV, where both time the same alone.
PDL_OVERLAP_MS = 2e-3


def _triton_wins(t_tri: float, t_lib: float, credit_pdl: bool = True) -> bool:
    """Whether the Triton GEMM (timed alone, ms) should replace cuBLAS: >= 3% faster (timing noise); with PDL
    and `credit_pdl`, anything under cuBLAS's time plus the launch overlap it earns inside the step."""
    from voltllm.kernels import pdl

    return t_tri < (t_lib + PDL_OVERLAP_MS if credit_pdl and pdl.enabled() else 0.97 * t_lib)


@torch.inference_mode()
def tune_skinny_gemm(model: torch.nn.Module, rows: int = 1) -> dict[tuple[int, int], object]:
    """Set `skinny` on every unquantized Linear (and the model's logits) where the Triton GEMM wins."""
    from voltllm.kernels.gemv import CONFIGS, gemv

    groups = _groups_with_logits(model)
    pairs = _gated_pairs(model) if rows == 1 else []
    gated_shapes = {tuple(gu.weight.shape) for gu, _ in pairs}
    decisions = {}
    timings: dict[tuple, dict] = {}  # per group, for the MLP-level choice below
    lines = []
    for (n, k, silu), mods in groups.items():
        weights = _rotation(_group_weights(model, mods))
        x, t_lib, best, t_tri, fused, note, rec = _time_group(weights, k, silu, rows, CONFIGS, gemv, "GEMV")
        if not silu and (n, k) in gated_shapes and n % 2 == 0:  # a gate_up projection: also the gated form
            note = _time_gated(weights, x, CONFIGS, lambda x_, w_, cfg: gemv(x_, w_, config=cfg, gated=True), t_lib,
                               rec)
        del weights
        use = best if _triton_wins(t_tri, t_lib) else None
        decisions[_key(n, k, silu)] = use
        timings[(n, k, silu)] = rec
        for m in mods:
            if m is model:
                model.logits_skinny = use
            else:
                m.skinny, m.skinny_silu_fused, m.skinny_gated = use, fused, False
        lines.append(_line(n, k, x.element_size(), t_lib, best, t_tri, use) + note)
    lines += _choose_gated_mlps(pairs, timings)
    if lines:
        logger.info("decode GEMM choice (M=%d, cold L2):\n  %s", rows, "\n  ".join(lines))
    return decisions


def _choose_gated_mlps(pairs: list[tuple[Linear, Linear]], timings: dict[tuple, dict]) -> list[str]:
    """Per MLP whose gate_up and down both chose the one-row Triton GEMV: run gate_up with the SiLU*mul in its
    epilogue and down plain, when that times faster than the choice each made alone (gate_up plain, then the
    down projection with the activation in its prologue or as SiLU kernel + GEMV). Returns log lines."""
    lines, seen = [], set()
    for gu, down in pairs:
        if not (gu.skinny and down.skinny):
            continue
        g = timings.get((*gu.weight.shape, False), {})
        d = timings.get((*down.weight.shape, True), {})
        if g.get("best_gated") is None or d.get("best_split") is None:
            continue
        current = g["t_tri"] + (d["t_split"] if not down.skinny_silu_fused else d["t_tri"])
        gated = g["t_gated"] + max(d["t_split"] - g["t_silu"], 0.0)  # the down projection then runs plain
        if gated < current:
            gu.skinny, gu.skinny_gated = g["best_gated"], True
            down.skinny, down.skinny_silu_fused = d["best_split"], False
        _log_mlp(lines, seen, "", gu, down, current, gated)
    return lines


def _log_mlp(lines: list[str], seen: set, prefix: str, gu: Linear, down: Linear, current: float,
             gated: float) -> None:
    """One log line per MLP shape (and row count, in `prefix`): both timings and the choice."""
    key = (prefix, tuple(gu.weight.shape), tuple(down.weight.shape))
    if key not in seen:
        seen.add(key)
        (n1, k1), (n2, k2) = key[1], key[2]
        lines.append(f"{prefix}MLP {n1}x{k1} -> {n2}x{k2}: as chosen {current * 1e3:.1f} us, gated gate_up + plain "
                     f"down {gated * 1e3:.1f} us -> {'gated' if gated < current else 'as chosen'}")


def _time_gated(weights: list[torch.Tensor], x: torch.Tensor, configs, run_gated, t_lib: float, rec: dict) -> str:
    """Also time a gate_up projection's gated form (`run_gated(x, w, cfg)` writes silu(gate) * up) against cuBLAS +
    the SiLU kernel: records best_gated, t_gated and t_silu (the SiLU kernel's share) in rec; returns a log note."""
    t_lib_silu, best_gated, t_gated = _fastest(weights, x, configs, run_gated, gated=True)
    rec.update(best_gated=best_gated, t_gated=t_gated, t_silu=max(t_lib_silu - t_lib, 0.0))
    return f" (with the SiLU*mul in the epilogue {t_gated * 1e3:.1f} us)"


# Weights below this stay on cuBLAS at every decode-batch row count (not timed). 0: every weight is timed. Measured
# on the H200 (benchmarks/results/batch-gemm-small-weights/): at SmolLM2's shapes and 16-64 rows the Triton tiles
# win alone (2.5-5.0 vs 2.9-6.0 us, and the MLP takes the gated form); 64 concurrent 71,776 vs 56,604 tok/s (window;
# output 61,127 vs 50,040), 16 concurrent 20,784 vs 16,046 (session 15, one call). Weights under
# batch_gemm.SMALL_WEIGHT_BYTES time a short candidate list (start-up compile time).
BATCH_MIN_WEIGHT_BYTES = 0


@torch.inference_mode()
def tune_batch_gemm(model: torch.nn.Module, row_counts: list[int],
                    head_argmax: bool = False) -> dict[tuple[int, int, int], object]:
    """Set `batch_gemm[rows]` on every unquantized Linear of at least BATCH_MIN_WEIGHT_BYTES (and `logits_batch[rows]`
    on the model for its LM head) where the decode-batch Triton GEMM beats cuBLAS at that row count (rows in
    [MIN_ROWS, MAX_ROWS]); with head_argmax (the target model, whose greedy batches the runner samples through
    greedy_tokens) also `logits_argmax[rows]` where the head's argmax epilogue wins (BATCH_HEAD_ARGMAX)."""
    from voltllm.kernels.batch_gemm import MAX_ROWS, MIN_ROWS, batch_gemm, configs_for

    # Only the timed row counts get a choice: an eager batch between them (--enforce-eager, a mixed step) keeps cuBLAS.
    # Giving those rows the next timed size's choice (session 65, bca5a750) measured slower on the H100 (session 66,
    # 8B --enforce-eager at 3 / 6 / 12 / 40 concurrent, window 84 / 173 / 349 / 1,003 vs 107 / 279 / 572 / 1,729
    # tok/s): an eager step is host-bound, and a Triton launch (argument binding, TMA descriptors) costs the host more
    # than cuBLAS's, which the tuner's graph-replayed timings do not see.
    rows_list = sorted({r for r in row_counts if MIN_ROWS <= r <= MAX_ROWS})
    decisions = {}
    lines = []
    pairs = _gated_pairs(model) if BATCH_GATED else []
    gated_shapes = {tuple(gu.weight.shape) for gu, _ in pairs}
    timings: dict[tuple, dict] = {}  # per (N, K, silu_mul, rows), for the MLP-level choice below
    for (n, k, silu), mods in _groups_with_logits(model).items():
        weights = _group_weights(model, mods)
        nbytes = n * k * weights[0].element_size()
        if nbytes < BATCH_MIN_WEIGHT_BYTES or not rows_list:
            continue
        weights = _rotation(weights)
        configs = configs_for(weights[0].device, nbytes)
        for rows in rows_list:
            x, t_lib, best, t_tri, fused, note, rec = _time_group(weights, k, silu, rows, configs, batch_gemm,
                                                                  "GEMM", prologue=BATCH_SILU_PROLOGUE)
            # no PDL credit here: with it (2604e73) qkv / o / down moved to Triton at 16-64 rows and the H200
            # measured 16 concurrent at 1,346 vs 3,161 tok/s and 64 concurrent 10,970 vs 11,198 (window). The
            # down projection's silu*mul variant, timed as it runs since bbcaa67, is 4-7x slower than SiLU +
            # cuBLAS at 16-64 rows (123-238 vs 31-34 us): it had been chosen on the plain variant's timing.
            use = best if _triton_wins(t_tri, t_lib, credit_pdl=False) else None
            if not silu and (n, k) in gated_shapes and n % 2 == 0:  # a gate_up projection: also the gated form
                note = _time_gated(weights, x, [c for c in configs if c[4] == 1],  # (gated tiles have no split-K)
                                   lambda x_, w_, cfg: batch_gemm(x_, w_, config=cfg, gated=True), t_lib, rec)
            rec["t_chosen"] = t_tri if use is not None else t_lib
            timings[(n, k, silu, rows)] = rec
            decisions[_key(n, k, silu, rows)] = use
            for m in mods:
                if m is model:  # the LM head (compute_logits passes logits_batch to linear())
                    head = model.logits_batch = dict(model.logits_batch or {})
                    head.pop(rows, None)
                    if use is not None:
                        head[rows] = use
                    if head_argmax and BATCH_HEAD_ARGMAX and hasattr(model, "greedy_tokens") \
                            and getattr(model, "tp", None) is None:
                        argmax = model.logits_argmax = dict(model.logits_argmax or {})
                        argmax.pop(rows, None)
                        cfg, head_note = _choose_head_argmax(weights, x, best, use, t_tri, rec["t_chosen"])
                        note += head_note
                        if cfg is not None:  # (the logits of other batches come from the same tile: the same argmax)
                            argmax[rows] = head[rows] = cfg
                    continue
                if use is not None:
                    m.batch_gemm[rows] = use
                    m.batch_silu_fused[rows] = fused
                m.batch_gated.pop(rows, None)
            lines.append(f"M={rows} " + _line(n, k, x.element_size(), t_lib, best, t_tri, use) + note)
        del weights
    lines += _choose_gated_batch_mlps(pairs, timings, rows_list)
    if lines:
        logger.info("decode-batch GEMM choice (cold L2):\n  %s", "\n  ".join(lines))
    return decisions


# Whether the decode-batch tuner also times the LM head with the greedy argmax in its epilogue (batch_gemm's
# argmax_out: no logits written, no argmax kernel; the model's greedy_tokens) against the head as chosen followed by
# the argmax kernel, and takes it for greedy batches where it is faster.
BATCH_HEAD_ARGMAX = True
# How much slower than the head as chosen its tile may be when the epilogue takes it (the other batches' head then
# runs that tile too): the Triton / cuBLAS noise rule's 3%.
HEAD_ARGMAX_PLAIN_SLACK = 0.03


def _choose_head_argmax(weights: list[torch.Tensor], x: torch.Tensor, best, use, t_best: float,
                        t_use: float) -> tuple[object, str]:
    """The LM head at x's row count for greedy batches: the head as chosen (`use`: a Triton config, None: cuBLAS;
    t_use ms) then the argmax kernel, against the plain head's best Triton tile (`best`, t_best ms, checked against
    cuBLAS by _fastest) with the argmax in its epilogue. Returns (that config where it is faster and its tokens are the
    plain tile's argmax, else None; a log note). The caller then runs the plain head on the same tile too, so a greedy
    row's token does not depend on whether its batch took the epilogue or the logits: so the tile must have no split-K
    (the epilogue has no such form) and be at most HEAD_ARGMAX_PLAIN_SLACK slower than the head as chosen."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    from voltllm.kernels.batch_gemm import batch_gemm
    from voltllm.sampling.sampler import greedy_tokens

    if best is None or best[4] != 1 or t_best > (1 + HEAD_ARGMAX_PLAIN_SLACK) * t_use:
        return None, ""
    cfg = best
    head = (lambda w_: batch_gemm(x, w_, config=use)) if use is not None else (lambda w_: F.linear(x, w_))
    t_sep = graph_replay_ms(lambda w_: greedy_tokens(head(w_)), weights)
    target = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    try:
        same = torch.equal(batch_gemm(x, weights[0], config=cfg, argmax_out=target),
                           batch_gemm(x, weights[0], config=cfg).argmax(dim=-1))
    except (OutOfResources, PTXASError, CompilationError) as e:
        logger.debug("LM head argmax config %s skipped: %s", cfg, e)
        return None, ""
    except Exception as e:  # noqa: BLE001 - an optimisation: greedy batches keep the head + argmax kernel
        logger.warning("the LM head's argmax epilogue failed (%s); greedy batches keep the argmax kernel", e)
        return None, ""
    if not same:
        return None, f"; argmax epilogue {cfg} disagrees with its plain tile's argmax: not used"
    t_fused = graph_replay_ms(lambda w_: batch_gemm(x, w_, config=cfg, argmax_out=target), weights)
    win = t_fused < t_sep
    verdict = "epilogue (and the plain head on its tile)" if win else "kernel"
    return (cfg if win else None), (f"; greedy: head + argmax kernel {t_sep * 1e3:.1f} us, argmax epilogue {cfg} "
                                    f"{t_fused * 1e3:.1f} us -> {verdict}")


# Whether the decode-batch tuner also times the down projection with the SiLU*mul in its prologue. Off: at 16-64 rows
# every program recomputes the activation of all rows over the whole K, and on the H200 it lost to the SiLU kernel +
# plain GEMM at every shape and row count timed (8B 123-238 vs 31-34 us, session 5; SmolLM2's 576x1536 10.0-21.4 vs
# 4.8-5.3 us, session 15), while its variants cost start-up compile time (one per tile and row block).
BATCH_SILU_PROLOGUE = False

# Whether the decode-batch tuner also times gate_up with the SiLU*mul in its epilogue (`batch_gemm(gated=True)`).
BATCH_GATED = True


def _choose_gated_batch_mlps(pairs: list[tuple[Linear, Linear]], timings: dict[tuple, dict],
                             rows_list: list[int]) -> list[str]:
    """Per MLP and decode-batch row count: run gate_up as the gated Triton GEMM (it writes silu(gate) * up) and the
    down projection plain, when that times faster than the choice each made alone (gate_up, then the SiLU kernel
    and the down projection, or the down projection with the activation in its prologue). Returns log lines."""
    lines, seen = [], set()
    for gu, down in pairs:
        for rows in rows_list:
            g = timings.get((*gu.weight.shape, False, rows), {})
            d = timings.get((*down.weight.shape, True, rows), {})
            if g.get("best_gated") is None or "t_chosen" not in d:
                continue
            current = g["t_chosen"] + d["t_chosen"]  # the down side includes its activation
            gated = g["t_gated"] + max(d["t_chosen"] - g["t_silu"], 0.0)  # the down projection then runs plain
            if gated < current:  # (the down projection then runs through linear(): its plain tuned GEMM or cuBLAS)
                gu.batch_gemm[rows], gu.batch_gated[rows] = g["best_gated"], True
            _log_mlp(lines, seen, f"M={rows} ", gu, down, current, gated)
    return lines
