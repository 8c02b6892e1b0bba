"""Functions a test runs inside tensor / pipeline-parallel workers (TPWorkers.call_on_workers(fn, *args) calls
fn(runner, *args) on every worker; fn is pickled by name, so it lives in a module the workers can import)."""
from __future__ import annotations

import torch


def rank(runner) -> int:
    return runner.group.rank


def weight_bytes(runner) -> int:
    """Bytes of device memory behind the model's parameters on this rank (0: released)."""
    return sum(p.untyped_storage().nbytes() for p in runner.model.parameters())


def kv_bytes(runner) -> int:
    """Bytes behind the KV cache and a hybrid's recurrent-state slots and snapshots on this rank."""
    tensors = list(runner.kv_caches)
    for cache in (runner.state_cache, getattr(runner.state_snapshots, "store", None)):
        if cache is not None:
            tensors += [cache._conv_all, cache._ssm_all]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def scale_weights(runner, factor: float, only_rank: int = -1) -> None:
    """Multiply this rank's floating parameters by factor (only on only_rank, or every worker for -1)."""
    if only_rank >= 0 and runner.group.rank != only_rank:
        return
    with torch.no_grad():
        for p in runner.model.parameters():
            if p.is_floating_point():
                p.mul_(factor)


def fail_next_restore(runner, only_rank: int) -> None:
    """The next storage this rank restores at wake-up raises out of memory (once), as a full GPU would."""
    if runner.group.rank != only_rank:
        return
    from voltllm.worker import sleep_mode

    real = sleep_mode._Freed.restore

    def restore(self):
        sleep_mode._Freed.restore = real
        raise torch.OutOfMemoryError("injected: out of memory")

    sleep_mode._Freed.restore = restore
