"""--kv-events-config (vLLM's KV cache events over ZeroMQ) without a model: the config's checks and endpoint rules, the
events the block pool and the CPU tier record for what they really do, and the publisher's wire format, replay,
flush at close, data-parallel offsets and bind failures. Events are decoded with msgspec as consumers decode them."""
from __future__ import annotations

import socket
import sys
import threading

import pytest
import zmq

from kv_event_clients import DECODE, replay
from voltllm.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder
from voltllm.cache.kv_manager import KVCacheManager
from voltllm.config import ConfigError
from voltllm.engine.kv_event_publisher import KVEventPublisher
from voltllm.engine.request import Request
from voltllm.engine.types import EngineCoreRequest
from voltllm.kv_events_config import KVEventsConfig, endpoint_binds, offset_endpoint, resolve_kv_events
from voltllm.lora.request import LoRARequest
from voltllm.sampling.params import SamplingParams



# -- the config ----------------------------------------------------------------------------------------------------
def test_vllms_keys_and_defaults():
    cfg = resolve_kv_events({"enable_kv_cache_events": True})
    assert cfg == KVEventsConfig(True, "zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert resolve_kv_events('{"enable_kv_cache_events": true, "topic": "kv", "replay_endpoint": "tcp://*:5558"}'
                             ).replay_endpoint == "tcp://*:5558"
    assert resolve_kv_events(cfg) == cfg  # (LLM(kv_events_config=KVEventsConfig(...)))
    # off: nothing to publish, so no config (no socket, nothing collected)
    for off in (None, {}, {"enable_kv_cache_events": False, "publisher": "zmq"},
                {"enable_kv_cache_events": True, "publisher": "null"}):
        assert resolve_kv_events(off) is None


@pytest.mark.parametrize("value,message", [
    ({"enable_kv_cache_events": True, "bogus": 1}, "unknown keys ['bogus']"),
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher 'kafka': use \"zmq\""),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be true or false"),
    ({"enable_kv_cache_events": True, "endpoint": "http://x:1"}, "not a ZeroMQ endpoint"),
    ({"enable_kv_cache_events": True, "endpoint": "tcp://*"}, "needs a host (or *) and a port"),
    ({"enable_kv_cache_events": True, "endpoint": "tcp://*:0"}, "needs a host (or *) and a port"),
    ({"enable_kv_cache_events": True, "endpoint": "ipc://"}, "not a ZeroMQ endpoint"),
    ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:99999"}, "replay_endpoint 'tcp://*:99999'"),
    ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5557"}, "must differ from endpoint"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps must be an integer >= 1"),
    ({"enable_kv_cache_events": True, "hwm": -1}, "hwm must be an integer >= 0"),
    ({"enable_kv_cache_events": True, "max_queue_size": 1.5}, "max_queue_size must be an integer >= 1"),
    ({"enable_kv_cache_events": True, "topic": 3}, "topic must be a string"),
    ("[1]", "must be a JSON object, got list"),
    ("{", "must be a JSON object:"),
])
def test_bad_configs_are_refused_by_name(value, message):
    with pytest.raises(ConfigError, match="--kv-events-config") as e:
        resolve_kv_events(value)
    assert message in str(e.value)


def test_without_msgspec_the_refusal_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "msgspec", None)  # (import msgspec raises ImportError)
    with pytest.raises(ConfigError, match="needs the msgspec package.*pip install msgspec"):
        resolve_kv_events({"enable_kv_cache_events": True})
    assert resolve_kv_events({"enable_kv_cache_events": False}) is None  # (off: not needed)


def test_endpoint_rules():
    assert endpoint_binds("tcp://*:5557") and endpoint_binds("tcp://[::]:5557") and endpoint_binds("ipc:///t/x")
    assert endpoint_binds("inproc://ev") and not endpoint_binds("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_dp1"
    assert offset_endpoint("inproc://ev", 3) == "inproc://ev_dp3"
    # every data-parallel engine's port must exist
    assert resolve_kv_events({"enable_kv_cache_events": True, "endpoint": "tcp://*:65534"}, 2) is not None
    with pytest.raises(ConfigError, match="tcp://\\*:65536"):
        resolve_kv_events({"enable_kv_cache_events": True, "endpoint": "tcp://*:65535"}, 2)


def test_the_cli_refuses_a_bad_config_with_exit_2(capsys):
    from voltllm.cli import main

    assert main(["serve", "/nonexistent", "--kv-events-config", '{"enable_kv_cache_events": true, "hwm": "x"}']) == 2
    err = capsys.readouterr().err
    assert "voltllm: error: --kv-events-config hwm must be an integer >= 0" in err and "Traceback" not in err
    assert main(["serve", "/nonexistent", "--kv-events-config.enable_kv_cache_events", "true",
                 "--kv-events-config.publisher", "kafka"]) == 2  # (vLLM's dotted form)
    assert "--kv-events-config publisher 'kafka'" in capsys.readouterr().err
    # a good one is taken: the command gets as far as looking for the model
    assert main(["serve", "/nonexistent", "--kv-events-config", '{"enable_kv_cache_events": true}']) == 2
    assert "model '/nonexistent' not found" in capsys.readouterr().err


# -- what the pool records -----------------------------------------------------------------------------------------
def _req(rid, tokens, lora=None):
    return Request(EngineCoreRequest(rid, list(tokens), SamplingParams(max_tokens=4, ignore_eos=True),
                                     lora_request=lora), 512)


def _admit(kv, req):
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens


def _recording(num_blocks, block_size=4, cpu_blocks=0):
    kv = KVCacheManager(num_blocks, block_size, cpu_blocks=cpu_blocks)
    rec = KVEventRecorder(block_size)
    kv.record_events(rec)
    return kv, rec


def test_stored_blocks_carry_their_chain_and_tokens():
    kv, rec = _recording(16)
    a = _req("a", range(100, 117))  # 4 full blocks + 1 token
    _admit(kv, a)
    (ev,) = rec.take()
    assert ev == BlockStored(a.block_hashes[:4], None, list(range(100, 116)), 4, None, "GPU")
    b = _req("b", list(range(100, 108)) + list(range(300, 309)))  # a's first 2 blocks, then its own 2
    _admit(kv, b)
    (ev,) = rec.take()  # (the 2 hits entered nothing)
    assert ev.block_hashes == b.block_hashes[2:4] and ev.parent_block_hash == a.block_hashes[1]
    assert ev.token_ids == list(range(300, 308))
    # the same prompt allocated without a lookup: its blocks duplicate cached ones and stay private, no event
    twin = _req("twin", range(100, 117))
    assert kv.allocate_slots(twin, twin.num_tokens) is not None
    assert rec.take() == []
    lora = _req("l", range(500, 508), lora=LoRARequest("x", 7, "/adapters/x"))
    _admit(kv, lora)
    assert [e.lora_id for e in rec.take()] == [7]
    kv.check_integrity()


def test_evictions_and_resets_are_what_the_hash_map_lost():
    kv, rec = _recording(8)
    a, b = _req("a", range(100, 117)), _req("b", range(200, 209))
    for r in (a, b):
        _admit(kv, r)
    rec.take()
    kv.free(a)
    kv.free(b)
    c = _req("c", range(400, 425))  # 7 blocks: every free one but one, evicting cached ones least recently freed first
    cached_before = set(kv.pool.cached)
    _admit(kv, c)
    removed, stored = rec.take()
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"  # (one event for the allocation's run)
    assert set(removed.block_hashes) == cached_before - set(kv.pool.cached)
    assert len(removed.block_hashes) == 5 and stored.block_hashes == c.block_hashes[:6]
    assert kv.pool.reset_prefix_cache() is False and rec.take() == []  # (c holds blocks: nothing changed)
    kv.free(c)
    assert kv.pool.reset_prefix_cache() is True
    assert rec.take() == [AllBlocksCleared()]


def test_the_cpu_tier_reports_its_blocks_as_medium_cpu():
    kv, rec = _recording(6, cpu_blocks=2)
    a = _req("a", range(100, 113))  # 3 full blocks + 1 token
    _admit(kv, a)
    kv.free(a)
    rec.take()
    b = _req("b", range(200, 221))  # 6 blocks: a's 3 are evicted, saved to a 2-slot tier (the first saved is dropped)
    _admit(kv, b)
    kv.take_transfers()
    cpu_view: set = set()
    for e in rec.take():
        if e.medium == "CPU":
            if isinstance(e, BlockStored):
                assert e.parent_block_hash is None and e.token_ids == []  # (as vLLM's offloading tier reports them)
                cpu_view |= set(e.block_hashes)
            else:
                cpu_view -= set(e.block_hashes)
    assert len(cpu_view) == len(kv.cpu) == 2 and all(h in kv.cpu for h in cpu_view)
    kv.free(b)
    kv.reset_cpu_tier()
    (ev,) = rec.take()
    assert isinstance(ev, BlockRemoved) and ev.medium == "CPU" and set(ev.block_hashes) == cpu_view


def test_without_a_recorder_nothing_is_recorded():
    kv = KVCacheManager(8, 4, cpu_blocks=2)
    assert kv.pool.events is None and kv.cpu.events is None
    _admit(kv, _req("a", range(100, 117)))
    kv.check_integrity()


# -- the publisher -------------------------------------------------------------------------------------------------
def _config(tmp_path, **kw):
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/ev",
                          replay_endpoint=f"ipc://{tmp_path}/replay", **kw)


def _subscribe(ctx, endpoint, publisher, topic=b""):
    """A SUB socket that receives everything published after this returns (ZeroMQ's slow joiner: probe batches go
    out until one arrives; they are drained)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    while True:
        publisher.publish([AllBlocksCleared()])
        if sub.poll(50):
            break
    while int.from_bytes(sub.recv_multipart()[1], "big") < publisher.num_batches - 1:
        assert sub.poll(5000)
    return sub


def test_batches_go_out_as_three_frames_andreplay(tmp_path):
    ctx = zmq.Context()
    pub = KVEventPublisher(_config(tmp_path, topic="kv", buffer_steps=4))
    try:
        sub = _subscribe(ctx, pub.endpoint, pub, b"kv")
        sent = [[BlockStored([bytes([i]) * 16], None, [i] * 4, 4, None, "GPU")] for i in range(3)]
        for events in sent:
            pub.publish(events)
        frames = [sub.recv_multipart() for _ in sent]
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert all(f[0] == b"kv" and len(f[1]) == 8 for f in frames) and seqs == list(range(seqs[0], seqs[0] + 3))
        for f, events in zip(frames, sent):
            batch = DECODE(f[2])
            assert batch.events == events and batch.data_parallel_rank == 0 and batch.ts > 0
        # replay: every kept batch from the asked sequence number on (buffer_steps = 4 kept), then the end marker
        assert replay(ctx, pub.replay_endpoint, seqs[1]) == [(s, f[2]) for s, f in zip(seqs[1:], frames[1:])]
        kept = replay(ctx, pub.replay_endpoint, 0)
        assert [s for s, _ in kept] == [seqs[0] - 1] + seqs and kept[-3:] == [(s, f[2]) for s, f in zip(seqs, frames)]
        assert replay(ctx, pub.replay_endpoint, seqs[-1] + 1) == []
        sub.close()
    finally:
        pub.close()
        ctx.term()


def test_close_flushes_what_is_queued_and_stops_the_thread(tmp_path):
    ctx = zmq.Context()
    pub = KVEventPublisher(_config(tmp_path))
    sub = _subscribe(ctx, pub.endpoint, pub)
    for i in range(50):
        pub.publish([BlockRemoved([bytes([i])], "GPU")])
    pub.close()
    assert not pub.running and not any(t.name.startswith("voltllm-kv-events") for t in threading.enumerate())
    got = []
    for _ in range(50):
        assert sub.poll(5000), "a batch queued before close() was lost"
        got.append(DECODE(sub.recv_multipart()[2]).events[0].block_hashes[0][0])
    assert got == list(range(50)) and not sub.poll(100)
    pub.close()  # (again: nothing)
    pub.publish([AllBlocksCleared()])  # (after close: dropped)
    again = KVEventPublisher(_config(tmp_path))  # the endpoints are free again
    again.close()
    sub.close()
    ctx.term()


def test_a_data_parallel_engine_publishes_on_its_offset_endpoints(tmp_path):
    ctx = zmq.Context()
    pub = KVEventPublisher(_config(tmp_path), data_parallel_rank=1)
    try:
        assert pub.endpoint == f"ipc://{tmp_path}/ev_dp1" and pub.replay_endpoint == f"ipc://{tmp_path}/replay_dp1"
        sub = _subscribe(ctx, pub.endpoint, pub)
        pub.publish([AllBlocksCleared()])
        assert DECODE(sub.recv_multipart()[2]).data_parallel_rank == 1
        sub.close()
    finally:
        pub.close()
    # a tcp address without a wildcard is connected to (vLLM's rule): a collector binds port + rank
    collector = ctx.socket(zmq.SUB)
    collector.setsockopt(zmq.LINGER, 0)
    port = collector.bind_to_random_port("tcp://127.0.0.1", min_port=20000)
    collector.setsockopt(zmq.SUBSCRIBE, b"")
    pub = KVEventPublisher(KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{port - 2}"), data_parallel_rank=2)
    try:
        while True:
            pub.publish([AllBlocksCleared()])
            if collector.poll(50):
                break
        assert DECODE(collector.recv_multipart()[2]).data_parallel_rank == 2
    finally:
        pub.close()
        collector.close()
        ctx.term()


def test_a_port_in_use_is_a_config_error_that_leaves_nothing_open(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/ev", f"tcp://127.0.0.1:{port}")
        with pytest.raises(ConfigError, match=f"--kv-events-config: cannot open tcp://127.0.0.1:{port}: "
                                              "Address already in use"):
            KVEventPublisher(cfg)
    assert not any(t.name.startswith("voltllm-kv-events") for t in threading.enumerate())
    KVEventPublisher(KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/ev")).close()  # (its PUB endpoint was released)
