"""Sleep mode under tensor and pipeline parallelism: every rank frees and restores its own weights (its shard, its
stage) and KV cache. Rank 0 runs each phase of worker/sleep_mode.py's RunnerSleep on itself and, through a
("sleep_mode", method, args) message, on every worker at the same time:

- sleep(level): each rank drops its CUDA graphs and releases its storages (no collectives).
- wake_up(tags), for each tag still asleep: wake_tag everywhere (storages back, level 2 reloads this rank's own shard
  / stage from the checkpoint: no collectives). If it failed on any rank (out of memory there), undo_tag everywhere
  releases it again where it came back, and the first rank's message is raised: the tag sleeps on every rank, and a
  later wake_up retries it. Otherwise commit_tag everywhere (the CPU copies go).
- Once no tag sleeps: finish_wake everywhere, which captures the CUDA graphs again. The captures hold collectives,
  so the workers are sent the message before rank 0 captures, as at start-up (worker.py's capture, then "ready").

Rank 0 waits for every worker's answer after each phase, so a worker's failure is its error in the engine, never a
hang: a wake-up out of memory is a RuntimeError the engine survives; anything else ends the worker and is its
TPWorkerError (the engine cannot step afterwards, as after a failed step).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

from voltllm.worker.sleep_mode import check_tags

logger = logging.getLogger("voltllm")

# the RunnerSleep methods a worker runs for rank 0
WORKER_PHASES = ("sleep", "wake_tag", "undo_tag", "commit_tag", "finish_wake")


class GroupSleep:
    """EngineCore's sleep state under a group: RunnerSleep's interface, over rank 0's RunnerSleep and the workers."""

    def __init__(self, state: Any, workers: Any):
        self.state = state  # rank 0's RunnerSleep
        self.workers = workers  # distributed.executor.TPWorkers

    @property
    def is_sleeping(self) -> bool:
        return self.state.is_sleeping

    @property
    def level(self) -> Optional[int]:
        return self.state.level

    @property
    def asleep(self) -> set[str]:
        return self.state.asleep

    def check(self, level: int) -> None:
        self.state.check(level)  # (the ranks share the configuration: rank 0's answer is theirs)

    def sleep(self, level: int) -> None:
        self.state.check(level)
        if self.state.is_sleeping:
            self.state.sleep(level)  # (a warning: already asleep)
            return
        self._everywhere("sleep", level)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        tags = check_tags(tags)
        if not self.state.is_sleeping:
            logger.warning("wake_up: the engine is not sleeping")
            return
        t0 = time.monotonic()
        for tag in self.state.tags_to_wake(tags):
            errors = self._everywhere("wake_tag", tag, recoverable=True)
            failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
            if failed:
                self._everywhere("undo_tag", tag)
                rank, text = failed[0]
                raise RuntimeError(text if rank == 0 else f"rank {rank}: {text}")
            self._everywhere("commit_tag", tag)
        if not self.state.asleep:
            self._everywhere("finish_wake", collective=True)
        self.state.log_woken(tags, t0)

    def _everywhere(self, method: str, *args: Any, recoverable: bool = False,
                    collective: bool = False) -> list[Optional[str]]:
        """RunnerSleep.method(*args) on every rank: the workers are sent it first, then rank 0 runs it, then each
        worker's answer is awaited. Returns each rank's error message in rank order (None: done); an error is
        returned only for a recoverable phase (wake_tag), else raised. collective: the phase holds collectives, so
        a failure on rank 0 while the workers may wait inside them stops the group (as a failed step does)."""
        self.workers.send(("sleep_mode", method, args))
        mine: Optional[str] = None
        try:
            getattr(self.state, method)(*args)
        except RuntimeError as e:
            if not recoverable:
                self._fail(e, collective)
                raise
            mine = str(e)
        except BaseException as e:
            self._fail(e, collective)
            raise
        return [mine] + [m[0] for m in self.workers.collect("sleep_mode")]

    def _fail(self, e: BaseException, collective: bool) -> None:
        """Rank 0 failed in a phase the workers run too. collective: a worker's own failure (which may have caused
        it) is raised instead, else the workers, which may wait inside the phase's collectives, are stopped. Not
        collective: the workers' answers are taken (the pipes stay in step; a worker's error is raised instead)."""
        if not collective:
            self.workers.collect("sleep_mode")
            return
        err = self.workers.failure()
        if err is not None:
            raise err from e
        self.workers.abandon(e)
