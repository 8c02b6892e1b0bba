"""The collectives a tensor- or pipeline-parallel model and runner need, over one group of N ranks.

Two process groups share one TCP store: the device group (NCCL on CUDA, one GPU per rank; gloo on the CPU) carries
the model's all-reduces and gathers and the step's input ids, and a gloo group carries small host values (the KV
block count). They are ProcessGroup objects of their own, not torch.distributed's default group, so an engine holds
no process-wide state and a second engine in the same process (tests) cannot collide with the first.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# how long a rank waits for the others at start-up and in a collective; a dead peer is noticed sooner (gloo: the
# connection closes; NCCL: the executor's watchdog aborts the group)
TIMEOUT = datetime.timedelta(minutes=10)


def make_store(rank: int, size: int, port: int) -> dist.TCPStore:
    """Rank 0 serves the store (port 0: any free one, read back from .port); the others connect to it."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, wait_for_workers=False, timeout=TIMEOUT)


class TPGroup:
    """This rank's view of the tensor-parallel group."""

    def __init__(self, rank: int, size: int, store: dist.TCPStore, device: torch.device, prefix: str = ""):
        """prefix: the store keys' prefix of a subgroup's communicators (subgroup())."""
        self.rank = rank
        self.size = size
        self.device = device
        self.store = store  # kept alive: rank 0's store serves the others
        self.host = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "host", store), rank, size, TIMEOUT)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # NCCL >= 2.19 allocates through cuMem by default, which makes every all-reduce captured in the decode CUDA
            # graphs hold memory of its own (GiBs over ~20 graphs, nowhere in the KV budget); vLLM turns it off too.
            # A user's own setting is kept.
            os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = TIMEOUT
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore(prefix + "dev", store), rank, size, opts)
        else:
            self.dev = self.host

    def subgroup(self, members: list[int], name: str) -> "TPGroup":
        """A group of some of these ranks (this one among them), over the same store: a pipeline stage's
        tensor-parallel ranks. Only the members make it; `name` keeps its communicators apart from the others'."""
        return TPGroup(members.index(self.rank), len(members), self.store, self.device, prefix=f"{name}/")

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (a row-parallel projection's partial products)."""
        self.dev.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x side by side along the last dimension (vocabulary-parallel logits), on every rank."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.dev.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def gather_rows(self, x: torch.Tensor, dst: int = 0) -> "torch.Tensor | None":
        """The ranks' x stacked along the first dimension, rank order, on rank dst (None elsewhere): gathered into one
        tensor's row blocks, so the whole is never held twice (a drafter's copy of the vocabulary tables)."""
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = dst
        out = torch.empty((self.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device) \
            if self.rank == dst else None
        self.dev.gather([list(out.chunk(self.size))] if out is not None else [], [x], opts).wait()
        return out

    def broadcast_(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x from rank src on every rank, in place (contiguous)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.dev.broadcast([x], opts).wait()
        return x

    def send_(self, x: torch.Tensor, dst: int) -> None:
        """x to rank dst (pipeline parallelism's hand-over; the receiver posts a recv_ of the same shape)."""
        self.dev.send([x], dst, 0).wait()

    def recv_(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """x, in place, from rank src's send_."""
        self.dev.recv([x], src, 0).wait()
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (the KV block count every rank can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.host.allreduce([t], opts).wait()
        return int(t.item())

    def host_barrier(self) -> None:
        """Wait for every rank over the host (gloo) group. Before the first NCCL operation: NCCL makes its
        communicator there, lazily, and waits without limit for a peer that died while loading (there is nothing yet
        for abort() to cancel); gloo fails at once when a peer's connection is gone, so rank 0 reports the worker's
        own error instead of hanging."""
        self.host.barrier().wait()

    def abort(self) -> None:
        """Make collectives that wait on a dead peer fail (NCCL would wait out TIMEOUT); best effort."""
        for pg in {id(self.dev): self.dev, id(self.host): self.host}.values():
            fn = getattr(pg, "abort", None)
            if fn is not None:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - aborting a group that is already broken
                    pass


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU for every rank on the CPU; on CUDA the base device's index + r (one GPU per rank)."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)

