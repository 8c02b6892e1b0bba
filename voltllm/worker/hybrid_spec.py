"""Speculative decoding on hybrid (Gated DeltaNet) targets: the runner's part after the verification.

The verification step left, in each drafting request's state slot, the state after its last draft, and in the slot's
checkpoint rows the states after its earlier positions (voltllm.model.layers.gdn_verify). Right after the sampler has
judged the drafts, still on the device and in the step's stream (so no later step can read the slot first, and no
host round trip is added), `keep_accepted_states` counts each request's accepted drafts from the sampler's device
results and puts the state after the last accepted one into the slot (StateCache.keep_accepted). The host learns the
counts with the tokens (collect): `settle_states` then sets the slots' token counts, which the next step's
note_step check reads.

A verification step where every request decodes (runner._token_rows_step) runs, for an attention-only model, as
decode rows replayed by the decode CUDA graphs: every row an independent request. A hybrid's rows of one request must
instead go through its recurrent state in order, so a hybrid replays a second graph set captured in walks
(`capture_verify_graphs`: DecodeGraphs(walks=True)), whose GDN layers walk each request's rows from its first row
(`fill_walks` lays the rows out: slot and walk per row); its attention layers see the same decode rows as before.
Without those graphs (the CPU, --enforce-eager, a step with more tokens than --max-num-seqs, a mixed step, a model
whose supports_verify_graphs is False: Qwen4-Exp) the verification is an eager prompt-form step (hybrids capture no
prompt graphs).

Under tensor parallelism every rank holds its heads' states in the same rows; rank 0 broadcasts the accepted counts
it computed and the other ranks keep the same rows (`follow_accepted_states`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from voltllm.host_to_device import to_device

# (request id, slot, the slot's lease, the request's start) of each verifying request of a step
SettleRecord = tuple[str, int, int, int]


def keep_accepted_states(cache: Any, rows: list, out: Any, draft_ids: Optional[torch.Tensor],
                         tp: Any = None) -> list[SettleRecord]:
    """rows: the step's verifying (index, ScheduledRequest) pairs in verification-row order (1 + drafts rows each);
    out: the sampler's SamplerOutput (greedy: the model's choices) or DraftVerdicts, before its host copy;
    draft_ids: a draft model's drafts per row on the device (-1 after each request's last), else None (the drafts
    are the requests' spec_tokens); tp: rank 0's group (tensor- or pipeline-parallel), whose other ranks take the
    same counts (follow_accepted_states)."""
    dev = out.tokens.device
    n_drafts = [len(s.spec_tokens) for _, s in rows]
    req_of_row = [i for i, k in enumerate(n_drafts) for _ in range(k + 1)]
    pos = [j for k in n_drafts for j in range(k + 1)]
    if hasattr(out, "accepted"):  # sampled verification: the verdict per row (False on each request's last row)
        match = out.accepted
    else:  # greedy: a draft is accepted while it is the model's choice
        drafts = draft_ids if draft_ids is not None else to_device(
            [d for _, s in rows for d in (*s.spec_tokens, -1)], torch.long, dev)
        match = out.tokens == drafts
    slots = [cache.slot_of(s.request.request_id) for _, s in rows]
    flat = to_device(req_of_row + pos + n_drafts + slots, torch.long, dev)
    r = len(req_of_row)
    req_of_row, pos, k_dev, slots_dev = flat[:r], flat[r:2 * r], flat[2 * r:2 * r + len(rows)], flat[2 * r + len(rows):]
    # a request's accepted drafts = the position of its first unmatched row (its last row never matches)
    first_miss = torch.where(match, torch.full_like(pos, r), pos)
    accepted = torch.full_like(k_dev, r).scatter_reduce_(0, req_of_row, first_miss, "amin")
    if tp is not None:  # the other ranks keep the same rows of their heads' states
        tp.broadcast_(accepted)
    cache.keep_accepted(slots_dev, k_dev, accepted)
    return [(s.request.request_id, slot, cache.lease[slot], s.start) for (_, s), slot in zip(rows, slots)]


def follow_accepted_states(cache: Any, tp: Any, verify: list[tuple[int, int]]) -> None:
    """A rank other than 0 (tensor- or pipeline-parallel), after a verification: rank 0's accepted-draft counts (a
    device broadcast, in stream order: no host sync) pick the same checkpoint rows of this rank's states. verify: the
    requests' (slot, draft count), in rank 0's row order. Their host-side token counts come with the next step
    (StepInputs.state_spans)."""
    n = len(verify)
    accepted = torch.empty(n, dtype=torch.long, device=tp.device)
    tp.broadcast_(accepted)
    flat = to_device([slot for slot, _ in verify] + [k for _, k in verify], torch.long, accepted.device)
    cache.keep_accepted(flat[:n], flat[n:], accepted)


def settle_states(cache: Any, records: list[SettleRecord], verified: dict[str, list[int]]) -> None:
    """The host side: each verifying request's slot covers its known tokens and accepted drafts (the tokens
    `verified` emits, but the last, which is the model's next input)."""
    for rid, slot, lease, start in records:
        cache.settle(slot, lease, start + len(verified[rid]))


def fill_walks(scheduled: list, slots: list[int], h: dict, rows: int, pad_slot: int, max_seqs: int) -> None:
    """A token-rows step's state rows in the staging set h: each row gets its request's slot; a request's first row
    walks the request's rows, its other rows walk none; padding rows up to `rows` walk themselves on the scratch
    slot. state_walks holds the starts, then (from max_seqs on) the ends."""
    sl, st, en = [], [], []
    r = 0
    for s, slot in zip(scheduled, slots):
        n = s.num_new_tokens
        sl += [slot] * n
        st += [r, *range(r + 1, r + n)]
        en += [r + n, *range(r + 1, r + n)]
        r += n
    pad = range(r, rows)
    h["state_slots"][:rows] = sl + [pad_slot] * len(pad)
    h["state_walks"][:rows] = st + list(pad)
    h["state_walks"][max_seqs:max_seqs + rows] = en + [p + 1 for p in pad]


def capture_verify_graphs(runner: Any) -> Optional[Any]:
    """The hybrid's verification graphs (one per decode batch size, sharing the decode graphs' memory pool), or
    None when capturing them runs out of memory (verifications then run eagerly)."""
    import logging
    import time

    from voltllm.worker.cuda_graphs import DecodeGraphs

    logger = logging.getLogger("voltllm")
    t0 = time.monotonic()
    graphs = DecodeGraphs(runner, walks=True)
    try:
        graphs.capture(runner.graphs.pool)
    except torch.OutOfMemoryError:
        del graphs
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()
        logger.warning("hybrid verification steps run eagerly: capturing their CUDA graphs ran out of GPU memory")
        return None
    logger.info("captured %d hybrid verification CUDA graphs in %.1f s", len(graphs.graphs), time.monotonic() - t0)
    return graphs
