"""Background responses (`"background": true`, OpenAI's and vLLM's): POST /v1/responses answers at once with the
response `queued`; the generation runs on in this process, its stored copy going `in_progress` with the first
output and then `completed` / `incomplete` (or `failed`, with its error), so GET /v1/responses/{id} polls it.
POST /v1/responses/{id}/cancel stops it (`cancelled`: the engine request is aborted, its KV blocks freed); DELETE
/v1/responses/{id} removes a stored response and stops it if it still runs. A client that disconnects does not
stop a background response (it was asked to outlive the request)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from voltllm.engine.outputs import RequestOutput
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.responses_store import ResponseStore
from voltllm.entrypoints.openai.serving_common import engine_error, merge_streams

logger = logging.getLogger("voltllm")

RUNNING = ("queued", "in_progress")


class BackgroundRuns:
    """The background responses still running, by response id."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self._runs: dict[str, tuple[asyncio.Task, list]] = {}

    def start(self, base: dict, streams: list, finish: Callable[[RequestOutput], dict]) -> dict:
        """Store the response `queued` and run it on; `finish` turns the final output into the stored response."""
        rid = base["id"]
        queued = dict(base, status="queued")
        self.store.put(rid, queued, None)  # (no conversation to continue from until it completes)
        task = asyncio.ensure_future(self._run(queued, streams, finish))
        self._runs[rid] = (task, streams)
        task.add_done_callback(lambda _: self._runs.pop(rid, None))
        return queued

    async def _run(self, queued: dict, streams: list, finish: Callable[[RequestOutput], dict]) -> None:
        rid = queued["id"]
        final: Optional[RequestOutput] = None
        try:
            async for _, out in merge_streams(streams):
                if final is None:
                    self._update(rid, status="in_progress")
                final = out
            if final is None:
                raise OpenAIError("the request ended without output", 503, code="request_aborted")
            finish(final)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - kept in the stored response for the poller
            err = e if isinstance(e, OpenAIError) else engine_error(e)
            logger.warning("background response %s failed: %s", rid, err.message)
            self._update(rid, status="failed", error={"code": err.code or "server_error", "message": err.message})

    def _update(self, rid: str, **fields: Any) -> None:
        current = self.store.response(rid)
        if current is not None and current["status"] in RUNNING:  # (a cancel or delete may have come first)
            self.store.put(rid, dict(current, **fields), None)

    def cancel(self, rid: str) -> dict:
        """POST /v1/responses/{id}/cancel: the response, cancelled if it was still running (again: unchanged)."""
        current = self.store.response(rid)
        if current is None:
            raise OpenAIError(f"Response with id '{rid}' not found.", 404, "response_id", "not_found")
        if not current.get("background"):
            raise OpenAIError("Cannot cancel a synchronous response.", 400, "response_id")
        if current["status"] in RUNNING:
            self._stop(rid)
            current = dict(current, status="cancelled", completed_at=int(time.time()))
            self.store.put(rid, current, None)
        return current

    def delete(self, rid: str) -> dict:
        """DELETE /v1/responses/{id}: stop it if it runs, forget it."""
        self._stop(rid)
        if not self.store.delete(rid):
            raise OpenAIError(f"Response with id '{rid}' not found.", 404, "response_id", "not_found")
        return {"id": rid, "object": "response.deleted", "deleted": True}

    def _stop(self, rid: str) -> None:
        run = self._runs.pop(rid, None)
        if run is not None:
            task, streams = run
            task.cancel()
            for s in streams:
                s.close()  # aborts the engine request if it has not finished
