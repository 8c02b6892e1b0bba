"""LoRA under tensor parallelism without processes (lora/sharding.py): each rank's model shard, with its cut of an
adapter in a slot, gives its rows of the whole projection's output (column-parallel qkv / gate_up, KV heads split or
replicated), and the ranks' partial outputs of a row-parallel projection (o / down), adapter term included, add up
to the whole output once (what the all-reduce after it sums)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from lora_adapters import make_adapter
from tiny_models import make_model
from voltllm.lora.request import LoRARequest

T, WITH_ADAPTER = 6, 4  # tokens of the batch; the first ones run the adapter, the rest the base model


class _Rank:
    """A stand-in TP group (no collective runs here: the test adds the ranks' partial outputs itself)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _manager(path: str, tp, max_loras: int = 2, max_cpu_loras: int = 2):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from voltllm.config import LoRAConfig
    from voltllm.lora.manager import LoRAManager
    from voltllm.model.models.registry import build_model

    cfg = AutoConfig.from_pretrained(path)
    model = build_model(cfg, torch.float32, 64, tp=tp)
    model.load_weights(load_file(os.path.join(path, "model.safetensors")).items())
    return model, LoRAManager(model, LoRAConfig(max_loras, 8, max_cpu_loras, torch.float32), cfg, T,
                              torch.device("cpu"), split=model.tp_part if tp is not None else None)


def _scheduled(*keys_and_tokens):
    return [SimpleNamespace(request=SimpleNamespace(lora_key=key), num_new_tokens=n) for key, n in keys_and_tokens]


def _model(path: str, tp):
    model, manager = _manager(path, tp)
    key = manager.register(LoRARequest("a", 1, os.path.join(path, "adapter")))
    step = manager.prepare_step(_scheduled((key, WITH_ADAPTER), (None, T - WITH_ADAPTER)), T)
    return model, manager, step


def _rank_index(model, name: str, shard: int, n: int, dim: int) -> torch.Tensor:
    """Which of the whole projection's n output rows (dim 0) or input columns (dim 1) this rank holds: the model's
    own cut applied to their indices."""
    idx = torch.arange(n, dtype=torch.float32)
    part = model.tp_part(name, "weight", shard, idx[:, None] if dim == 0 else idx[None, :])
    return part.flatten().long()


@pytest.mark.parametrize("size,kv_heads", [(2, 2), (2, 1), (4, 2)], ids=["kv-split", "kv-replicated",
                                                                        "kv-replicated-and-cut"])
def test_ranks_outputs_are_the_whole_projections_with_the_adapter(tmp_path, size, kv_heads):
    path = make_model(str(tmp_path), "qwen3", num_key_value_heads=kv_heads, intermediate_size=96)
    make_adapter(os.path.join(path, "adapter"), path, rank=8, alpha=16)
    whole, manager, step = _model(path, None)
    assert step.loads[0][0] == 0 and step.token_slots.tolist() == [0] * WITH_ADAPTER + [-1] * (T - WITH_ADAPTER)
    ranks = [_model(path, _Rank(r, size))[0] for r in range(size)]
    g = torch.Generator().manual_seed(0)
    for layer in range(len(whole.layers)):
        for name in (f"layers.{layer}.self_attn.qkv_proj", f"layers.{layer}.mlp.gate_up_proj"):
            lin = whole.get_submodule(name)
            x = torch.randn(T, lin.in_features, generator=g)
            y = lin(x)
            with torch.no_grad():
                base = torch.nn.functional.linear(x, lin.weight)
            assert not torch.allclose(y[:WITH_ADAPTER], base[:WITH_ADAPTER])  # (the adapter changes its tokens)
            assert torch.equal(y[WITH_ADAPTER:], base[WITH_ADAPTER:])
            for model in ranks:
                part = model.get_submodule(name)
                cols = torch.cat([lin.shard_offset(s) + _rank_index(model, name, s, n, 0)
                                  for s, n in enumerate(lin.shard_sizes)])
                assert torch.allclose(part(x), y[:, cols], atol=1e-5, rtol=0), name
        for name in (f"layers.{layer}.self_attn.o_proj", f"layers.{layer}.mlp.down_proj"):
            lin = whole.get_submodule(name)
            x = torch.randn(T, lin.in_features, generator=g)
            total = sum(model.get_submodule(name)(x[:, _rank_index(model, name, 0, lin.in_features, 1)])
                        for model in ranks)
            assert torch.allclose(total, lin(x), atol=1e-5, rtol=0), name


def test_a_follower_repeats_rank_0s_slots_and_mask(tmp_path, monkeypatch):
    """Rank 0's LoRAStep replayed by another rank's manager (follow_step): the same adapter in the same slot, the same
    mask, the same `active`; the follower reads each adapter itself when it first takes a slot there, keeps in CPU
    memory at most --max-cpu-loras (the resident ones for sure) and reads a dropped one again."""
    import voltllm.lora.manager as manager_module

    path = make_model(str(tmp_path), "llama")
    requests = {n: LoRARequest(n, i, make_adapter(os.path.join(path, n), path, rank=4, alpha=8, seed=i))
                for i, n in enumerate(("a1", "a2", "a3"), 1)}
    _, leader = _manager(path, None)
    _, follower = _manager(path, None)
    read, reads = manager_module.read_adapter, []
    steps = [[("a1", 3)], [("a2", 2), (None, 1)], [(None, 2)], [("a3", 1), ("a1", 2)], [("a2", 3)], [("a3", 2)]]
    keys = {}
    for i, step in enumerate(steps):
        live = {keys.get(name) for name, _ in step if name}  # (the engine's live requests: this step's)
        for name in sorted({name for name, _ in step if name}):
            keys[name] = leader.register(requests[name], lambda: live)
            live.add(keys[name])
        plan = leader.prepare_step(_scheduled(*[(keys.get(name), n) for name, n in step]), T)
        with monkeypatch.context() as m:  # the follower's own reads
            m.setattr(manager_module, "read_adapter", lambda req, *a: reads.append(req.lora_name) or read(req, *a))
            follower.follow_step(plan, T)
        assert follower.resident() == leader.resident(), i
        assert follower.batch.active == leader.batch.active and torch.equal(follower.batch.mask, leader.batch.mask)
        for name, w in leader.weights.items():
            assert torch.equal(follower.weights[name].a, w.a) and torch.equal(follower.weights[name].b, w.b)
        assert len(follower.cached()) <= 2 and set(follower.resident()) <= set(follower.cached())
    # a2 left the follower's CPU memory when a3 took its slot (a1 and a3 resident) and was read again for step 4
    assert reads == ["a1", "a2", "a3", "a2"]
