"""--kv-events-config on a tiny random llama on the CPU: a subscriber's view of the prefix cache, built from the
published events alone, is the block pool's hash map after every request (stores with their prompt's own block
hashes, parents and tokens; evictions from a small pool; resets), and the CPU tier's with --kv-offloading-size; replay
returns the batches the live socket carried; a data-parallel engine publishes on its offset endpoint; off, no socket
is opened; bad configs and a port in use are ValueErrors before anything is left running."""
from __future__ import annotations

import random
import socket
import threading

import pytest
import zmq

from kv_event_clients import DECODE, replay
from tiny_models import make_model
from voltllm import SamplingParams
from voltllm.cache.kv_events import AllBlocksCleared, BlockStored
from voltllm.cache.prefix import extend_block_hashes

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
_rng = random.Random(0)
SHARED = [_rng.randrange(3, 200) for _ in range(64)]  # 4 blocks of 16
PROMPTS = [SHARED + [_rng.randrange(3, 200) for _ in range(36)] for _ in range(2)]
PROMPTS += [[_rng.randrange(3, 200) for _ in range(100)] for _ in range(2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_kv_events")), "llama")


def _events_config(tmp_path, **kw):
    return {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev",
            "replay_endpoint": f"ipc://{tmp_path}/replay", **kw}


def _llm(path, tmp_path, blocks=14, **kw):
    from voltllm.entrypoints.llm import LLM

    kw.setdefault("kv_events_config", _events_config(tmp_path))
    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=2, block_size=16,
               num_gpu_blocks_override=blocks, max_model_len=200, **kw)


class Subscriber:
    """A consumer of the stream: the hashes it believes each medium holds, from the events alone."""

    def __init__(self, ctx, llm):
        self.llm = llm
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(llm.engine.kv_event_publisher.endpoint)
        # ZeroMQ's slow joiner: resets of the idle engine (each an AllBlocksCleared batch) until one arrives
        while True:
            assert llm.reset_prefix_cache()
            if self.sub.poll(50):
                break
        self.frames: list = [self.sub.recv_multipart()]
        self.view: dict[str, set] = {"GPU": set(), "CPU": set()}
        self.stored: list[BlockStored] = []
        self.removed: list[bytes] = []
        self.receive()

    def receive(self) -> None:
        """Every batch the engine has published so far (the last one's sequence number is known)."""
        last = self.llm.engine.kv_event_publisher.num_batches - 1
        while not self.frames or int.from_bytes(self.frames[-1][1], "big") < last:
            assert self.sub.poll(5000), "a published batch did not arrive"
            frames = self.sub.recv_multipart()
            self.frames.append(frames)
            for e in DECODE(frames[2]).events:
                if isinstance(e, AllBlocksCleared):
                    self.view["GPU"].clear()
                elif isinstance(e, BlockStored):
                    self.view[e.medium] |= set(e.block_hashes)
                    if e.medium == "GPU":
                        self.stored.append(e)
                else:
                    assert set(e.block_hashes) <= self.view[e.medium], "a block removed that was never stored"
                    self.view[e.medium] -= set(e.block_hashes)
                    if e.medium == "GPU":
                        self.removed += e.block_hashes

    def run(self, prompt):
        out = self.llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
        self.receive()
        kv = self.llm.engine.kv
        assert self.view["GPU"] == set(kv.pool.cached)
        if kv.cpu is not None:
            assert len(self.view["CPU"]) == len(kv.cpu) and all(h in kv.cpu for h in self.view["CPU"])
        return out


def _hashes(tokens):
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 16)
    return hashes


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_subscribers_view_is_the_prefix_cache(tiny, tmp_path, async_scheduling):
    ctx = zmq.Context()
    llm = _llm(tiny, tmp_path, async_scheduling=async_scheduling)
    try:
        sub = Subscriber(ctx, llm)
        first = sub.run(PROMPTS[0])
        tokens = PROMPTS[0] + first.outputs[0].token_ids  # 106 tokens: 6 full blocks, the output's included
        want = _hashes(tokens)
        assert [h for e in sub.stored for h in e.block_hashes] == want
        assert sub.stored[0].parent_block_hash is None
        for e in sub.stored:  # each event's blocks continue its parent's chain, with their own tokens
            i = want.index(e.block_hashes[0])
            assert e.parent_block_hash == (want[i - 1] if i else None)
            assert e.token_ids == tokens[16 * i:16 * (i + len(e.block_hashes))]
            assert e.block_size == 16 and e.lora_id is None and e.medium == "GPU"
        # the second prompt shares 4 blocks: its stores start after them, their parent the shared 4th block
        n = len(sub.stored)
        second = sub.run(PROMPTS[1])
        assert second.num_cached_tokens == 64
        tokens2 = PROMPTS[1] + second.outputs[0].token_ids
        assert sub.stored[n].parent_block_hash == want[3]
        assert [h for e in sub.stored[n:] for h in e.block_hashes] == _hashes(tokens2)[4:]
        # two more prompts outgrow the 14 blocks: evictions remove blocks stored before
        for p in PROMPTS[2:]:
            sub.run(p)
        assert sub.removed and set(sub.removed) <= {h for e in sub.stored for h in e.block_hashes}
        assert llm.reset_prefix_cache()
        sub.receive()
        assert isinstance(DECODE(sub.frames[-1][2]).events[-1], AllBlocksCleared) and not sub.view["GPU"]
        # sequence numbers are contiguous, every batch is engine 0's, and replay returns what the socket carried
        seqs = [int.from_bytes(f[1], "big") for f in sub.frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert all(DECODE(f[2]).data_parallel_rank == 0 for f in sub.frames)
        replayed = replay(ctx, llm.engine.kv_event_publisher.replay_endpoint)
        assert replayed[-len(sub.frames):] == [(int.from_bytes(f[1], "big"), f[2]) for f in sub.frames]
        sub.sub.close()
    finally:
        llm.engine.shutdown()
        ctx.term()
    assert not llm.engine.kv_event_publisher.running


def test_the_cpu_tier_is_published_as_medium_cpu(tiny, tmp_path):
    ctx = zmq.Context()
    llm = _llm(tiny, tmp_path, kv_offloading_size=0.001)
    try:
        sub = Subscriber(ctx, llm)
        for i in (2, 3, 0, 2):  # 2's blocks are evicted to the CPU tier, then come back from there
            out = sub.run(PROMPTS[i])
        assert out.num_cached_tokens == 96 and sub.view["CPU"]
        assert set(_hashes(PROMPTS[2])) <= sub.view["CPU"]
        # a plain reset keeps the CPU tier: after AllBlocksCleared its blocks are told again, so a consumer that reads
        # the clear as every medium forgotten still knows them
        assert llm.reset_prefix_cache()
        sub.receive()
        last = DECODE(sub.frames[-1][2]).events
        assert isinstance(last[0], AllBlocksCleared) and all(e.medium == "CPU" for e in last[1:])
        assert {h for e in last[1:] for h in e.block_hashes} == set(llm.engine.kv.cpu.hashes()) == sub.view["CPU"]
        assert llm.reset_prefix_cache(reset_connector=True)
        sub.receive()
        assert not sub.view["CPU"] and not sub.view["GPU"]
        sub.sub.close()
    finally:
        llm.engine.shutdown()
        ctx.term()


def test_a_data_parallel_engine_publishes_on_its_own_endpoint(tiny, tmp_path):
    """Engine 1 of --data-parallel-size 2 (the configuration `voltllm serve -dp 2` gives it): its batches carry its
    rank, on the endpoint with _dp1 appended."""
    from voltllm.config import EngineArgs
    from voltllm.engine.core import EngineCore
    from voltllm.engine.data_parallel import rank_config

    config = EngineArgs(model=tiny, device="cpu", dtype="float32", enforce_eager=True, block_size=16,
                        num_gpu_blocks_override=14, max_model_len=200, data_parallel_size=2,
                        kv_events_config=_events_config(tmp_path)).create_engine_config()
    core = EngineCore(rank_config(config, 1))
    ctx = zmq.Context()
    try:
        assert core.kv_event_publisher.endpoint == f"ipc://{tmp_path}/ev_dp1"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(core.kv_event_publisher.endpoint)
        while True:
            assert core.reset_prefix_cache()
            if sub.poll(50):
                break
        assert DECODE(sub.recv_multipart()[2]).data_parallel_rank == 1
        sub.close()
    finally:
        core.shutdown()
        ctx.term()


def test_off_means_no_socket_and_nothing_recorded(tiny, tmp_path):
    for off in ({"enable_kv_cache_events": False, "publisher": "zmq"}, {"enable_kv_cache_events": True,
                                                                        "publisher": "null"}):
        llm = _llm(tiny, tmp_path, kv_events_config={**_events_config(tmp_path), **off})
        assert llm.engine.kv_event_publisher is None and llm.engine.kv.pool.events is None
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
        assert not (tmp_path / "ev").exists() and not (tmp_path / "replay").exists()


def test_bad_configs_and_a_port_in_use_are_value_errors(tiny, tmp_path):
    from voltllm.entrypoints.llm import LLM

    with pytest.raises(ValueError, match=r"--kv-events-config: unknown keys \['bogus'\]"):
        LLM("/nonexistent", kv_events_config={"enable_kv_cache_events": True, "bogus": 1})
    with pytest.raises(ValueError, match="--kv-events-config endpoint 'udp://x:1': not a ZeroMQ endpoint"):
        LLM("/nonexistent", kv_events_config={"enable_kv_cache_events": True, "endpoint": "udp://x:1"})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot open tcp://127.0.0.1:{port}: Address already in use"):
            _llm(tiny, tmp_path, kv_events_config=_events_config(tmp_path,
                                                                 replay_endpoint=f"tcp://127.0.0.1:{port}"))
    assert not any(t.name.startswith("voltllm-kv-events") for t in threading.enumerate())
