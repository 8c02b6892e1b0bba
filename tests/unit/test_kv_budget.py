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


# --- the profiled forward, with a stand-in allocator -------------------------------------------------------------
class FakeAllocator:
    """torch.cuda's memory counters over a stand-in allocator: allocate / free move them as a forward would."""

    def __init__(self, monkeypatch, total: int, in_use: int):
        self.total, self.allocated, self.peak = total, in_use, in_use
        for name, fn in (("synchronize", lambda dev=None: None), ("empty_cache", lambda: None),
                         ("memory_allocated", lambda dev=None: self.allocated),
                         ("max_memory_allocated", lambda dev=None: self.peak),
                         ("reset_peak_memory_stats", lambda dev=None: setattr(self, "peak", self.allocated)),
                         ("memory_reserved", lambda dev=None: self.allocated),  # (empty_cache returned the rest)
                         ("mem_get_info", lambda dev=None: (self.total - self.allocated, self.total))):
            monkeypatch.setattr(torch.cuda, name, fn)

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n


class ProfiledModel:
    """A model whose forward runs the compat prefill's workspace allocation (the real SDPAPrefill, sized for
    --max-model-len, kept afterwards) and `transient` bytes of activations freed before it returns."""

    num_attention_layers, kv_heads_and_dim, hidden = 2, (2, 64), 8

    def __init__(self, card: FakeAllocator, transient: int):
        self.card, self.transient = card, transient

    def __call__(self, ids, positions, ctx):
        before = ctx.backend.workspace_bytes()
        heads, dim = self.kv_heads_and_dim
        ctx.backend.sdpa_prefill.workspace(len(ids), heads, dim, torch.float16, ids.device)
        self.card.allocate(ctx.backend.workspace_bytes() - before)
        self.card.allocate(self.transient)
        self.card.free(self.transient)
        return torch.zeros(len(ids), self.hidden)

    def compute_logits(self, hidden):
        return hidden


def test_compat_prefill_workspace_is_charged_once(monkeypatch):
    """The profiled forward allocates the compat prefill workspace at --max-model-len and keeps it: the engine's
    memory in use (memory_reserved) holds it, so the activation peak must not count it again."""
    from voltllm.attention.triton_backend import TritonAttentionBackend

    max_model_len, weights, transient = 4096, 10 * GiB, 300 << 20
    card = FakeAllocator(monkeypatch, total=32 * GiB, in_use=weights)
    monkeypatch.setattr(memory, "prompt_graph_bytes", lambda runner, activations: 0)
    monkeypatch.setattr(memory, "chunk_workspace_slack_bytes", lambda model, n: 0)
    backend = TritonAttentionBackend(use_tensor_cores=False, max_context=max_model_len)  # the compat route's
    runner = SimpleNamespace(
        device=torch.device("cpu"), block_size=16, kv_dtype=torch.float16, backend=backend, pooler=None,
        max_decode_rows=1, model=ProfiledModel(card, transient), free_at_start=32 * GiB,
        config=SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=512, max_model_len=max_model_len,
                                                         max_num_seqs=8)))
    workspace = 2 * max_model_len * 2 * 64 * 2  # K and V rows of --max-model-len, 2 kv heads x 64, fp16
    assert memory.profile_activation_bytes(runner) == transient
    assert backend.workspace_bytes() == workspace and card.allocated == weights + workspace  # kept: in use
    budget = memory.kv_budget_bytes(runner, 0.9)
    assert budget == int(32 * GiB * 0.9) - (weights + workspace) - transient - EXTRA
    # profiled again: the workspace exists already, so the forward allocates (and keeps) nothing more
    assert memory.profile_activation_bytes(runner) == transient
