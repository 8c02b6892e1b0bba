"""Start-up choice of the norm-folded decode layers (voltllm.model.norm_fold), per decode-batch row count.

The model's whole layer stack is timed both ways at each CUDA-graph row count from MIN_ROWS on, replayed from a CUDA
graph with the decode step's PDL setting: as it runs (the add + RMSNorm launches and the projections on the choices
the decode-batch tuner just made) and folded. Attention and RoPE are left out: they are the same kernels in both.
Where the folded stack is faster, the norm weights are folded into the weights and the model gets a plan.
"""
from __future__ import annotations

import logging

import torch

from voltllm.worker.cuda_graphs import replay_median_ms

logger = logging.getLogger("voltllm")

# Whether the start-up tuner times the folded layers at all (an A/B switch for benchmarks/micro's harness; no flag).
NORM_FOLD = True


def _stacks(model, rows: int, configs: dict[str, tuple]):
    """(as it runs, folded): the layer stack at `rows` rows without attention, on the model's own weights (the
    folded one ignores the norm weights: its timing does not depend on their values)."""
    from voltllm.model.models.llama import residual_stream
    from voltllm.model.norm_fold import NormFoldPlan

    layers = model.layers
    attn0 = layers[0].self_attn
    dev, hidden = attn0.qkv_proj.weight.device, model.config.hidden_size
    gen = torch.Generator(device=dev).manual_seed(0)
    x0 = torch.randn(rows, hidden, device=dev, generator=gen)
    attn_out = torch.randn(rows, attn0.o_proj.in_features, device=dev, generator=gen).to(model.dtype)
    res = residual_stream(x0.to(model.dtype))  # (fp32 for an fp16 model, as the engine's stream)
    step = NormFoldPlan(model, {rows: configs}).step(rows)

    def unfused():
        res.copy_(x0)
        d = torch.zeros(rows, hidden, device=dev, dtype=model.dtype)
        for layer in layers:
            h, _ = layer.input_layernorm(d, res)
            layer.self_attn.qkv_proj(h)
            o = layer.self_attn.o_proj(attn_out)
            h, _ = layer.post_attention_layernorm(o, res)
            d = layer.mlp(h)

    def folded():
        res.copy_(x0)
        x = step.first_input(x0, model.dtype)
        step.parts = None
        for layer in layers:
            x = step.layer(layer, x, res, lambda qkv: attn_out)  # (the engine's folded layer, attention left out)

    return unfused, folded


def tune_norm_fold(model, row_counts: list[int]) -> None:
    """Time the stacks at each decode row count from MIN_ROWS to the decode-batch GEMM's MAX_ROWS; fold the norms and
    give the model a plan for the row counts where folded was faster (any error keeps the model unfolded)."""
    from voltllm.kernels.batch_gemm import MAX_ROWS
    from voltllm.model.norm_fold import FOLD_CONFIGS, MIN_ROWS, NormFoldPlan, fold_norm_weights, ineligible

    if not NORM_FOLD:
        return
    reason = ineligible(model)
    rows_list = sorted({r for r in row_counts if MIN_ROWS <= r <= MAX_ROWS})
    if reason is not None or not rows_list:
        return
    chosen, lines = {}, []
    dev = model.layers[0].self_attn.qkv_proj.weight.device
    try:
        for rows in rows_list:
            unfused, folded = _stacks(model, rows, FOLD_CONFIGS)
            t_unfused, t_folded = replay_median_ms(unfused, dev), replay_median_ms(folded, dev)
            if t_folded < t_unfused:
                chosen[rows] = dict(FOLD_CONFIGS)
            lines.append(f"M={rows}: layers {t_unfused * 1e3:.0f} us as they run, {t_folded * 1e3:.0f} us folded"
                         f" -> {'folded' if rows in chosen else 'unfused'}")
    except Exception as e:  # noqa: BLE001 - an optimisation: keep the layers as they run
        logger.warning("norm-folded decode layers not timed (%s: %s); unfused", type(e).__name__, e)
        return
    if chosen:
        fold_norm_weights(model)
        model.norm_fold = NormFoldPlan(model, chosen)
    logger.info("RMSNorms folded into the decode-batch GEMMs (whole layer stack, attention left out):\n  %s",
                "\n  ".join(lines))


def refold_after_reload(model) -> None:
    """A reload (sleep level 2's wake-up) brings back the checkpoint's norm weights and unfolded projections: fold
    them again where a plan expects folded weights."""
    from voltllm.model.norm_fold import fold_norm_weights

    if getattr(model, "norm_fold", None) is not None:
        fold_norm_weights(model)
