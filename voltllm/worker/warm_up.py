"""Start-up warm-up: one eager forward of a small mixed step, so the Triton kernel forms such steps take compile at
start-up instead of inside the first such step's time to first token.

Start-up's own forwards do not meet them: the memory profile is one sequence at the token budget (on the compat route
a hybrid's GDN layers run it in the torch form, long prompts being cheaper there), the prompt-graph warm-ups are one
sequence each, and the decode graphs are pure decode. A step of a decode row beside prompts of unequal lengths takes
the compat route's varlen bridge, the eager decode rows, the hybrids' Triton chunk kernels for short prompts and
their RowSplit decode rows, and the MoE layers' eager align (benchmarks/micro/bench_compiles.py; docs/kernels.md
"Session 44": up to 36 s of compiles in a first request on the 35B-A3B shape under --compat sm70).
"""
from __future__ import annotations

import torch

from voltllm.attention.backend import AttentionMetadata
from voltllm.model.forward_context import ForwardContext

# a decode row, then two prompts of different lengths, each from token 0 (a hybrid's throwaway state then fits)
WARM_UP_QUERY_LENS = (1, 9, 17)


def mixed_step_metadata(device: torch.device, lens: tuple[int, ...] = WARM_UP_QUERY_LENS) -> AttentionMetadata:
    """Sequences of `lens` query rows each starting at token 0, every position in block 0, storing nothing."""
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    i32 = {"dtype": torch.int32, "device": device}
    return AttentionMetadata(
        num_tokens=qsl[-1], query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(lens, **i32),
        block_tables=torch.zeros(len(lens), max(lens), **i32),  # (block 0 at every position, whatever the page)
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.long, device=device), max_query_len=max(lens),
        max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=list(lens))


@torch.inference_mode()
def mixed_step_forward(runner) -> torch.Tensor:
    """The runner's model over mixed_step_metadata on its own KV caches and backend (token 0 everywhere): K / V are
    stored nowhere, attention reads block 0 whatever it holds, a hybrid's recurrent state is a throwaway one.
    Returns the hidden states (for tests). Under tensor parallelism every rank calls it at the same point of its
    start-up, as the memory profile (its collectives pair up)."""
    dev = runner.device
    meta = mixed_step_metadata(dev)
    ids = torch.zeros(meta.num_tokens, dtype=torch.long, device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in meta.seq_lens_cpu])
    return runner.model(ids, positions, ForwardContext(meta, runner.kv_caches, runner.backend))
