"""The device side of a pooling engine: each step, the final-norm hidden states of the pooling requests' chunks
become embeddings for the requests whose prompt ends in the step (ModelRunner.launch_sampling calls pool()).

LAST reads the prompt's last row (it is always computed: a prefix-cache hit leaves at least one token). MEAN and CLS
read earlier tokens too, and a prompt may take several steps (chunked prefill): MEAN keeps each request's running sum
of its chunks' rows, CLS its first token's row, until its last chunk (their engines cache no prefixes, config.py).
A request preempted mid-prompt is computed again from its first token, which starts its sum over.
A classifier's pooled rows go through its head (float32) and, where the request asks (use_activation), its
activation: each request's result is then its num_labels values (classifier.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from voltllm.host_to_device import to_device, upload
from voltllm.pooling.classifier import activate


@dataclass
class PooledRows:
    """One step's embeddings on their way to the host: row i is request_ids[i]'s, its first lengths[i] values."""

    request_ids: list[str]
    data: torch.Tensor  # [rows, hidden] float32
    lengths: list[int]

    def copy_to_host_async(self) -> None:
        if self.data.device.type == "cuda":  # (the step's event covers the copy)
            host = torch.empty(self.data.shape, dtype=self.data.dtype, pin_memory=True)
            host.copy_(self.data, non_blocking=True)
            self.data = host

    def to_host(self) -> dict:
        # each row its own tensor (a pickled view would carry the whole batch's storage to the API process)
        return {rid: self.data[i, :n].clone() for i, (rid, n) in enumerate(zip(self.request_ids, self.lengths))}


class Pooler:
    def __init__(self, pooling_type: str, head: Optional[torch.Tensor] = None, activation: Optional[str] = None):
        """head: a classifier's weight [num_labels, hidden] (float32, on the model's device); activation: its
        activation (sigmoid / softmax / none). None: an embedding model."""
        self.pooling_type = pooling_type
        self.head = head
        self.activation = activation
        # MEAN: the float32 sum of the rows computed so far; CLS: the first token's row (by request id)
        self._partial: dict[str, torch.Tensor] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._partial.pop(rid, None)

    def pool(self, hidden: torch.Tensor, qsl: list[int], scheduled: list) -> Optional[PooledRows]:
        """hidden: the step's final hidden states (token rows, request spans at qsl); scheduled: its
        ScheduledRequests. Returns the embeddings of the requests whose prompt ends here (None: no such request)."""
        if self.pooling_type == "LAST":
            done = [(i, s) for i, s in enumerate(scheduled) if s.pools]
            if not done:
                return None
            pooled = hidden[to_device([qsl[i + 1] - 1 for i, _ in done], torch.long, hidden.device)].float()
        else:
            done, rows = self._accumulate(hidden, qsl, scheduled)
            if not done:
                return None
            pooled = torch.stack(rows)
        ids, params = [s.request.request_id for _, s in done], [s.request.pooling_params for _, s in done]
        if self.head is not None:
            return classify(pooled, self.head, self.activation, ids, params)
        return finish(pooled, ids, params)

    def _accumulate(self, hidden: torch.Tensor, qsl: list[int], scheduled: list) -> tuple[list, list]:
        """MEAN / CLS: fold this step's chunks into the requests' partial results; (the finished (index, request)
        pairs, their pooled rows)."""
        pooling = [(i, s) for i, s in enumerate(scheduled) if s.request.is_pooling]
        if not pooling:
            return [], []
        n = len(scheduled)  # (qsl may go on over a CUDA graph's padding rows)
        if self.pooling_type == "MEAN":  # every chunk's row sum at once: a segment sum over the step's tokens
            seg = upload(torch.from_numpy(np.repeat(np.arange(n), np.diff(np.asarray(qsl[:n + 1])))), hidden.device)
            sums = torch.zeros(n, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, seg, hidden[:qsl[n]].float())
        done, rows = [], []
        for i, s in pooling:
            rid = s.request.request_id
            if self.pooling_type == "MEAN":
                part = sums[i] if s.start == 0 else self._partial[rid] + sums[i]
            elif s.start == 0:  # CLS: a copy (hidden may be a CUDA graph's buffer, rewritten by the next replay)
                part = hidden[qsl[i]].to(torch.float32, copy=True)
            else:
                part = self._partial[rid]
            if s.pools:
                self._partial.pop(rid, None)
                done.append((i, s))
                rows.append(part / s.request.num_prompt_tokens if self.pooling_type == "MEAN" else part)
            else:
                self._partial[rid] = part
        return done, rows


def classify(pooled: torch.Tensor, head: torch.Tensor, activation: str, request_ids: list[str],
             params: list) -> PooledRows:
    """The classifier's outputs: logits = pooled . head^T, activated for the requests that ask (use_activation)."""
    logits = pooled @ head.t()
    active = [bool(p.use_activation) for p in params]
    if all(active):
        out = activate(logits, activation)
    elif any(active):
        idx = to_device([i for i, a in enumerate(active) if a], torch.long, logits.device)
        out = logits.clone()
        out[idx] = activate(logits[idx], activation)
    else:
        out = logits
    return PooledRows(request_ids, out, [head.shape[0]] * len(request_ids))


def finish(pooled: torch.Tensor, request_ids: list[str], params: list) -> PooledRows:
    """Each row cut to its request's dimensions (matryoshka), then L2-normalized where asked (vLLM's order: the cut
    embedding is normalized again)."""
    hidden = pooled.shape[-1]
    keys = [(p.dimensions or hidden, bool(p.normalize)) for p in params]
    if len(set(keys)) == 1:  # the common case: one setting for the whole step
        dims, normalize = keys[0]
        out = pooled[:, :dims]
        out = F.normalize(out, p=2, dim=-1) if normalize else out.contiguous()
        return PooledRows(request_ids, out, [dims] * len(request_ids))
    out = torch.zeros_like(pooled)
    for key in set(keys):
        dims, normalize = key
        idx = to_device([i for i, k in enumerate(keys) if k == key], torch.long, pooled.device)
        part = pooled[idx, :dims]
        out[idx, :dims] = F.normalize(part, p=2, dim=-1) if normalize else part
    return PooledRows(request_ids, out, [k[0] for k in keys])
