"""EAGLE-1 speculation in the runner: the head (model/models/eagle1.py), its KV cache, its drafts.

An EAGLE-1 head drafts exactly as the target's own MTP module does (worker/mtp_runner.py, whose runner this one is):
its KV at position i needs the target's last hidden state there (after the final norm, the state MTPRunner's pass
over the step is given) and the next token x_{i+1}; the pass over every token a step computed runs right after the
step's sampling and verification, its output at each request's last accepted position gives the next step's first
draft, and K - 1 chained one-token passes (each fed its previous output and draft) give the rest. Prefix-cache hits,
preemption and freeing are the target's books; CUDA graphs are MTPRunner's. Only the module differs.
"""
from __future__ import annotations

from typing import Any

import torch

from voltllm.worker.device_drafts import load_head
from voltllm.worker.mtp_runner import MTPRunner


class Eagle1Runner(MTPRunner):
    """The EAGLE-1 head beside a ModelRunner (called as an MTPRunner is; under -tp split as the MTP module is)."""

    def _load(self, runner: Any) -> torch.nn.Module:
        from voltllm.engine.eagle1 import eagle1_params, head_tensor_names
        from voltllm.model.models.eagle1 import Eagle1Drafter

        spec, mc = self.spec, runner.config.model
        self.params = eagle1_params(spec.draft_hf_config, mc.hf_config, head_tensor_names(spec.model))
        return load_head(runner, spec, lambda r: Eagle1Drafter(spec.draft_hf_config, self.params, r.model, r.dtype,
                                                               mc.max_model_len + 1,
                                                               r.full_vocab if self.group is None else None,
                                                               tp=self.group), "EAGLE-1 head")
