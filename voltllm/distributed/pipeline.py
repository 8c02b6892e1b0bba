"""Pipeline parallelism: each rank holds a contiguous run of the decoder layers, and a step's hidden states travel
from rank to rank.

Rank 0 is the first stage and also the last step of the ring: it holds the embeddings, its layers, the final norm and
the LM head, and it schedules and samples as with one GPU. A step goes 0 -> 1 -> ... -> N-1 and back to rank 0, which
then computes the logits. So only the hidden states (and the residual stream, which the fused add + norm keeps apart
until the next layer's norm) cross between GPUs: a step's tokens x hidden size, twice, per boundary. The other ranks
run the same step from the StepInputs rank 0 sends them (execute_follower), over their own layers and KV cache.

This gives a model room on several GPUs whose count does not divide its heads (a 3-GPU rig), and over PCIe it sends
far less than tensor parallelism's two all-reduces per layer. The stages run one after another within a step (no
micro-batches), so it adds capacity, not speed.

With -tp T as well, each stage is T ranks splitting its layers as tensor parallelism does (a subgroup of their own):
world rank = stage * T + tensor-parallel rank, and tensor-parallel rank r of a stage hands its (replicated) hidden
states to rank r of the next. Stage 0's T ranks hold the vocabulary-parallel embedding and LM head.

A model whose residual stream is one tensor (Qwen4-Exp: hc_count copies of the hidden state side by side, [T,
hc * H], with no separate residual) hands that tensor over instead (receive_stream / pass_on_stream): a step's tokens x
hc x hidden size per boundary.

A DFlash drafter or an EAGLE-3 head on rank 0 reads several layers' outputs (models/aux_hidden.py): on rank 0's
chain (tensor-parallel rank 0 of each stage) the step's rows of that buffer go along with each hand-over, every stage
adding its own layers' columns, and come back to rank 0 with the last stage's output (worker/aux_features.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


def stage_layers(num_layers: int, size: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) decoder layers: an even split, the remainder going one layer each to the last ranks
    (rank 0 also holds the embeddings and the LM head, so it gets the fewest)."""
    if size > num_layers:
        raise ValueError(f"--pipeline-parallel-size {size} is more than the model's {num_layers} decoder layers")
    base, extra = divmod(num_layers, size)
    counts = [base + (1 if r >= size - extra else 0) for r in range(size)]
    bounds, start = [], 0
    for n in counts:
        bounds.append((start, start + n))
        start += n
    return bounds


@dataclass
class PipelineStage:
    """This rank's place in the pipeline and the hand-overs of a step's hidden states (over the group's device
    communicator: NCCL on CUDA, which CUDA graphs capture like the all-reduces of tensor parallelism; gloo on the
    CPU)."""

    rank: int  # the stage's index
    size: int  # the stage count
    start: int  # this rank's first decoder layer (global index)
    end: int  # one past its last
    group: Any  # every rank's TPGroup (voltllm.distributed.group): the hand-overs go over it
    tp_size: int = 1  # tensor-parallel ranks per stage
    tp_rank: int = 0  # this rank's among its stage's

    @classmethod
    def of(cls, num_layers: int, group: Any, tp_size: int = 1) -> "PipelineStage":
        stage, tp_rank = divmod(group.rank, tp_size)
        size = group.size // tp_size
        start, end = stage_layers(num_layers, size)[stage]
        return cls(stage, size, start, end, group, tp_size, tp_rank)

    def world_rank(self, stage: int) -> int:
        """The rank of `stage` that this one hands over to / receives from (the same tensor-parallel rank)."""
        return stage * self.tp_size + self.tp_rank

    @property
    def members(self) -> list[int]:
        """This stage's ranks (its tensor-parallel subgroup)."""
        return [self.world_rank(self.rank) + r - self.tp_rank for r in range(self.tp_size)]

    @property
    def first(self) -> bool:
        return self.rank == 0

    def owns(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def local(self, name: str) -> "str | None":
        """A checkpoint name with its decoder-layer index made local ("layers.12.x" -> "layers.2.x" on a rank that
        starts at 10); None for another rank's layer. Names outside the layers pass unchanged."""
        if not name.startswith("layers."):
            return name
        idx, _, rest = name[len("layers."):].partition(".")
        i = int(idx)
        return f"layers.{i - self.start}.{rest}" if self.owns(i) else None

    def receive(self, input_ids: torch.Tensor, hidden: int, dtype: torch.dtype,
                aux: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A later stage's input, in place of the embeddings of `input_ids`: the previous rank's hidden states (in
        the model's dtype) and residual stream (in residual_stream's dtype). aux: the model's AuxHiddenCapture
        buffer (a drafter reads several layers' outputs), whose step rows the earlier stages filled so far come too."""
        from voltllm.model.models.llama import residual_stream

        tokens, device = input_ids.shape[0], input_ids.device
        x = torch.empty(tokens, hidden, dtype=dtype, device=device)
        residual = torch.empty(tokens, hidden, dtype=residual_stream(x[:0]).dtype, device=device)
        src = self.world_rank(self.rank - 1)
        self.group.recv_(x, src)
        self.group.recv_(residual, src)
        if aux is not None:
            self.group.recv_(aux[:tokens], src)
        return x, residual

    def pass_on(self, x: torch.Tensor, residual: torch.Tensor,
                aux: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """After this rank's layers: send them on (the last rank sends back to rank 0). Rank 0 then waits for the last
        rank's output, which it returns; the others return theirs (their final norm's result is not used). aux: as
        in receive, its step rows sent on with this stage's layers' columns added (and back on rank 0, every
        stage's)."""
        x, residual = x.contiguous(), residual.contiguous()
        dst = self.world_rank((self.rank + 1) % self.size)
        rows = None if aux is None else aux[:x.shape[0]]  # (leading rows of a contiguous buffer: contiguous)
        self.group.send_(x, dst)
        self.group.send_(residual, dst)
        if rows is not None:
            self.group.send_(rows, dst)
        if not self.first:
            return x, residual
        last = self.world_rank(self.size - 1)
        out_x, out_res = torch.empty_like(x), torch.empty_like(residual)
        self.group.recv_(out_x, last)
        self.group.recv_(out_res, last)
        if rows is not None:
            self.group.recv_(rows, last)
        return out_x, out_res

    def receive_stream(self, input_ids: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """receive for a model whose residual stream is one tensor [tokens, width] (Qwen4-Exp's hyper-connection
        streams, hc * hidden wide): the previous rank's."""
        h = torch.empty(input_ids.shape[0], width, dtype=dtype, device=input_ids.device)
        self.group.recv_(h, self.world_rank(self.rank - 1))
        return h

    def pass_on_stream(self, h: torch.Tensor) -> torch.Tensor:
        """pass_on for a one-tensor residual stream: sent on; rank 0 then returns the last rank's (the others
        their own)."""
        h = h.contiguous()
        self.group.send_(h, self.world_rank((self.rank + 1) % self.size))
        if not self.first:
            return h
        out = torch.empty_like(h)
        self.group.recv_(out, self.world_rank(self.size - 1))
        return out
