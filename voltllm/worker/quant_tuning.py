"""Start-up choice of the GGUF dequant-GEMM's tile (kernels/quant_gemv.py, quant_half2.py, quant_mma.py), per plane
kind, weight shape and row class (one row; two to four; five to eight where the tensor-core form may run), by timing
where the model runs.

The fastest tile differs by GPU and shape (the H200 sweep, benchmarks/results/gguf-quant/, and no V100 or T4 here), so
as for the dense GEMMs (skinny_tuning.py) the candidates are timed on the card itself, from CUDA-graph replays over
copies that leave the L2 cold. A candidate whose product differs from the default tile's is never chosen; one that
fails to compile or launch is skipped; if the timing itself fails, the defaults stay.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from voltllm.model.layers.quantized_linear import FMA_MAX_ROWS, MMA_ROW_CLASSES, QuantizedLinearMethod, held_segments
from voltllm.kernels.quant_half2 import DOT, HALF2, HALF2_ROWS, MMA
from voltllm.model.layers.gguf_planes import Planes, map_planes

logger = logging.getLogger(__name__)

TUNE_ROWS = (1, FMA_MAX_ROWS, *MMA_ROW_CLASSES)
# (BLOCK_N, U, num_warps) per row class, the default first. The one-warp tiles keep several rows in each thread's
# registers, so each activation element is converted once for all of them (unmeasured in session 23).
CANDIDATES = {1: [(1, 64, 2), (2, 32, 2), (1, 32, 1), (4, 32, 1), (8, 32, 1), (4, 16, 1)],
              FMA_MAX_ROWS: [(16, 8, 4), (8, 16, 4), (4, 32, 1), (8, 16, 1)],
              **{r: [(DOT,)] for r in MMA_ROW_CLASSES}}  # 5-16 rows: quant_dot unless the tensor-core form wins
# the packed-fp16 form's tiles (kernels/quant_half2.py; 4-bit kinds, fp16 activations), (HALF2 | HALF2_ROWS, BLOCK_N,
# U, num_warps): the fastest per row class in the H200 sweeps of both tilings at the qwen3-8b shapes
# (results/session28/s100, s102): the second tiling wins every one-row shape (by 10-28 %), the first most four-row ones
HALF2_CANDIDATES = {1: [(HALF2_ROWS, 2, 32, 1), (HALF2_ROWS, 2, 64, 2), (HALF2_ROWS, 2, 128, 2),
                        (HALF2_ROWS, 2, 128, 4)],
                    FMA_MAX_ROWS: [(HALF2, 2, 32, 2), (HALF2, 4, 16, 2), (HALF2, 2, 64, 4), (HALF2_ROWS, 2, 32, 1),
                                   (HALF2_ROWS, 2, 64, 1)],
                    **{r: [] for r in MMA_ROW_CLASSES}}
# the tensor-core form's (MMA, KU, num_warps) (kernels/quant_mma.py; sm_80+ and not the compat route): the H200 sweep
# at the qwen3-8b shapes (results/session29, s104): 2-3x faster than both packed-fp16 tilings at 4 and 8 rows
# (AWQ 24576x4096, 8 rows: 28.6 vs 98.2 us), never the fastest at one row, so not timed there; 9-16 rows take its WIDE
# form (two activation fragments per weight read: 128 registers at KU 4, hence also the smaller tiles)
MMA_CANDIDATES = {1: [], FMA_MAX_ROWS: [(MMA, 8, 4), (MMA, 4, 4), (MMA, 2, 2)],
                  8: [(MMA, 8, 4), (MMA, 4, 4), (MMA, 2, 2)],
                  16: [(MMA, 8, 4), (MMA, 4, 4), (MMA, 4, 2), (MMA, 2, 2)]}
L2_FLUSH_BYTES = 256 << 20
MAX_COPIES = 32


def planes_groups(model: torch.nn.Module) -> dict[tuple[str, int, int], Planes]:
    """One Planes per (kind, N, K) that the model's GGUF layers (and a quantized tied LM head) multiply by."""
    groups: dict[tuple[str, int, int], Planes] = {}
    for mod in model.modules():
        for s in held_segments(mod):
            if isinstance(s.weight, Planes):
                groups.setdefault((s.weight.kind.name, s.weight.n, s.weight.k), s.weight)
    return groups


def copies_needed(nbytes: int) -> int:
    """Planes to rotate over so that L2_FLUSH_BYTES stream between two reads of the same one."""
    return max(1, min(MAX_COPIES, math.ceil(L2_FLUSH_BYTES / max(nbytes, 1))))


def choose(candidates: list, time_ms: Callable[[object], float], agrees: Callable[[object], bool]) -> tuple:
    """(best config, its ms, the default's ms): the fastest candidate that runs and agrees with the default (the
    first candidate), which is the fallback."""
    default = candidates[0]
    best, best_ms = default, time_ms(default)
    default_ms = best_ms
    for cfg in candidates[1:]:
        try:
            if not agrees(cfg):
                continue
            ms = time_ms(cfg)
        except Exception as e:  # noqa: BLE001 - a tile this GPU cannot run (resources, compile): skip it
            logger.debug("quant tile %s skipped: %s", cfg, e)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms, default_ms


@torch.inference_mode()
def tune_quant_tiles(model: torch.nn.Module, method: QuantizedLinearMethod, dtype: torch.dtype,
                     tensor_cores: bool = False) -> list[str]:
    """Time the candidates per (kind, N, K) and row class with activations of `dtype`; the choices go into
    method.tiles. `tensor_cores`: the tensor-core form may compete (sm_80+ and not the compat route); the 5-8 and
    9-16-row classes exist only then. Returns log lines."""
    from voltllm.kernels.quant_half2 import few_row_matmul, fits, operands_ok
    from voltllm.kernels.quant_mma import supported_device
    from voltllm.worker.skinny_tuning import graph_replay_ms

    lines = []
    for (kind, n, k), planes in planes_groups(model).items():
        copies = copies_needed(planes.nbytes) - 1
        rotation = [planes] + [map_planes(planes, torch.clone, planes.n) for _ in range(copies)]
        half2 = dtype == torch.float16 and fits(planes)  # its scales stay finite in fp16 (NVFP4: checked here once)
        mma = half2 and tensor_cores and supported_device(planes.device)
        for rows in TUNE_ROWS:
            x = torch.randn(rows, k, dtype=dtype, device=planes.device)
            packed = half2 and operands_ok(x, planes, None)
            if rows in MMA_ROW_CLASSES and not (packed and mma):
                continue  # quant_dot without timing (segment_product's route when no tile is chosen)
            candidates = (CANDIDATES[rows] + (HALF2_CANDIDATES[rows] if packed else [])
                          + (MMA_CANDIDATES[rows] if packed and mma else []))
            ref = few_row_matmul(x, planes, config=candidates[0]).float()

            def agrees(cfg, x=x, ref=ref) -> bool:
                got = few_row_matmul(x, planes, config=cfg).float()
                return bool(torch.allclose(got, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max())))

            def time_ms(cfg, x=x, rotation=rotation) -> float:
                return graph_replay_ms(lambda p: few_row_matmul(x, p, config=cfg), rotation, reps=20)

            best, best_ms, default_ms = choose(candidates, time_ms, agrees)
            method.tiles[(kind, n, k, rows)] = best
            lines.append(f"{kind} {n}x{k} rows {rows}: {best} {best_ms * 1e3:.1f} us (default "
                         f"{default_ms * 1e3:.1f} us)")
    return lines
