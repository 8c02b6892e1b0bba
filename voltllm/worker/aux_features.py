"""What a DFlash drafter or an EAGLE-3 head reads of its target: the outputs of chosen decoder layers for every token
of a step, in one buffer the target's forward fills (models/aux_hidden.py).

Rank 0 sets the buffer up beside its drafter. Under pipeline parallelism those layers sit on several stages, so each
later stage of rank 0's chain (tensor-parallel rank 0 of every stage: the hand-overs go rank r to rank r, and after
each layer's all-reduce the hidden states are the same on every tensor-parallel rank) sets up the same buffer: it
fills its own layers' columns and the hand-over carries the rows on, back to rank 0 with the last stage's output
(distributed/pipeline.py). The other tensor-parallel ranks keep none and send none.
"""
from __future__ import annotations

from typing import Any, Optional


def drafter_aux_layers(spec: Any, hf_config: Any) -> Optional[tuple[int, ...]]:
    """The target's decoder layers (AuxHiddenCapture's numbering) whose outputs the drafter of `spec` reads, in its
    column order; None for a drafter that reads none (or no speculation)."""
    if spec is None:
        return None
    if spec.uses_dflash:
        from voltllm.engine.dflash import dflash_params

        return tuple(dflash_params(spec.draft_hf_config, hf_config, spec.num_speculative_tokens).target_layer_ids)
    if spec.uses_eagle3:
        from voltllm.engine.eagle3 import head_layer_ids

        return tuple(j - 1 for j in head_layer_ids(spec.draft_hf_config, hf_config))  # (the stream entering j)
    return None


def aux_capacity(scheduler: Any) -> int:
    """The buffer's rows: any forward's tokens (the runner's input buffers' capacity)."""
    return max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs) + 8


def keep_stage_aux(model: Any, config: Any, stage: Any) -> bool:
    """On a later pipeline stage of rank 0's chain, set up the model's share of rank 0's drafter's buffer (the
    same layers and rows, so every hand-over has the same shapes on both sides); whether it did."""
    if stage is None or stage.first or stage.tp_rank != 0:
        return False
    layers = drafter_aux_layers(config.speculative, config.model.hf_config)
    if layers is None:
        return False
    model.set_aux_hidden(layers, aux_capacity(config.scheduler))
    return True
