"""--data-parallel-size: its configuration checks, each engine's devices, and DataParallelLLM's routing, aborts,
stats and reports over stand-in engines (the real engine processes: tests/server/test_data_parallel_server.py)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from tiny_models import make_model
from voltllm.config import ConfigError, EngineArgs, _check_data_parallel
from voltllm.engine.async_llm import EngineDeadError
from voltllm.engine.data_parallel import DataParallelLLM, make_async_engine, rank_config, require_one_engine
from voltllm.engine.request_checks import InvalidRequestError
from voltllm.engine.types import SchedulerStats
from voltllm.entrypoints.openai.metrics import engine_metrics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_dp")), "llama")


@pytest.fixture(scope="module")
def dp3_config(tiny):
    return EngineArgs(model=tiny, device="cpu", data_parallel_size=3).create_engine_config()


class FakeEngine:
    def __init__(self, index: int, active: int = 0, stats: SchedulerStats = None):
        self.engine_index = index
        self.active = {f"old-{index}-{i}" for i in range(active)}
        self.dead = None
        self.is_healthy = True
        self.stats = stats or SchedulerStats()
        self.aborted: list[str] = []
        self.removed_loras: list[int] = []
        self.observer = None
        self.config = None
        self.max_model_len = 1024

    @property
    def num_active_requests(self) -> int:
        return len(self.active)

    def serves(self, rid: str) -> bool:
        return rid in self.active

    def add_request(self, rid: str, *args, **kwargs):
        self.active.add(rid)
        return (self.engine_index, rid, args, kwargs)

    add_pooling_request = beam_search = add_request

    def abort(self, rid: str, reason=None) -> None:
        self.aborted.append(rid)
        self.active.discard(rid)

    def remove_lora(self, lora_int_id: int) -> None:
        self.removed_loras.append(lora_int_id)

    def _spawn(self) -> None:
        self.spawned = True

    def ask_to_stop(self) -> None:
        self.asked_to_stop = True


def _dp(config, engines) -> DataParallelLLM:
    dp = DataParallelLLM(config)
    dp.engines = engines
    return dp


def test_config_takes_the_engine_count(tiny, dp3_config):
    assert dp3_config.parallel.data_parallel_size == 3
    assert EngineArgs(model=tiny, device="cpu").create_engine_config().parallel.data_parallel_size == 1
    with pytest.raises(ConfigError, match="--data-parallel-size must be >= 1, got 0"):
        EngineArgs(model=tiny, device="cpu", data_parallel_size=0).create_engine_config()


def test_expert_parallel_over_engines_is_refused(tmp_path):
    moe = make_model(str(tmp_path / "moe"), "qwen3_moe")
    with pytest.raises(ConfigError, match="--data-parallel-size 2 with --enable-expert-parallel: experts spread"):
        EngineArgs(model=moe, device="cpu", data_parallel_size=2,
                   enable_expert_parallel=True).create_engine_config()


def test_engines_need_their_own_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    _check_data_parallel(2, 2, False, torch.device("cuda"))  # cuda:0-1 and cuda:2-3
    with pytest.raises(ConfigError, match="--data-parallel-size 2 x --tensor-parallel-size 2: needs 4 CUDA devices "
                                          "from cuda:1, but 4 are visible"):
        _check_data_parallel(2, 2, False, torch.device("cuda", 1))
    _check_data_parallel(4, 1, False, torch.device("cpu"))  # every engine on the CPU


def test_each_engine_starts_on_its_tensor_parallel_group(dp3_config):
    cfg = replace(dp3_config, device=replace(dp3_config.device, device=torch.device("cuda", 1)),
                  parallel=replace(dp3_config.parallel, tensor_parallel_size=2))
    assert [str(rank_config(cfg, k).device.device) for k in range(3)] == ["cuda:1", "cuda:3", "cuda:5"]
    assert rank_config(dp3_config, 2).device == dp3_config.device  # the CPU: every engine there
    # each engine's unseeded sampling draws its own numbers: the global seed is offset by its index
    assert [rank_config(dp3_config, k).parallel.global_seed(0) for k in range(3)] == [0, 1, 2]
    assert dp3_config.parallel.global_seed(5) == 5
    dp = DataParallelLLM(cfg)
    assert [e.engine_index for e in dp.engines] == [0, 1, 2]
    assert [str(e.config.device.device) for e in dp.engines] == ["cuda:1", "cuda:3", "cuda:5"]
    assert type(make_async_engine(dp3_config)) is DataParallelLLM


def test_offline_llm_and_inprocess_bench_refuse_several_engines(tiny, dp3_config):
    from voltllm import LLM

    with pytest.raises(ConfigError, match="--data-parallel-size 3: the offline LLM runs one engine; data-parallel "
                                          "engines are served by `voltllm serve`"):
        LLM(tiny, device="cpu", data_parallel_size=3)
    with pytest.raises(ConfigError, match="the in-process bench runs one engine"):
        require_one_engine(dp3_config, "the in-process bench")


def test_requests_go_to_the_least_busy_engine_round_robin_among_equals(dp3_config):
    engines = [FakeEngine(0, active=2), FakeEngine(1), FakeEngine(2)]
    dp = _dp(dp3_config, engines)
    picked = [dp.add_request(f"r{i}", "prompt", None)[0] for i in range(7)]
    # 1 and 2 idle, 0 busy: 1, 2, then all at 1 except 0 at 2 ... each time the least busy, ties in turn
    assert picked == [1, 2, 1, 2, 0, 1, 2]
    assert dp.num_active_requests == 9
    assert dp.beam_search("b", "prompt", None)[0] == 0 and dp.add_pooling_request("p", "x")[0] == 1
    with pytest.raises(InvalidRequestError, match="request id 'r3' is already in use"):
        dp.add_request("r3", "prompt", None)


def test_abort_reaches_the_serving_engine_and_a_dead_engine_refuses_new_requests(dp3_config):
    engines = [FakeEngine(0), FakeEngine(1), FakeEngine(2)]
    dp = _dp(dp3_config, engines)
    dp.add_request("a", "prompt", None)
    owner = next(e for e in engines if e.serves("a"))
    dp.abort("a")
    assert not owner.serves("a") and dp.num_active_requests == 0
    dp.add_request("b", "prompt", None)
    dp.add_request("c", "prompt", None)
    engines[1].dead = "the engine process exited (exit code -9)"
    engines[1].is_healthy = False
    assert not dp.is_healthy
    assert dp.dead == "data-parallel engine 1: the engine process exited (exit code -9)"
    with pytest.raises(EngineDeadError, match="data-parallel engine 1"):
        dp.add_request("d", "prompt", None)


def test_an_unloaded_adapter_leaves_every_engine(dp3_config):
    engines = [FakeEngine(k) for k in range(3)]
    _dp(dp3_config, engines).remove_lora(7)  # (/v1/unload_lora_adapter: any engine may have read it)
    assert [e.removed_loras for e in engines] == [[7], [7], [7]]


def test_stats_add_up_and_metrics_label_each_engine(dp3_config):
    lora = {"max_lora": 2, "lora_running": ["x"], "lora_waiting": []}
    parts = [SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=10,
                            prefix_cache_hits=4, num_blocks=100,
                            extra={"spec_draft_tokens": 3, "spec_accepted_tokens": 2, **lora}),
             SchedulerStats(num_running=1, kv_cache_usage=0.0, prefix_cache_queries=5, prefix_cache_hits=5,
                            num_blocks=300, extra={"spec_draft_tokens": 1, "spec_accepted_tokens": 1, **lora,
                                                   "lora_running": ["y"], "lora_waiting": ["x"]}),
             SchedulerStats(num_blocks=100)]
    dp = _dp(dp3_config, [FakeEngine(k, stats=s) for k, s in enumerate(parts)])
    s = dp.stats
    assert (s.num_running, s.num_waiting, s.prefix_cache_queries, s.prefix_cache_hits, s.num_blocks) == \
        (3, 1, 15, 9, 500)
    assert s.kv_cache_usage == pytest.approx(50 / 500)  # the share of all blocks in use
    assert s.extra["spec_draft_tokens"] == 4 and s.extra["max_lora"] == 2
    assert s.extra["lora_running"] == ["x", "y"]

    metrics = engine_metrics("m", dp)
    assert [e.observer.engine for e in dp.engines] == ["0", "1", "2"]
    dp.engines[2].observer.on_first_token(0.1)
    text = metrics.render().decode()
    assert 'voltllm:kv_cache_num_blocks{engine="1",model_name="m"} 300.0' in text
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert 'voltllm:time_to_first_token_seconds_count{engine="2",model_name="m"} 1.0' in text
    assert 'voltllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 0.0' in text
    assert 'running_lora_adapters="x,y"' in text and text.count("voltllm:lora_requests_info{") == 1


def test_acceleration_report_is_every_engines_verdict(dp3_config):
    def report(ok: bool, device: str) -> dict:
        return {"object": "acceleration_report", "ok": ok, "configuration": {"device": device}, "routes": {},
                "disabled_expected": [] if ok else [{"route": "attention", "reason": "off"}]}

    engines = [FakeEngine(k) for k in range(3)]
    for k, e in enumerate(engines):
        async def acc(timeout=30.0, k=k):
            return report(k != 2, f"cuda:{k}")
        e.acceleration_report = acc
    out = asyncio.run(_dp(dp3_config, engines).acceleration_report())
    assert out["ok"] is False
    assert out["disabled_expected"] == [{"route": "attention", "reason": "off", "engine": 2}]
    assert out["engines"] == [{"engine": k, "device": f"cuda:{k}", "ok": k != 2} for k in range(3)]


def test_an_engine_makes_its_gpu_the_current_device(monkeypatch):
    """Triton launches, streams and graph captures act on the current device: an engine on cuda:2 (a data-parallel
    engine past the first, or --device cuda:2) must make it current, or its kernels would launch on cuda:0."""
    from voltllm.platform import make_current

    made: list = []
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    make_current(torch.device("cuda", 2))
    make_current(torch.device("cuda"))  # (no index: the current device already)
    make_current(torch.device("cpu"))
    assert made == [torch.device("cuda", 2)]


def test_a_conversations_next_turn_goes_where_its_beginning_is_cached():
    from voltllm.engine.dp_routing import SLACK, TEXT_CHUNK, PrefixRouter, prompt_keys

    system = "You are a helpful assistant. " * 10  # > 2 chunks, shared by every conversation
    talk = [system + f"User {u}: " + "tell me about the sea " * 20 for u in range(2)]
    probe = PrefixRouter(2)
    probe.choose(prompt_keys(talk[0]), [0, 0])
    # a new conversation: the engine holding the shared system prompt, while at most SLACK busier ...
    assert probe.choose(prompt_keys(talk[1]), [1, 0]) == 0
    router = PrefixRouter(2)
    first = router.choose(prompt_keys(talk[0]), [0, 0])
    busier = [0, 0]
    busier[first] = SLACK + 1
    second = router.choose(prompt_keys(talk[1]), busier)  # ... else the least busy
    assert second == 1 - first
    # each conversation's next turn (its prompt grown by an answer and a message) returns to its engine, though the
    # other engine is now less busy, and though both hold the shared system prompt
    for conv, engine in ((0, first), (1, second)):
        grown = talk[conv] + " Assistant: waves. User: and the tides? " * 8
        loads = [3, 3]
        loads[engine] += SLACK
        assert router.choose(prompt_keys(grown), loads) == engine
    # ... but not when that engine is more than SLACK busier: then the least busy takes it
    loads = [0, 0]
    loads[first] = SLACK + 1
    assert router.choose(prompt_keys(talk[0] + " more"), loads) == 1 - first
    # the cache salt and the adapter key the engines' blocks: another salt or adapter is another prompt
    assert prompt_keys(talk[0]) != prompt_keys(talk[0], cache_salt="s") != prompt_keys(talk[0], adapter="a")
    assert prompt_keys("x" * (TEXT_CHUNK - 1)) == [] and len(prompt_keys("x" * (2 * TEXT_CHUNK + 5))) == 2
    assert len(prompt_keys({"prompt_token_ids": list(range(70))})) == 2 and prompt_keys(None) == []


def test_the_router_forgets_the_least_recently_used(monkeypatch):
    from voltllm.engine import dp_routing

    monkeypatch.setattr(dp_routing, "REMEMBERED", 4)
    router = dp_routing.PrefixRouter(2)
    router.choose([1, 2, 3], [0, 0])
    router.choose([4, 5], [1, 0])
    router.choose([1, 6], [0, 2])  # engine 0 again: key 1 refreshed, 6 added
    router.choose([7], [0, 5])  # 5 keys on engine 0: the least recently used (2) goes
    assert list(router.seen[0]) == [3, 1, 6, 7] and list(router.seen[1]) == [4, 5]


def test_engines_fitted_to_different_cards_all_take_the_shortest_length(dp3_config):
    """--max-model-len auto fits each engine to its own card: a request must be accepted or refused alike on all."""
    from types import SimpleNamespace

    engines = [FakeEngine(k) for k in range(3)]
    for e, fitted in zip(engines, (4096, 1536, 8192)):
        async def start(timeout=None, e=e, fitted=fitted):
            e.max_model_len = fitted
            e.frontend = SimpleNamespace(max_model_len=fitted)
            e.engine_info = {"pid": 1, "num_blocks": 8}
        e.finish_start = start
        e.config = dp3_config
    dp = DataParallelLLM(dp3_config, tokenizer=object())
    dp.engines = engines
    asyncio.run(dp.start())
    assert dp.max_model_len == 1536
    assert [(e.max_model_len, e.frontend.max_model_len) for e in engines] == [(1536, 1536)] * 3


def test_a_device_past_the_visible_cards_is_a_clear_error(monkeypatch):
    from voltllm.config import _resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"--device cuda:2: 2 CUDA device\(s\) are visible \(cuda:0 .. cuda:1; "
                                          "CUDA_VISIBLE_DEVICES numbers"):
        _resolve_device("cuda:2")
    with pytest.raises(ConfigError, match="--device must be auto, cpu or cuda"):
        _resolve_device("cuda:x")


def test_mixed_cards_follow_the_oldest(monkeypatch, caplog):
    """An RTX 3090 (sm_86) listed before a V100 (sm_70): the route and dtype of every card follow the V100 (the compat
    route runs on the newer card too; bf16 would not run on the V100)."""
    from voltllm.config import _resolve_compat, _run_capability

    caps = {0: (8, 6), 1: (7, 0), 2: (8, 6)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: caps[torch.device(d).index])
    assert _run_capability(torch.device("cuda"), 1) == (8, 6)  # one card: its own
    with caplog.at_level("WARNING", logger="voltllm"):
        assert _run_capability(torch.device("cuda"), 2) == (7, 0)  # -tp 2 or -dp 2 over cuda:0-1
    assert "mixed GPUs (cuda:0 sm_86, cuda:1 sm_70): the kernel route and dtype follow the oldest, sm_70" in caplog.text
    assert _resolve_compat("auto", torch.device("cuda"), (7, 0)) == "sm70"
    assert _run_capability(torch.device("cuda", 2), 4) == (8, 6)  # (cards past the visible ones: checked later)
    assert _run_capability(torch.device("cpu"), 2) is None


def test_an_engine_that_cannot_start_stops_the_others(dp3_config):
    """One engine's start-up error: the engines still loading stop waiting, every engine is shut down, and the error
    is the failed engine's."""
    from voltllm.engine.async_llm import EngineStartError

    engines = [FakeEngine(k) for k in range(3)]
    events = []
    for e in engines:
        async def start(timeout=None, e=e):
            if e.engine_index == 1:
                raise EngineStartError("the engine could not start: out of memory")
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                events.append(("cancelled", e.engine_index))
                raise
        e.finish_start = start
        e.shutdown = lambda timeout=5.0, e=e: events.append(("shutdown", e.engine_index))
    dp = DataParallelLLM(dp3_config, tokenizer=object())
    dp.engines = engines
    with pytest.raises(EngineStartError, match="out of memory"):
        asyncio.run(asyncio.wait_for(dp.start(), 10))
    assert sorted(events) == [("cancelled", 0), ("cancelled", 2), ("shutdown", 0), ("shutdown", 1), ("shutdown", 2)]
    assert all(e.spawned and e.asked_to_stop for e in engines)  # all spawned before waiting; all asked before joins


def test_check_says_it_checks_engine_0(tiny, capsys):
    from voltllm.cli import main

    assert main(["check", tiny, "--device", "cpu", "-dp", "2", "--no-load"]) == 0
    assert "--data-parallel-size 2: checking engine 0 (on cpu)" in capsys.readouterr().err
