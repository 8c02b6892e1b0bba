"""A consumer's side of --kv-events-config's stream, for the KV-event tests: vLLM's wire decoding and replay client."""
from __future__ import annotations

import msgspec
import zmq

from voltllm.cache.kv_events import KVEventBatch

END = (-1).to_bytes(8, "big", signed=True)  # the replay answer's last sequence number
DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode


def replay(ctx: zmq.Context, endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """(sequence number, payload) of every buffered batch from `start` on, as the ROUTER answers a replay request,
    checking the frames' layout and the end marker."""
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(endpoint)
    client.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        assert client.poll(5000), "no replay answer"
        empty, seq, payload = client.recv_multipart()
        assert empty == b""
        if seq == END:
            assert payload == b""
            client.close()
            return got
        got.append((int.from_bytes(seq, "big"), payload))
