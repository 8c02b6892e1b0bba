"""Persistent step inputs: device buffers (CUDA-graph-stable addresses) fed from pinned host staging.

Host staging is double-buffered: while the GPU may still be copying step N's inputs, the CPU fills the
other set for step N+1 (async scheduling). The device buffers are rewritten by stream-ordered copies,
so step N+1's copy cannot overtake step N's kernels.
"""
from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.device = device
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        pin = device.type == "cuda"

        def dev(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = dev(max_tokens, dtype=torch.long)
        self.positions = dev(max_tokens, dtype=torch.long)
        self.slot_mapping = dev(max_tokens, dtype=torch.long)
        self.query_start_loc = dev(max_seqs + 1, dtype=torch.int32)
        self.seq_lens = dev(max_seqs, dtype=torch.int32)
        self.block_tables = dev(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        # recurrent-state slot of each row (hybrid models' CUDA-graph steps; padding rows: the scratch slot)
        self.state_slots = dev(max_seqs, dtype=torch.long)
        self._host = []
        for _ in range(2 if pin else 1):
            def host(*shape, dtype):
                return torch.zeros(*shape, dtype=dtype, pin_memory=pin)
            self._host.append(dict(
                input_ids=host(max_tokens, dtype=torch.long), positions=host(max_tokens, dtype=torch.long),
                slot_mapping=host(max_tokens, dtype=torch.long), query_start_loc=host(max_seqs + 1, dtype=torch.int32),
                seq_lens=host(max_seqs, dtype=torch.int32),
                block_tables=host(max_seqs * max_blocks_per_seq, dtype=torch.int32),
                state_slots=host(max_seqs, dtype=torch.long)))
        self._turn = 0

    def host_set(self) -> dict[str, np.ndarray]:
        """The staging set for the next step, as numpy views (writes go straight to pinned memory)."""
        self._turn = (self._turn + 1) % len(self._host)
        return {k: v.numpy() for k, v in self._host[self._turn].items()}

    def upload(self, num_tokens: int, num_seqs: int, table_width: int, num_rows: int | None = None,
               state_slots: bool = False) -> None:
        """Copy the current staging set's first rows to the device (non-blocking); `state_slots` too when
        asked (only CUDA-graph steps of hybrid models read them)."""
        h = self._host[self._turn]
        nb = self.device.type == "cuda"
        rows = num_rows or num_seqs
        for name in ("input_ids", "positions", "slot_mapping"):
            getattr(self, name)[:num_tokens].copy_(h[name][:num_tokens], non_blocking=nb)
        self.query_start_loc[: rows + 1].copy_(h["query_start_loc"][: rows + 1], non_blocking=nb)
        self.seq_lens[:rows].copy_(h["seq_lens"][:rows], non_blocking=nb)
        table = h["block_tables"][: rows * table_width].view(rows, table_width)
        self.block_tables[:rows, :table_width].copy_(table, non_blocking=nb)
        if state_slots:
            self.state_slots[:rows].copy_(h["state_slots"][:rows], non_blocking=nb)
