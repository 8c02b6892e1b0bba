"""Whether a dense model's decode-batch steps fold the decoder layers' RMSNorms and residual adds into the GEMMs.

Folded (LlamaForCausalLM.fused_batch), a layer is four GEMMs and its attention: o_proj and down add their product
into the residual stream in place and write its rows' partial sums of squares; qkv and gate_up normalise the
residual tiles they read (kernels/batch_gemm.py). That removes two add + RMSNorm launches per layer, but every
consumer program then reads the residual (fp32 for fp16 models: twice the bytes of the fp16 input it read before)
and each producer reads and writes it. Which side wins depends on the shapes and the GPU, so the runner times the
model's own layers both ways at every row count whose four projections all run the decode-batch GEMM, as a CUDA
graph replay of the whole stack (embedding, layers with the attention replaced by a slice of q, final norm).
"""
from __future__ import annotations

import logging
import types

import torch

from voltllm.worker.cuda_graphs import gc_paused

logger = logging.getLogger("voltllm")


def _stack_ms(model: torch.nn.Module, ids: torch.Tensor, fused: bool, reps: int = 3) -> float:
    """Per-call time of the layer stack at len(ids) rows (fused or not), replayed from a CUDA graph."""
    model.batch_norm_fused[ids.numel()] = fused
    model(ids, ids, None)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        for _ in range(reps):
            model(ids, ids, None)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (2 * reps)


def _attention_stand_in(attn, positions, qkv, ctx):
    """q's columns of the qkv projection, as the attention output o_proj reads (same shape)."""
    return qkv[:, :attn.num_heads * attn.head_dim]


@torch.inference_mode()
def tune_norm_fusion(model: torch.nn.Module, row_counts: list[int]) -> dict[int, bool]:
    """Set `model.batch_norm_fused[rows]` where the folded layers time faster; returns the choices made."""
    if not hasattr(model, "batch_norm_fused"):
        return {}
    projections = [p for layer in model.layers for p in layer.projections()]
    choices, lines = {}, []
    dev = model.embed_tokens.weight.device
    for layer in model.layers:  # attention needs the KV cache: time the rest of the layer around a stand-in
        layer.self_attn.attend = types.MethodType(_attention_stand_in, layer.self_attn)
    try:
        for rows in row_counts:
            if not all(rows in p.batch_gemm for p in projections):
                continue
            ids = torch.zeros(rows, dtype=torch.long, device=dev)
            t_plain = _stack_ms(model, ids, False)
            t_fused = _stack_ms(model, ids, True)
            choices[rows] = model.batch_norm_fused[rows] = t_fused < t_plain
            lines.append(f"M={rows}: norms and adds folded {t_fused * 1e3:.1f} us, separate {t_plain * 1e3:.1f} us "
                         f"-> {'folded' if choices[rows] else 'separate'}")
    finally:
        for layer in model.layers:
            del layer.self_attn.attend
    if lines:
        logger.info("decode-batch RMSNorm + residual add (whole layer stack, attention left out):\n  %s",
                    "\n  ".join(lines))
    return choices
