"""Persistent step inputs: device buffers (CUDA-graph-stable addresses) fed from pinned host staging.

Two layouts of the per-token and per-row arrays (input ids, positions, slot mapping, query start locations,
sequence lengths, recurrent-state slots):
  - compact: all of them packed in one byte buffer sized for `max_seqs` rows, uploaded with one copy. Decode
    steps (and any step of at most that many tokens and rows) use it, and the CUDA graphs are captured on it: a
    host -> device copy costs the host ~16 us per call on a slow CPU, six per step before.
  - wide: one tensor per array, sized for `max_tokens`, for steps with more tokens (prefill chunks).
The block tables are one buffer shared by both. `host_set(num_tokens, rows)` picks the layout for the next step;
the attributes input_ids, positions, ... then name that layout's device tensors.

Host staging is double-buffered: while the GPU may still be copying step N's inputs, the CPU fills the
other set for step N+1 (async scheduling). The device buffers are rewritten by stream-ordered copies,
so step N+1's copy cannot overtake step N's kernels.
"""
from __future__ import annotations

import numpy as np
import torch

# the compact layout, in order: (name, dtype, rows past max_seqs); each field starts 8-byte aligned
_COMPACT = (("input_ids", torch.long, 0), ("positions", torch.long, 0), ("slot_mapping", torch.long, 0),
            ("state_slots", torch.long, 0), ("query_start_loc", torch.int32, 1), ("seq_lens", torch.int32, 0),
            ("state_walks", torch.int32, None))
# state_walks (a hybrid's verification replayed as decode rows): each row's walk start, then (from max_seqs on) its
# end; rows past max_seqs: None = max_seqs more

_FIELDS = tuple(name for name, _, _ in _COMPACT)


def _compact_offsets(max_seqs: int) -> tuple[dict[str, tuple[int, int, torch.dtype]], int]:
    """name -> (byte offset, elements, dtype), and the total bytes."""
    out, off = {}, 0
    for name, dtype, extra in _COMPACT:
        n = max_seqs + (max_seqs if extra is None else extra)
        out[name] = (off, n, dtype)
        off += -(-n * dtype.itemsize // 8) * 8
    return out, off


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.device = device
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        pin = device.type == "cuda"
        self._sets = 2 if pin else 1

        def dev(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        def host(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        self.block_tables = dev(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        # wide layout
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                 "state_slots": max_seqs, "query_start_loc": max_seqs + 1, "seq_lens": max_seqs,
                 "state_walks": 2 * max_seqs}
        dtypes = {name: dtype for name, dtype, _ in _COMPACT}
        self._wide = {name: dev(sizes[name], dtype=dtypes[name]) for name in _FIELDS}
        self._wide_host = [{name: host(sizes[name], dtype=dtypes[name]) for name in _FIELDS}
                           for _ in range(self._sets)]
        # compact layout: one byte buffer, typed views into it
        offsets, nbytes = _compact_offsets(max_seqs)
        self._raw = dev(nbytes, dtype=torch.uint8)
        self._raw_host = [host(nbytes, dtype=torch.uint8) for _ in range(self._sets)]
        self._compact = {name: self._raw[o:o + n * dt.itemsize].view(dt) for name, (o, n, dt) in offsets.items()}
        self._compact_host = [{name: raw[o:o + n * dt.itemsize].view(dt) for name, (o, n, dt) in offsets.items()}
                              for raw in self._raw_host]
        self._tables_host = [host(max_seqs * max_blocks_per_seq, dtype=torch.int32) for _ in range(self._sets)]
        # per staging set and layout (wide, compact): numpy views, made once (writes go straight to pinned memory)
        self._views = [tuple({**{k: v.numpy() for k, v in arrays[i].items()},
                              "block_tables": self._tables_host[i].numpy()}
                             for arrays in (self._wide_host, self._compact_host)) for i in range(self._sets)]
        self._turn = 0
        self.select_compact()

    def select_compact(self) -> None:
        """Point the attributes at the compact layout: the one CUDA graphs are captured on (and replay)."""
        self._select(True)

    def _select(self, compact: bool) -> None:
        self._compact_now = compact
        for name, t in (self._compact if compact else self._wide).items():
            setattr(self, name, t)

    def select_for(self, num_tokens: int, rows: int) -> None:
        """Point the attributes at the layout host_set(num_tokens, rows) picks (prompt-graph capture)."""
        self._select(self.fits_compact(num_tokens, rows))

    def fits_compact(self, num_tokens: int, rows: int) -> bool:
        return num_tokens <= self.max_seqs and rows <= self.max_seqs

    def host_set(self, num_tokens: int, rows: int) -> dict[str, np.ndarray]:
        """The staging set for the next step (num_tokens tokens in rows rows, CUDA-graph padding included), as
        numpy views, with "block_tables" flat; selects the layout whose device tensors the attributes name."""
        self._turn = (self._turn + 1) % self._sets
        compact = self.fits_compact(num_tokens, rows)
        self._select(compact)
        return self._views[self._turn][compact]

    def upload(self, num_tokens: int, num_seqs: int, table_width: int, num_rows: int | None = None,
               state_slots: bool = False) -> None:
        """Copy the current staging set to the device (non-blocking): the compact layout whole (a few KB), the
        wide one array by array (their first rows; `state_slots` only when asked: only CUDA-graph steps of hybrid
        models read them), and the block tables' first `rows` x `table_width`."""
        nb = self.device.type == "cuda"
        rows = num_rows or num_seqs
        if self._compact_now:
            self._raw.copy_(self._raw_host[self._turn], non_blocking=nb)
        else:
            h = self._wide_host[self._turn]
            for name in ("input_ids", "positions", "slot_mapping"):
                self._wide[name][:num_tokens].copy_(h[name][:num_tokens], non_blocking=nb)
            self._wide["query_start_loc"][: rows + 1].copy_(h["query_start_loc"][: rows + 1], non_blocking=nb)
            self._wide["seq_lens"][:rows].copy_(h["seq_lens"][:rows], non_blocking=nb)
            if state_slots:
                self._wide["state_slots"][:rows].copy_(h["state_slots"][:rows], non_blocking=nb)
        table = self._tables_host[self._turn][: rows * table_width].view(rows, table_width)
        self.block_tables[:rows, :table_width].copy_(table, non_blocking=nb)
