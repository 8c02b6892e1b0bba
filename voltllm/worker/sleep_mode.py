"""Sleep mode (--enable-sleep-mode, vLLM's): free the device memory of the weights and the KV cache between uses.

sleep(1) copies the weights to CPU memory and discards the KV cache; sleep(2) discards the model's parameters too
(its buffers, e.g. rotary tables and KV scales, and the vision tower are copied, as vLLM keeps the buffers) and
wake_up reloads them from the checkpoint (vLLM leaves that to the caller's reload_weights). wake_up(tags) restores
"weights", "kv_cache" or both (None).

Freeing works on storages, not tensors: each storage is resized to 0 bytes and back, so every tensor and view that
shares it (tied embeddings, a state cache's per-layer rows) stays the same Python object and sees the restored bytes.
The data pointers change, so the CUDA graphs (which recorded them) are dropped at sleep and captured again once both
tags are awake. The engine (EngineCore) first ends or aborts its requests and forgets its cached prefixes: the KV
cache's contents are gone, and its blocks are all free.

Under tensor / pipeline parallelism every rank has a RunnerSleep of its own, whose wake-up phases (wake_tag, undo_tag,
commit_tag, finish_wake) distributed/sleep.py runs on all ranks together.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Optional, Sequence

import torch

logger = logging.getLogger("voltllm")

SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")


def sleep_mode_refusal(config: Any) -> Optional[str]:
    """Why --enable-sleep-mode cannot run with this configuration (None: it can)."""
    if config.weight_offload is not None:
        return ("not built with weight offloading (--cpu-offload-gb / --offload-group-size): its layers live in CPU "
                "memory")
    spec = config.speculative
    if spec is not None and (spec.uses_draft_model or spec.uses_mtp or spec.uses_dflash or spec.uses_eagle3
                             or spec.uses_eagle1):
        return ("not built with a drafter's own weights and KV cache (draft model, MTP, DFlash, EAGLE-1 / 3); ngram "
                "and suffix speculation run with it")
    return None


def check_level(level: Any) -> int:
    if isinstance(level, bool) or not isinstance(level, int) or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 (weights to CPU memory, KV cache discarded) or 2 (weights and KV "
                         f"cache discarded, weights reloaded from the checkpoint at wake-up), got {level!r}")
    return level


def check_tags(tags: Optional[Sequence[str]]) -> tuple[str, ...]:
    """wake_up's tags: None is every tag; otherwise a non-empty list of SLEEP_TAGS."""
    if tags is None:
        return SLEEP_TAGS
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not tags:
        raise ValueError(f"wake_up tags must be None (all) or a non-empty list of {list(SLEEP_TAGS)}, got {tags!r}")
    bad = [t for t in tags if t not in SLEEP_TAGS]
    if bad:
        raise ValueError(f"unknown wake_up tag {bad[0]!r}: the tags are {list(SLEEP_TAGS)}")
    return tuple(t for t in SLEEP_TAGS if t in tags)


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind `tensors` (tied weights and views share one)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        out.append(s)
    return out


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Freed:
    """One storage whose device memory is to be released: its size, and its bytes kept in CPU memory (None:
    discarded). Made for every storage first (the copies taken), released only then: a sleep that fails half-way
    (host memory runs out) leaves every weight where it was."""

    __slots__ = ("storage", "nbytes", "host")

    def __init__(self, storage: torch.UntypedStorage, keep: bool):
        if not storage.resizable():
            raise RuntimeError("a weight or KV tensor's memory cannot be released (its storage is not resizable)")
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.host = None
        if keep:
            pin = storage.device.type == "cuda"
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
            self.host.copy_(_bytes_of(storage))

    def release(self) -> None:
        self.storage.resize_(0)

    def restore(self) -> None:
        self.storage.resize_(self.nbytes)
        view = _bytes_of(self.storage)
        if self.host is not None:
            view.copy_(self.host)
        else:
            view.zero_()  # (the KV cache and recurrent states start as zeros, as make_kv_cache / StateCache make them)

    def release_again(self) -> None:
        """Undo restore() after a later storage of its tag failed to come back (its host copy, if any, is still
        kept: _restore_all drops the copies only once the whole tag is back)."""
        self.storage.resize_(0)


class RunnerSleep:
    """A ModelRunner's sleep state: what each tag released, and how to bring it back."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.level: Optional[int] = None
        self.asleep: set[str] = set()
        self._freed: dict[str, list[_Freed]] = {}
        self._reload: list[torch.nn.Parameter] = []  # level 2: parameters refilled from the checkpoint at wake-up
        self._graph_replays = (0, 0)  # decode / prompt graph replays before sleep (the acceleration counters)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    # -- what each tag holds ----------------------------------------------------------------------
    def _weight_tensors(self, level: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors copied to CPU memory, tensors discarded): level 1 copies everything; level 2 discards the
        language model's parameters, which the checkpoint reloads, and copies its buffers and the vision tower."""
        model = self.runner.model
        params = list(model.parameters())
        kept = list(model.buffers())
        tower = getattr(self.runner.image_step, "tower", None) if self.runner.image_step is not None else None
        if tower is not None:
            kept += list(tower.parameters()) + list(tower.buffers())
        if level == 1:
            return params + kept, []
        return kept, params

    def _kv_tensors(self) -> list[torch.Tensor]:
        r = self.runner
        tensors = list(r.kv_caches)
        for cache in (r.state_cache, getattr(r.state_snapshots, "store", None)):
            if cache is not None:  # (a hybrid's recurrent states: per-layer rows are views of these)
                tensors += list(cache.tensors)
        return tensors

    # -- sleep / wake ----------------------------------------------------------------------------
    def check(self, level: int) -> None:
        """ValueError for a level this engine cannot sleep at (before the engine aborts anything for it)."""
        check_level(level)
        if level == 2 and getattr(self.runner, "keep_quantized", False):
            raise ValueError("sleep level 2 reloads the weights from the checkpoint, which is built for dense weights "
                             "only; weights kept quantized sleep at level 1 (copied to CPU memory)")

    def sleep(self, level: int) -> None:
        """Release the weights' and the KV cache's device memory. The engine has no request running."""
        self.check(level)
        if self.is_sleeping:
            logger.warning("sleep(level=%d): the engine is already sleeping (level %s); nothing changes", level,
                           self.level)
            return
        t0 = time.monotonic()
        before = _device_used(self.runner.device)
        self._sync()
        kept, discarded = self._weight_tensors(level)
        # views of a discarded storage must not also be copied (a buffer aliasing a parameter): discard wins
        discarded_storages = _unique_storages(discarded)
        gone = {s.data_ptr() for s in discarded_storages}
        kept_storages = [s for s in _unique_storages(kept) if s.data_ptr() not in gone]
        try:  # every copy taken before anything is released
            freed = {"weights": ([_Freed(s, keep=True) for s in kept_storages]
                                 + [_Freed(s, keep=False) for s in discarded_storages]),
                     "kv_cache": [_Freed(s, keep=False) for s in _unique_storages(self._kv_tensors())]}
        except (torch.OutOfMemoryError, RuntimeError) as e:  # (pinned or plain host memory ran out)
            raise RuntimeError(f"sleep level {level} failed before releasing anything, the engine stays awake: "
                               f"{type(e).__name__}: {e}") from None
        graphs, prompt = self.runner.graphs, self.runner.prompt_graphs
        self._graph_replays = (int(getattr(graphs, "replays", 0) or 0), int(getattr(prompt, "replays", 0) or 0))
        self.runner.drop_cuda_graphs()  # (they recorded the addresses about to be released)
        for f in (*freed["weights"], *freed["kv_cache"]):
            f.release()
        self._freed = freed
        self._reload = [p for p in self.runner.model.parameters()] if level == 2 else []
        self.level = level
        self.asleep = set(SLEEP_TAGS)
        self._empty_cache()
        logger.info("sleep level %d: freed %.2f GiB of %s memory in %.2f s (weights %s, KV cache discarded)", level,
                    max(before - _device_used(self.runner.device), 0) / 2**30, self.runner.device.type,
                    time.monotonic() - t0, "in CPU memory" if level == 1 else "discarded")

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        tags = check_tags(tags)
        if not self.is_sleeping:
            logger.warning("wake_up: the engine is not sleeping")
            return
        t0 = time.monotonic()
        for tag in self.tags_to_wake(tags):
            self.wake_tag(tag)
            self.commit_tag(tag)
        self.finish_wake()
        self.log_woken(tags, t0)

    # wake_up's phases, which distributed/sleep.py runs on every rank of a group: restore a tag everywhere, then
    # commit it (or undo it where it came back, should it fail on any rank), then capture the graphs together
    def tags_to_wake(self, tags: Sequence[str]) -> list[str]:
        for tag in tags:
            if tag not in self.asleep:
                logger.warning("wake_up(tags=[%r]): that part is awake already", tag)
        return [tag for tag in tags if tag in self.asleep]

    def wake_tag(self, tag: str) -> None:
        """The tag's storages back on the device (level 2's weights reloaded); it stays asleep until commit_tag.
        RuntimeError (out of memory, a reload that left parameters unwritten): its storages are released again."""
        self._restore_all(tag)
        if tag == "weights" and self._reload:
            try:
                self._reload_weights()
            except BaseException:
                self.undo_tag(tag)
                raise

    def undo_tag(self, tag: str) -> None:
        """Release a tag that wake_tag restored here but another rank could not (level 1's CPU copies are kept until
        commit_tag, level 2's weights are reloaded again at the next wake_tag)."""
        if tag not in self.asleep:
            return
        for f in self._freed[tag]:
            f.release_again()
        self._empty_cache()

    def commit_tag(self, tag: str) -> None:
        """The tag is awake (on every rank): its CPU copies go."""
        for f in self._freed.get(tag, []):
            f.host = None
        if tag == "weights":
            self._reload = []
        self.asleep.discard(tag)

    def finish_wake(self) -> None:
        """Once no tag sleeps: capture the CUDA graphs again (under a group every rank at once: captures hold
        collectives), their replay counts carried over."""
        if self.asleep or self.level is None:
            return
        self._freed.clear()
        self.level = None
        self.runner.capture_cuda_graphs()
        graphs, prompt = self.runner.graphs, self.runner.prompt_graphs
        if graphs is not None:  # (the acceleration report counts replays since start-up)
            graphs.replays = int(getattr(graphs, "replays", 0) or 0) + self._graph_replays[0]
        if prompt is not None:
            prompt.replays = int(getattr(prompt, "replays", 0) or 0) + self._graph_replays[1]

    def log_woken(self, tags: Sequence[str], t0: float) -> None:
        logger.info("woke %s in %.2f s%s", " and ".join(tags), time.monotonic() - t0,
                    "" if not self.asleep else f" ({' and '.join(sorted(self.asleep))} still asleep)")

    def _restore_all(self, tag: str) -> None:
        """Every storage of `tag` back on the device, or none (an out-of-memory error leaves the tag asleep)."""
        done: list[_Freed] = []
        try:
            for f in self._freed[tag]:
                f.restore()
                done.append(f)
        except torch.OutOfMemoryError:
            for f in done:
                f.release_again()
            self._empty_cache()
            raise RuntimeError(f"not enough {self.runner.device} memory to wake up the {tag}: free memory there "
                               "(whatever used it while the engine slept) and call wake_up again") from None

    def _reload_weights(self) -> None:
        """Level 2: the parameters from the checkpoint (or --load-format dummy's seeded random values), into the
        storages restored above; a parameter the load leaves unwritten is an error, not silent garbage."""
        runner = self.runner
        t0 = time.monotonic()
        with torch.no_grad():
            floats = [p for p in self._reload if p.is_floating_point()]
            for p in floats:
                p.fill_(float("nan"))
            try:
                runner.reload_weights()
            except Exception as e:  # noqa: BLE001 - an unreadable checkpoint: the weights stay asleep, retry later
                raise RuntimeError(f"sleep level 2: reloading the weights from the checkpoint failed "
                                   f"({type(e).__name__}: {e}); they stay asleep: fix the checkpoint and call wake_up "
                                   "again") from e
            missed = [n for n, p in runner.model.named_parameters() if p.is_floating_point() and p.isnan().any()]
        if missed:
            raise RuntimeError(f"sleep level 2: the checkpoint reload left parameters unwritten, e.g. {missed[:3]}; "
                               "this model sleeps at level 1 only")
        logger.info("reloaded the weights from the checkpoint in %.1f s", time.monotonic() - t0)

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _empty_cache(self) -> None:
        """Hand the released blocks back to the driver, so other processes can use them."""
        if self.runner.device.type == "cuda":
            import gc

            gc.collect()  # (the dropped graphs' memory pools go with their last reference)
            torch.cuda.synchronize(self.runner.device)
            torch.cuda.empty_cache()


def _device_used(device: torch.device) -> int:
    """Bytes the device's allocator holds for this process (0 on the CPU: nothing to measure)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_reserved(device)
