"""EAGLE-3 speculation in the runner: the head (model/models/eagle3.py), its KV cache, its drafts.

An EAGLE-3 head drafts as the target's own MTP module does (worker/mtp_runner.py, whose runner this one is): its KV at
position i needs the target's state there and the next token x_{i+1}, so `after_step` runs it over every token the
step computed, right after the step's sampling and verification, fed the token emitted after each; the output at each
request's last accepted position gives the next step's first draft, and K - 1 chained one-token passes (each fed its
previous output and draft) give the rest. So the same invariant holds: after every step all positions below a
request's computed length hold correct head KV (no lag), and prefix-cache hits, preemption and freeing are the
target's books (cache tensors of its own addressed by the target's block ids). CUDA graphs: MTPRunner's.

What differs: the target's state a row reads is not the target's last hidden state but `fc` of the residual stream
entering three of its layers, which the target keeps for every token of every forward in one fixed buffer
(AuxHiddenCapture, set here before any graph capture, as DFlash's drafter reads it); `fc` runs eagerly before the pass
over the step (one GEMM), so the captured forward reads a hidden-size input in both kinds of pass. The head's logits
cover its draft vocabulary, placed at the target's ids (d2t).
"""
from __future__ import annotations

from typing import Any

import torch

from voltllm.attention.backend import AttentionMetadata
from voltllm.worker.aux_features import aux_capacity
from voltllm.worker.device_drafts import load_head
from voltllm.worker.mtp_runner import MTPRunner


class Eagle3Runner(MTPRunner):
    """The EAGLE-3 head beside a ModelRunner (called as an MTPRunner is; under -tp split as the MTP module is)."""

    def __init__(self, runner: Any, spec: Any):
        super().__init__(runner, spec)
        sc = runner.config.scheduler
        # the target's chosen layers' outputs for every token of a step (the runner's input buffers' capacity)
        self.features = runner.model.set_aux_hidden(self.params.capture_layers, aux_capacity(sc))

    def _load(self, runner: Any) -> torch.nn.Module:
        from voltllm.engine.eagle3 import checkpoint_tensor_names, eagle3_params
        from voltllm.model.models.eagle3 import Eagle3Drafter

        spec, mc = self.spec, runner.config.model
        self.params = eagle3_params(spec.draft_hf_config, mc.hf_config, checkpoint_tensor_names(spec.model))
        return load_head(runner, spec, lambda r: Eagle3Drafter(spec.draft_hf_config, self.params, r.model, r.dtype,
                                                               mc.max_model_len + 1,
                                                               r.full_vocab if self.group is None else None,
                                                               tp=self.group), "EAGLE-3 head")

    @torch.inference_mode()
    def after_step(self, sched: Any, meta: AttentionMetadata, hidden: torch.Tensor, qsl: list[int],
                   handle: Any) -> None:
        """MTPRunner.after_step over the step's rows, fed the head's fused target states instead of the target's
        last hidden states."""
        n = meta.query_start_loc_cpu[-1]
        super().after_step(sched, meta, self.model.fuse(self.features[:n]), qsl, handle)

    @torch.inference_mode()
    def follow_after_step(self, step: Any, meta: AttentionMetadata, hidden: torch.Tensor) -> None:
        """MTPRunner.follow_after_step, fed the fused target states as rank 0's after_step is."""
        n = meta.query_start_loc_cpu[-1]
        super().follow_after_step(step, meta, self.model.fuse(self.features[:n]))
