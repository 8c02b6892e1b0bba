"""KV-cache sizing on a GPU (voltllm.worker.memory.kv_budget_bytes) with the CUDA memory queries faked: the budget
is this engine's share of the card (--gpu-memory-utilization, as in vLLM), not charged for other processes' memory,
and never more than what is free."""
from types import SimpleNamespace

import pytest
import torch

from voltllm.worker import memory

GiB = 1 << 30
EXTRA = 256 << 20  # the function's fixed reserve; activations, prompt graphs and GDN slack are faked as 0


@pytest.fixture
def card(monkeypatch):
    state = {}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: state["reserved"])
    monkeypatch.setattr(memory, "profile_activation_bytes", lambda runner: 0)
    monkeypatch.setattr(memory, "prompt_graph_bytes", lambda runner, activations: 0)
    monkeypatch.setattr(memory, "chunk_workspace_slack_bytes", lambda model, n: 0)
    return state


def _runner(free_at_start=None):
    r = SimpleNamespace(device=torch.device("cuda"), model=None,
                        config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=8)))
    if free_at_start is not None:
        r.free_at_start = free_at_start
    return r


def test_alone_on_the_card(card):
    card.update(total=100 * GiB, free=79 * GiB, reserved=19 * GiB)  # 20 GiB since start: weights + workspaces
    assert memory.kv_budget_bytes(_runner(99 * GiB), 0.9) == 70 * GiB - EXTRA


def test_other_processes_are_not_charged_to_this_engine(card):
    # another engine holds 40 GiB from before this one started; this one took 20 GiB; its share is 45 GiB
    card.update(total=100 * GiB, free=39 * GiB, reserved=19 * GiB)
    assert memory.kv_budget_bytes(_runner(59 * GiB), 0.45) == 25 * GiB - EXTRA


def test_capped_by_the_free_memory(card, caplog):
    card.update(total=100 * GiB, free=9 * GiB, reserved=19 * GiB)  # others hold 71 GiB: only 9 GiB left
    with caplog.at_level("INFO", logger="voltllm"):
        assert memory.kv_budget_bytes(_runner(29 * GiB), 0.45) == 9 * GiB - EXTRA
    assert "capped by the free memory" in caplog.text


def test_a_model_built_before_the_runner_is_charged(card):
    # the weights were allocated before the snapshot: this process's allocator still holds them
    card.update(total=100 * GiB, free=79 * GiB, reserved=20 * GiB)
    assert memory.kv_budget_bytes(_runner(80 * GiB), 0.9) == 70 * GiB - EXTRA


def test_without_a_snapshot_everything_in_use_is_charged(card):
    card.update(total=100 * GiB, free=39 * GiB, reserved=19 * GiB)
    assert memory.kv_budget_bytes(_runner(), 0.9) == 29 * GiB - EXTRA
    card.update(free=5 * GiB)
    assert memory.kv_budget_bytes(_runner(), 0.5) == 0


def test_kv_cache_memory_bytes_replaces_the_share(card, caplog):
    # --kv-cache-memory-bytes 8G: the utilization share (70 GiB here) no longer counts; state slots are inside it
    card.update(total=100 * GiB, free=79 * GiB, reserved=19 * GiB)
    with caplog.at_level("INFO", logger="voltllm"):
        assert memory.kv_budget_bytes(_runner(99 * GiB), 0.9, fixed=8 * GiB, state_bytes=GiB) == 7 * GiB
    assert "--kv-cache-memory-bytes" in caplog.text


def test_kv_cache_memory_bytes_over_the_free_memory_is_an_error(card):
    card.update(total=100 * GiB, free=9 * GiB, reserved=19 * GiB)
    with pytest.raises(RuntimeError, match="--kv-cache-memory-bytes 10.00 GiB does not fit"):
        memory.kv_budget_bytes(_runner(29 * GiB), 0.9, fixed=10 * GiB)
