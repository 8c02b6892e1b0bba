"""Publishes the engine's KV cache event batches over ZeroMQ (vLLM's `zmq` publisher of `--kv-events-config`).

A thread of its own owns the sockets (opened in the constructor, so a bind failure is the caller's error, then
handed over): each batch goes out on the PUB socket as three frames, (topic, 8-byte big-endian sequence number
from 0, msgpack payload), and is kept, up to buffer_steps batches, for replay. With a replay endpoint a ROUTER
socket answers a request (its last frame: the first wanted sequence number, 8 bytes big-endian; a REQ or DEALER
client) with (identity, b"", seq, payload) for every kept batch from there on, then (identity, b"", -1 as 8 signed
bytes, b"") to end. The engine's step only puts the batch on a queue (max_queue_size; beyond it batches are dropped
with a warning, so a stuck consumer never stalls the engine).

close() lets the thread send what is queued, gives the PUB socket a short linger to flush it, closes both sockets
and waits for the thread.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from voltllm.config import ConfigError
from voltllm.kv_events_config import KVEventsConfig, endpoint_binds, offset_endpoint

logger = logging.getLogger("voltllm")

FLUSH_MS = 500  # how long closing waits for queued messages to reach subscribers
_POLL_S = 0.05  # the thread's wait for a batch, between looks at the replay socket
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import msgspec
        import zmq

        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = (offset_endpoint(config.replay_endpoint, data_parallel_rank)
                                if config.replay_endpoint else None)
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        # an inproc endpoint is reachable only through the process's shared context; other endpoints get a context of
        # their own, ended at close (nothing of it outlives the engine)
        inproc = any(e and e.startswith("inproc://") for e in (self.endpoint, self.replay_endpoint))
        self._ctx = zmq.Context.instance() if inproc else zmq.Context()
        self._owns_ctx = not inproc
        self._pub = self._replay = None
        try:
            # (options before bind / connect: a connection's queue takes the high-water mark it finds)
            self._pub = self._open(zmq.PUB, self.endpoint, endpoint_binds(self.endpoint),
                                   {zmq.SNDHWM: config.hwm, zmq.LINGER: FLUSH_MS})
            if self.replay_endpoint is not None:
                self._replay = self._open(zmq.ROUTER, self.replay_endpoint, True, {zmq.LINGER: 0})
        except zmq.ZMQError as e:
            self._close_sockets()
            failed = self.endpoint if self._pub is None else self.replay_endpoint
            raise ConfigError(f"--kv-events-config: cannot open {failed}: {e.strerror}") from None
        self._encode = msgspec.msgpack.Encoder().encode
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._closed = False
        self.num_batches = 0  # batches taken (numbered 0, 1, ... in this order)
        self.dropped = 0  # batches the full queue turned away
        self._thread = threading.Thread(target=self._run, name=f"voltllm-kv-events-{data_parallel_rank}",
                                        daemon=True)
        self._thread.start()
        logger.info("KV cache events: publishing on %s%s", self.endpoint,
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def _open(self, kind: int, endpoint: str, bind: bool, options: dict) -> Any:
        import zmq

        sock = self._ctx.socket(kind)
        try:
            for option, value in options.items():
                sock.setsockopt(option, value)
            if "[" in endpoint:  # an IPv6 address
                sock.setsockopt(zmq.IPV6, 1)
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(0)
            raise
        return sock

    def publish(self, events: list) -> None:
        """One engine step's events as a batch (never blocks the engine: a full queue drops it)."""
        if self._closed:
            return
        from voltllm.cache.kv_events import KVEventBatch

        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events,
                                                data_parallel_rank=self.data_parallel_rank))
            self.num_batches += 1
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("KV cache events: the publisher's queue is full (max_queue_size); batches are dropped "
                               "(sequence numbers stay contiguous over the ones sent)")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, flush briefly, close the sockets and end the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV cache events: the publisher thread did not stop within %.1f s", timeout)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    continue
                self._send(batch)
        except Exception:  # noqa: BLE001 -- a publisher failure must not take the engine down
            logger.exception("KV cache events: the publisher thread failed; no more events are published")
        finally:
            self._close_sockets()

    def _send(self, batch: Any) -> None:
        payload = self._encode(batch)
        seq = next(self._seq)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        import zmq

        while self._replay.poll(0, zmq.POLLIN):
            frames = self._replay.recv_multipart()
            identity, start = frames[0], frames[-1]
            if len(frames) >= 2 and len(start) == 8 and self._buffer:
                first = int.from_bytes(start, "big")
                skip = max(0, first - self._buffer[0][0])  # (the kept sequence numbers are contiguous)
                for seq, payload in itertools.islice(self._buffer, skip, None):
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            elif len(frames) < 2 or len(start) != 8:
                logger.debug("KV cache events: a replay request without an 8-byte start sequence number")
            self._replay.send_multipart((identity, b"", _END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()  # (the PUB socket lingers FLUSH_MS for what is queued)
        if self._owns_ctx:
            self._ctx.term()
