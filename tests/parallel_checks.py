"""What the tensor- and pipeline-parallel CPU tests share: prompts, engine settings, and the whole-vocabulary check
of a multi-rank engine against one rank."""
from __future__ import annotations

from typing import Any

import torch

from tiny_models import full_prompt_logprobs

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Hi",
    "def add(a, b):\n    return a + b\n# now the quick brown fox",
]
# small blocks and a small token budget: chunked prefill, mixed prefill + decode steps, prefix-cache hits
ENGINE = dict(block_size=4, max_num_batched_tokens=7, max_num_seqs=8)


def assert_logits_match(one: Any, many: Any, atol: float = 2e-5) -> None:
    """Full distributions at every prompt position (prompt logprobs over the whole vocabulary), batched."""
    a, b = full_prompt_logprobs(one, PROMPTS), full_prompt_logprobs(many, PROMPTS)
    assert not a.isnan().any() and not b.isnan().any()
    assert torch.allclose(a, b, atol=atol, rtol=0), (a - b).abs().max()
