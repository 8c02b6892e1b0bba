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


def assert_matches_one_rank(one: Any, many: Any, prompts: list, max_tokens: int = 16) -> None:
    """Full distributions at every prompt position (batched, chunked), then greedy tokens (decode batches), then again
    from the prefix cache (every rank's state snapshots restored)."""
    from voltllm import SamplingParams

    a, b = full_prompt_logprobs(one, prompts), full_prompt_logprobs(many, prompts)
    assert not a.isnan().any() and not b.isnan().any()
    assert torch.allclose(a, b, atol=5e-5, rtol=0), (a - b).abs().max()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in many.generate(prompts, params)] == expected
    assert many.engine.runner.state_snapshots.num_restored > 0
    many.engine.check_integrity()
