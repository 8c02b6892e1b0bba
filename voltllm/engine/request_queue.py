"""The scheduler's waiting queue under --scheduling-policy (vLLM's two policies).

fcfs: requests are admitted in arrival order; a preempted request goes back to the head of the queue.
priority: the lowest `Request.priority_key` (priority, arrival time, then creation order) is admitted first; a
preempted request goes back by its own key, so it keeps its place among the others.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Iterator, Union

from voltllm.config import SchedulingPolicy

if TYPE_CHECKING:
    from voltllm.engine.request import Request


class FcfsQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._queue.append(req)

    def requeue(self, req: Request) -> None:
        """A preempted request: it runs again before any request that has not run yet."""
        self._queue.appendleft(req)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, req: Request) -> bool:
        return req in self._queue

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """A heap of (priority_key, request); the keys are unique (creation order), so requests are never compared."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority_key, req))

    def requeue(self, req: Request) -> None:
        self.add(req)  # its own key, not the head: a higher-priority request that arrived meanwhile goes first

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, req: Request) -> bool:
        return any(entry[1] is req for entry in self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        return (req for _, req in sorted(self._heap, key=lambda entry: entry[0]))


def make_waiting_queue(policy: SchedulingPolicy) -> Union[FcfsQueue, PriorityQueue]:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
