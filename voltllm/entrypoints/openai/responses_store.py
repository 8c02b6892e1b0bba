"""The in-memory store behind `store` / `previous_response_id` / GET /v1/responses/{id}: the last `capacity`
stored responses (oldest dropped first), each with its conversation (input messages plus its output turned back
into chat messages, without its instructions: a follow-up brings its own, as in OpenAI's API). Lost on restart."""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Optional

DEFAULT_CAPACITY = 1000


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, response: dict, conversation: Optional[list[dict]]) -> None:
        """conversation None: the response cannot be continued (yet): a background response still running, or one
        that was cancelled or failed."""
        with self._lock:
            self._items[response_id] = (copy.deepcopy(response), copy.deepcopy(conversation))
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def response(self, response_id: str) -> Optional[dict]:
        with self._lock:
            got = self._items.get(response_id)
        return copy.deepcopy(got[0]) if got else None

    def conversation(self, response_id: str) -> Optional[list[dict]]:
        with self._lock:
            got = self._items.get(response_id)
        return copy.deepcopy(got[1]) if got and got[1] is not None else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
