"""Removing LoRA adapters from the engine's manager (vLLM's remove_lora; the server's /v1/unload_lora_adapter and
in-place reloads): an unused adapter leaves CPU memory and its GPU slot (zeroed) at once, one that live requests use
is kept until they end, a later request of a removed adapter reads it afresh under a new key (new prefix-cache
blocks), and the other tensor-parallel ranks drop what rank 0 dropped."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from lora_adapters import make_adapter
from tiny_models import make_model
from voltllm.lora.request import LoRARequest

T = 4


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora_remove"))
    model = make_model(os.path.join(root, "model"), "llama")
    return model, {n: make_adapter(os.path.join(root, n), model, rank=4, alpha=8, seed=i)
                   for i, n in enumerate(("a1", "a2", "a3"), 1)}


def _manager(model_path, max_loras=2, max_cpu_loras=3):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from voltllm.config import LoRAConfig
    from voltllm.lora.manager import LoRAManager
    from voltllm.model.models.registry import build_model

    cfg = AutoConfig.from_pretrained(model_path)
    model = build_model(cfg, torch.float32, 64)
    model.load_weights(load_file(os.path.join(model_path, "model.safetensors")).items())
    return LoRAManager(model, LoRAConfig(max_loras, 8, max_cpu_loras, torch.float32), cfg, T, torch.device("cpu"))


def _step(manager, *keys):
    """A step of one token per key (None: a base-model token)."""
    return manager.prepare_step([SimpleNamespace(request=SimpleNamespace(lora_key=k), num_new_tokens=1)
                                 for k in keys], T)


def _slot_is_zero(manager, slot) -> bool:
    """Every projection's A and B rows of `slot` are zero."""
    return not any(w.a[w._rows(s, slot)].any() or w.b[w._rows(s, slot)].any()
                   for w in manager.weights.values() for s in range(len(w.shard_sizes)))


def test_an_unused_adapter_leaves_cpu_memory_and_its_slot_at_once(paths):
    model, adapters = paths
    m = _manager(model)
    r1, r2 = LoRARequest("a1", 1, adapters["a1"]), LoRARequest("a2", 2, adapters["a2"])
    k1, k2 = m.register(r1), m.register(r2)
    _step(m, k1, k2)
    slot1 = m.resident()[k1]
    assert not _slot_is_zero(m, slot1) and m.ids() == {1, 2}
    assert m.remove(1) is True
    assert k1 not in m.cached() and k1 not in m.resident() and k1 not in m.known
    assert _slot_is_zero(m, slot1) and not _slot_is_zero(m, m.resident()[k2])
    assert m.ids() == {2} and not m.retiring
    m.check_integrity(set())
    assert _step(m, k2).drops == [k1]  # (for the other TP ranks), once
    assert _step(m, k2).drops == []
    assert m.remove(1) is False and m.remove(7) is False  # nothing loaded under those ids


def test_an_adapter_in_use_is_kept_until_its_requests_end(paths):
    model, adapters = paths
    m = _manager(model)
    r1 = LoRARequest("a1", 1, adapters["a1"])
    k1 = m.register(r1)
    _step(m, k1)
    live = {k1}
    assert m.remove(1, lambda: live) is True
    assert m.retiring and k1 in m.cached() and k1 in m.resident()  # its running requests still read it
    assert m.ids() == set()
    m.check_integrity(live)
    # a request of the removed adapter arriving while those run (a beam search's next step) shares their load
    assert m.register(r1, lambda: live) == k1
    m.drop_retired(lambda: live)
    assert k1 in m.cached()
    live.clear()  # the last request ended
    m.drop_retired(lambda: live)
    assert not m.retiring and k1 not in m.cached() and not m.resident() and _slot_is_zero(m, 0)
    m.check_integrity(live)


def test_a_removed_adapter_comes_back_under_a_new_key(paths, monkeypatch):
    """Its weights are read again from its path (new files there included) and its prefix-cache key is new, so
    nothing of the old load is reused; a request of it after remove() is retired at once (dropped when it ends),
    add() takes it back for good."""
    import voltllm.lora.manager as manager_module

    model, adapters = paths
    m = _manager(model)
    r1 = LoRARequest("a1", 1, adapters["a1"])
    k1 = m.register(r1)
    m.remove(1)
    read, reads = manager_module.read_adapter, []
    monkeypatch.setattr(manager_module, "read_adapter", lambda req, *a: reads.append(req.lora_name) or read(req, *a))
    late = m.register(r1)
    assert late != k1 and late.name == "a1" and reads == ["a1"]
    assert m.retiring and m.ids() == set()  # dropped when its requests end
    m.drop_retired(lambda: ())
    assert late not in m.cached()
    back = m.add(r1)
    assert back not in (k1, late) and m.ids() == {1} and not m.retiring
    assert m.register(r1) == back and reads == ["a1", "a1"]  # current again: no further read
    m.check_integrity(set())


def test_add_after_remove_takes_back_a_load_still_in_use(paths, monkeypatch):
    """add() of a removed adapter while requests of its old load still run: that load is current again (listed, kept
    after those requests end, no second read); at another path it stays retired beside a fresh current load."""
    import voltllm.lora.manager as manager_module

    model, adapters = paths
    m = _manager(model)
    r1 = LoRARequest("a1", 1, adapters["a1"])
    k1 = m.register(r1)
    _step(m, k1)
    live = {k1}
    m.remove(1, lambda: live)
    read, reads = manager_module.read_adapter, []
    monkeypatch.setattr(manager_module, "read_adapter", lambda req, *a: reads.append(req.lora_name) or read(req, *a))
    assert m.add(r1, lambda: live) == k1 and reads == []
    assert m.ids() == {1} and not m.retiring
    m.check_integrity(live)
    live.clear()  # its old requests end: the load stays
    m.drop_retired(lambda: live)
    assert k1 in m.known and k1 in m.cached() and m.register(r1) == k1 and reads == []
    m.check_integrity(live)
    # removed again, then added from another path while the old load runs: a new load, the old one retired
    live.add(k1)
    m.remove(1, lambda: live)
    moved = m.add(LoRARequest("a1", 1, adapters["a2"]), lambda: live)
    assert moved != k1 and reads == ["a1"] and m.ids() == {1} and m.retiring
    live.clear()
    m.drop_retired(lambda: live)
    assert k1 not in m.known and moved in m.known and not m.retiring
    m.check_integrity(live)


def test_another_lora_int_id_is_another_load(paths):
    """The server reloads an adapter in place under a new lora_int_id: both loads coexist while the old one's
    requests run (two slots), each with its own weights; the same (name, id) at another path is refused."""
    model, adapters = paths
    m = _manager(model)
    old = m.register(LoRARequest("a1", 1, adapters["a1"]))
    new = m.register(LoRARequest("a1", 2, adapters["a2"]))
    assert old != new
    _step(m, old, new)
    slots = m.resident()
    w = m.weights["layers.0.self_attn.qkv_proj"]
    rows_old, rows_new = w._rows(0, slots[old]), w._rows(0, slots[new])
    assert not torch.equal(w.a[rows_old], w.a[rows_new])
    with pytest.raises(ValueError, match="already loaded from .*another name or lora_int_id"):
        m.register(LoRARequest("a1", 2, adapters["a3"]))


def test_a_follower_drops_what_rank_0_dropped(paths):
    model, adapters = paths
    leader, follower = _manager(model), _manager(model)
    k1 = leader.register(LoRARequest("a1", 1, adapters["a1"]))
    k2 = leader.register(LoRARequest("a2", 2, adapters["a2"]))
    follower.follow_step(_step(leader, k1, k2), T)
    assert follower.resident() == leader.resident() and set(follower.cached()) == {k1, k2}
    leader.remove(1)
    plan = _step(leader, None, k2)
    follower.follow_step(plan, T)
    assert follower.resident() == leader.resident() == {k2: plan.token_slots[1]}
    assert follower.cached() == [k2] and k1 not in follower.known
    for name, w in leader.weights.items():
        assert torch.equal(follower.weights[name].a, w.a) and torch.equal(follower.weights[name].b, w.b)
