"""What rank 0 sends the other ranks for one step: enough to fill their input buffers, pick the same CUDA graph and
compute the same logits rows. The input ids go separately, as a device broadcast after rank 0 filled them, since
some are still being sampled on rank 0's GPU when the step launches (async scheduling), and a draft model's drafts
are made on rank 0's GPU. A speculative step's verification rows are its drafts' positions (spec_logits_rows); on a
hybrid the accepted-draft counts follow as a second device broadcast (worker/hybrid_spec.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

# rows of the step's hidden states whose logits rank 0 computes, in its order: (start, stop) or a list of rows
LogitsRows = Union[tuple[int, int], list[int]]


@dataclass
class StepInputs:
    num_tokens: int  # the step's real tokens
    padded_tokens: int  # tokens uploaded (CUDA-graph padding included)
    num_seqs: int
    rows: int  # rows uploaded (CUDA-graph padding included)
    table_width: int
    positions: np.ndarray  # [padded_tokens]
    slot_mapping: np.ndarray  # [padded_tokens]
    block_tables: np.ndarray  # [rows * table_width]
    query_start_loc: list[int]  # [rows + 1]
    seq_lens: list[int]  # [rows]
    max_query_len: int
    graph_rows: int = 0  # a decode CUDA graph's batch size (0: none)
    prompt_graph_tokens: int = 0  # a piecewise prompt graph's token count (0: none)
    calc_kv_scales: bool = False
    calc_key_offsets: bool = False
    logits_rows: list[LogitsRows] = field(default_factory=list)
    # a speculative step: the verification's rows (their logits come first, before logits_rows)
    spec_logits_rows: list[int] = field(default_factory=list)
    # a hybrid model's recurrent state (rank 0 allocates the slots and keeps the snapshot index; every rank's state
    # cache and snapshot pool hold their own heads in the same rows): each request's slot, the snapshots restored
    # into slots before the forward (row or host slot, slot, tokens, from host) and the slots saved after it (slot,
    # row, host slot the row's evicted snapshot goes to first or -1: --kv-offloading-size)
    state_slots: Optional[list[int]] = None
    state_restores: list[tuple[int, int, int, bool]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    # each request's (start, end) tokens (the slots' token counts before and after the step, as rank 0 checked them)
    state_spans: list[tuple[int, int]] = field(default_factory=list)
    # a speculative step: each request's draft count (an eager verification keeps per-position states), and the
    # verifying requests' (slot, draft count), whose accepted counts rank 0 broadcasts after its sampler judged them
    state_drafts: Optional[list[int]] = None
    state_verify: list[tuple[int, int]] = field(default_factory=list)
    # a verification replayed as decode rows (the walks graphs): per row its slot, walk start and walk end
    state_walks: Optional[tuple[list[int], list[int], list[int]]] = None
    # --enable-lora: the step's slot loads and each token's adapter slot (lora/manager.py LoRAStep), as rank 0 chose
    lora: Optional[Any] = None
    # --kv-offloading-size: the step's copies between blocks and host slots (cache/cpu_offload.py KVTransfers), run
    # before the forward
    kv_transfers: Optional[Any] = None
    # image input: the step's scratch rotary rows and which tokens take tower rows (worker/image_step.py ImageRows;
    # the rows themselves follow the input ids as a broadcast)
    images: Optional[Any] = None
    # a split MTP module (worker/mtp_runner.py): the step's request count, the rows of rank 0's after-step broadcast
    draft_requests: int = 0
    # a split draft model (worker/draft_runner.py): this step's draft run is left out (every request drafted)
    draft_skip_run: bool = False
    # a split DFlash drafter with sliding-window layers (worker/dflash_runner.py): the step's tokens' ring slots
    draft_ring_slots: Optional[np.ndarray] = None
    # --enable-prompt-embeds: the step's token indices that take rank 0's prompt-embedding rows (a broadcast after the
    # ids and any image rows; worker/prompt_embeds_rows.py)
    prompt_embeds_at: Optional[np.ndarray] = None
