"""LoRA adapters (voltllm/lora/), the parts that need no engine: reading and checking PEFT adapters, the per-token
delta of a batch mixing slots, the flags and their refusals, --lora-modules, prefix-cache keys."""
from __future__ import annotations

import argparse
import json
import math
import os
import re

import pytest
import torch

from lora_adapters import HYBRID_TARGETS as _HYBRID_TARGETS, make_adapter
from tiny_models import make_model
from voltllm.config import ConfigError, EngineArgs
from voltllm.lora.adapter import LoRAAdapterError, projection_shapes, read_adapter
from voltllm.lora.request import LoRARequest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.fixture(scope="module")
def hf_config(tiny):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny)


def _read(path, hf_config, max_rank=16):
    return read_adapter(LoRARequest("a", 1, path), hf_config, max_rank, torch.float32)


# -- reading adapters ----------------------------------------------------------------------------------------------
def test_peft_modules_map_onto_the_merged_projections_with_scaling(tmp_path, tiny, hf_config):
    """q / k / v go to qkv_proj's shards 0 / 1 / 2, gate / up to gate_up's; B is stored transposed with the scaling
    (lora_alpha / r; rsLoRA: lora_alpha / sqrt(r)) folded in."""
    from safetensors.torch import load_file

    for rslora, scaling in ((False, 16 / 4), (True, 16 / math.sqrt(4))):
        path = make_adapter(str(tmp_path / f"a{rslora}"), tiny, rank=4, alpha=16, rslora=rslora, layers=[1])
        adapter = _read(path, hf_config)
        assert adapter.rank == 4 and adapter.scaling == pytest.approx(scaling)
        assert sorted(adapter.weights) == ["layers.1.mlp.down_proj", "layers.1.mlp.gate_up_proj",
                                           "layers.1.self_attn.o_proj", "layers.1.self_attn.qkv_proj"]
        assert sorted(adapter.weights["layers.1.self_attn.qkv_proj"]) == [0, 1, 2]
        raw = load_file(os.path.join(path, "adapter_model.safetensors"))
        a, bt = adapter.weights["layers.1.self_attn.qkv_proj"][1]  # k_proj
        key = "base_model.model.model.layers.1.self_attn.k_proj"
        assert torch.equal(a, raw[f"{key}.lora_A.weight"])
        assert torch.allclose(bt, (raw[f"{key}.lora_B.weight"] * scaling).t())
        a, bt = adapter.weights["layers.1.mlp.gate_up_proj"][1]  # up_proj
        assert torch.equal(a, raw["base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"])


def test_adapter_name_segments_and_bin_files_are_read(tmp_path, tiny, hf_config):
    """PEFT's in-memory names (lora_A.default.weight) and adapter_model.bin, as vLLM reads them."""
    from safetensors.torch import load_file

    path = make_adapter(str(tmp_path / "a"), tiny, rank=2, targets=("q_proj",), layers=[0])
    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    torch.save({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                for k, v in raw.items()}, os.path.join(path, "adapter_model.bin"))
    adapter = _read(path, hf_config)
    assert list(adapter.weights) == ["layers.0.self_attn.qkv_proj"] and list(adapter.weights[
        "layers.0.self_attn.qkv_proj"]) == [0]


def _with(tmp_path, tiny, name, **kw):
    return make_adapter(str(tmp_path / name), tiny, rank=4, targets=("q_proj",), layers=[0], **kw)


@pytest.mark.parametrize("name,kw,match", [
    ("dora", dict(extra_config={"use_dora": True}), "DoRA"),
    ("dora_w", dict(extra_tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                                   torch.ones(64)}), "DoRA"),
    ("save", dict(extra_config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    ("head", dict(extra_tensors={"base_model.model.lm_head.weight": torch.zeros(4, 64)}), "LM head"),
    ("embed", dict(extra_tensors={"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}),
     "embedding"),
    ("target", dict(extra_config={"target_modules": ["q_proj", "embed_tokens"]}), "embedding or the LM head"),
    ("bias", dict(extra_config={"bias": "all"}), "bias"),
    ("bias_w", dict(extra_tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias":
                                   torch.zeros(64)}), "LoRA bias"),
    ("rank", dict(extra_config={"rank_pattern": {"q_proj": 2}}), "per-module ranks"),
    ("type", dict(extra_config={"peft_type": "PROMPT_TUNING"}), "only LoRA adapters"),
    ("gate", dict(extra_tensors={"base_model.model.model.layers.0.mlp.gate.lora_A.weight": torch.zeros(4, 64)}),
     "mlp.gate is not built"),
    ("layer", dict(extra_tensors={"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight":
                                  torch.zeros(4, 64)}), "past the model's 3 layers"),
    ("shape", dict(extra_tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                                  torch.zeros(4, 63)}), r"this model needs lora_A \(4, 64\)"),
    ("half", dict(extra_tensors={"base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight":
                                 torch.zeros(4, 64)}), "no lora_B weight"),
])
def test_what_is_not_built_is_refused_by_name(tmp_path, tiny, hf_config, name, kw, match):
    with pytest.raises(LoRAAdapterError, match=match) as e:
        _read(_with(tmp_path, tiny, name, **kw), hf_config)
    assert "LoRA adapter 'a'" in str(e.value)


def test_rank_above_max_lora_rank_and_broken_directories(tmp_path, tiny, hf_config):
    path = make_adapter(str(tmp_path / "r32"), tiny, rank=32, targets=("q_proj",), layers=[0])
    with pytest.raises(LoRAAdapterError, match="LoRA rank 32 is greater than --max-lora-rank 16"):
        _read(path, hf_config)
    assert _read(path, hf_config, max_rank=32).rank == 32
    with pytest.raises(LoRAAdapterError, match="no such directory"):
        _read(str(tmp_path / "missing"), hf_config)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        _read(str(tmp_path / "empty"), hf_config)
    (tmp_path / "empty" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(LoRAAdapterError, match="no adapter_model.safetensors or adapter_model.bin"):
        _read(str(tmp_path / "empty"), hf_config)
    (tmp_path / "empty" / "adapter_config.json").write_text(json.dumps({"lora_alpha": 8}))
    with pytest.raises(LoRAAdapterError, match="no 'r'"):
        _read(str(tmp_path / "empty"), hf_config)


def test_moe_experts_are_read_per_expert_and_bad_expert_modules_refused(tmp_path):
    """qwen3_moe: attention everywhere, the dense layer's MLP and the sparse layers' routed experts (PEFT's per-expert
    names) are read (expert pairs apart: A [r, in], B^T scaled [r, out]); an expert past the layer's, a wrong shape,
    the router, a shared expert the model lacks, a dense name on a sparse layer and PEFT fused-experts pairs of the
    wrong shapes are refused naming them."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from voltllm.lora.adapter import expert_shapes

    model = make_model(str(tmp_path / "moe"), "qwen3_moe")
    cfg = AutoConfig.from_pretrained(model)
    shapes = projection_shapes(cfg)
    assert "layers.1.mlp.gate_up_proj" in shapes and "layers.0.mlp.gate_up_proj" not in shapes  # layer 1 is dense
    assert set(expert_shapes(cfg)) == {"layers.0.mlp.experts", "layers.2.mlp.experts"}
    path = make_adapter(str(tmp_path / "attn"), model, rank=4, targets=("q_proj", "o_proj"))
    adapter = _read(path, cfg)
    assert len(adapter.weights) == 2 * cfg.num_hidden_layers and not adapter.experts and not adapter.has_experts
    path = make_adapter(str(tmp_path / "experts"), model, rank=4, alpha=8, targets=("experts", "k_proj"))
    adapter = _read(path, cfg)
    assert adapter.has_experts and set(adapter.experts) == {"layers.0.mlp.experts", "layers.2.mlp.experts"}
    pairs = adapter.experts["layers.2.mlp.experts"]
    assert set(pairs) == {(e, k) for e in range(8) for k in ("gate", "up", "down")}
    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    a = raw["base_model.model.model.layers.2.mlp.experts.5.down_proj.lora_A.weight"]
    b = raw["base_model.model.model.layers.2.mlp.experts.5.down_proj.lora_B.weight"]
    assert torch.allclose(pairs[(5, "down")][0], a) and torch.allclose(pairs[(5, "down")][1], 2 * b.t())
    assert tuple(pairs[(5, "gate")][0].shape) == (4, 64) and tuple(pairs[(5, "gate")][1].shape) == (4, 48)
    bad = {"mlp.experts.8.gate_proj": ("expert 8 is past layer 0's 8 experts", 64, 48),
           "mlp.experts.3.up_proj": ("this model needs lora_A (4, 64) and lora_B (48, 4)", 64, 40),
           "mlp.gate": ("LoRA on the MoE's gate is not built", 64, 8),
           "mlp.shared_expert.gate_proj": ("sparse MoE has no shared_expert.gate_proj", 64, 8),
           "mlp.down_proj": ("layer 0's MLP is a sparse MoE (no dense down_proj", 48, 64),
           # PEFT's target_parameters form with a rank-4 pair: it needs r x E = 32 rows / columns
           "mlp.experts": ("(fused experts) has lora_A (4, 64) and lora_B (48, 4); this model's 8 experts need "
                           "lora_A (32, 64) and lora_B (96, 32) for gate_up_proj", 64, 48),
           "mlp.experts.base_layer": ("(fused experts) has lora_A (4, 64)", 64, 48),
           "mlp.experts.gate_up_proj": ("not a routed expert's module", 64, 96)}
    for i, (module, (match, n_in, n_out)) in enumerate(bad.items()):
        name = f"base_model.model.model.layers.0.{module}"
        extra = {f"{name}.lora_A.weight": torch.zeros(4, n_in), f"{name}.lora_B.weight": torch.zeros(n_out, 4)}
        with pytest.raises(LoRAAdapterError, match=re.escape(match)):
            _read(make_adapter(str(tmp_path / f"bad{i}"), model, rank=4, targets=("k_proj",), extra_tensors=extra),
                  cfg)


def test_expert_slots_beyond_the_experts_own_size_are_refused(tmp_path):
    """--max-loras x experts x --max-lora-rank x 3 (hidden + inter) per MoE layer must not exceed the experts' own
    values: a ValueError naming the flags to lower (tiny qwen3_moe: hidden 64, inter 48: slots x rank <= 27)."""
    from transformers import AutoConfig

    from voltllm.lora.adapter import expert_shapes
    from voltllm.lora.manager import check_expert_slots

    cfg = AutoConfig.from_pretrained(make_model(str(tmp_path / "moe"), "qwen3_moe"))
    experts = expert_shapes(cfg)
    check_expert_slots(experts, 3, 8)
    check_expert_slots({}, 64, 512)  # (a dense model: no expert slots)
    with pytest.raises(ValueError, match=r"MoE experts' LoRA slots would hold .* lower --max-loras or "
                                         r"--max-lora-rank"):
        check_expert_slots(experts, 4, 8)


# -- the per-token delta -------------------------------------------------------------------------------------------
def test_a_batch_mixing_slots_gives_each_token_its_own_adapter():
    """Three slots of different ranks in a merged [4, 2, 2]-row projection: each token's output is the base product
    plus exactly its slot's (x A^T) B^T per shard, zero for tokens without an adapter; rows past the step unused."""
    from voltllm.lora.layers import LoRABatch, LoRAWeights

    torch.manual_seed(0)
    shards, k, slots, max_rank = [4, 2, 2], 6, 3, 8
    batch = LoRABatch(16, slots, torch.float64, torch.device("cpu"))
    w = LoRAWeights(shards, k, batch, slots, max_rank, torch.float64, torch.device("cpu"))
    adapters = {}
    for slot, rank in ((0, 8), (1, 3), (2, 1)):
        adapters[slot] = {s: (torch.randn(rank, k, dtype=torch.float64), torch.randn(rank, n, dtype=torch.float64))
                          for s, n in enumerate(shards) if not (slot == 2 and s == 1)}  # slot 2: no shard 1
        w.load_slot(slot, {s: (a.clone(), bt.clone()) for s, (a, bt) in adapters[slot].items()})
    token_slots = [0, -1, 2, 1, 1, -1, 0, 2]  # -1: no adapter
    t = len(token_slots)
    batch.mask.fill_(7.0)  # stale rows past the step must not matter
    batch.mask[:t].zero_()
    for i, s in enumerate(token_slots):
        if s >= 0:
            batch.mask[i, s] = 1.0
    x, y = torch.randn(t, k, dtype=torch.float64), torch.randn(t, sum(shards), dtype=torch.float64)
    out = w.add_to(x, y.clone())
    for i, s in enumerate(token_slots):
        want = y[i].clone()
        for shard, (a, bt) in (adapters[s].items() if s >= 0 else ()):
            off = sum(shards[:shard])
            want[off:off + shards[shard]] += (x[i] @ a.t()) @ bt
        assert torch.allclose(out[i], want), i
    w.load_slot(1, None)  # emptied: its tokens get the base product
    batch.active = True
    out = w.add_to(x, y.clone())
    assert torch.allclose(out[3], y[3]) and torch.allclose(out[4], y[4])
    batch.active = False  # an eager step without adapters: nothing added
    assert torch.equal(w.add_to(x, y.clone()), y)


# -- flags and configuration ---------------------------------------------------------------------------------------
def test_the_lora_flags_parse_into_engine_args():
    from voltllm.cli import build_parser
    from voltllm.cli_args import engine_args_from

    args = build_parser().parse_args(["serve", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "64",
                                      "--max-cpu-loras", "5", "--lora-dtype", "auto", "--lora-modules", "a=/x",
                                      '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    ea = engine_args_from(args)
    assert (ea.enable_lora, ea.max_loras, ea.max_lora_rank, ea.max_cpu_loras, ea.lora_dtype) == (True, 3, 64, 5,
                                                                                                  "auto")
    assert [(m.name, m.path, m.base_model_name) for m in args.lora_modules] == [("a", "/x", None), ("b", "/y", "m")]
    off = engine_args_from(build_parser().parse_args(["serve", "m", "--no-enable-lora", "--max-lora-rank", "16"]))
    assert off.enable_lora is False


@pytest.mark.parametrize("value,match", [("a", "neither name=path nor a JSON object"), ("=p", "expected name=path"),
                                         ('{"name": "a"}', 'needs a "name" and a "path"'),
                                         ('{"name": "a", "path": "p", "x": 1}', "unknown keys: x"),
                                         ("[1]", "the JSON form is an object")])
def test_lora_modules_values_are_checked(value, match):
    from voltllm.lora.modules import lora_module_arg

    with pytest.raises(argparse.ArgumentTypeError, match=match):
        lora_module_arg(value)


def _config(tiny, **kw):
    return EngineArgs(model=tiny, device="cpu", **kw).create_engine_config()


def test_lora_config_is_typed_and_checked(tiny, tmp_path):
    lc = _config(tiny, enable_lora=True, max_loras=2, max_lora_rank=32).lora
    assert (lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras, lc.lora_dtype) == (2, 32, 2, torch.float32)
    assert _config(tiny).lora is None
    assert _config(tiny, enable_lora=False, max_lora_rank=17).lora is None  # (off: its settings are not checked)
    for kw, match in ((dict(max_lora_rank=17), "--max-lora-rank 17: must be one of 1, 8, 16"),
                      (dict(max_loras=0), "--max-loras must be >= 1"),
                      (dict(max_loras=3, max_cpu_loras=2), "--max-cpu-loras 2 must be >= --max-loras 3"),
                      (dict(lora_dtype="float16"), "--lora-dtype float16: adapters run in the model's dtype"),
                      (dict(runner="pooling"), "--enable-lora with --runner pooling")):
        with pytest.raises(ConfigError, match=match):
            _config(tiny, enable_lora=True, **kw)
    # every method: host-side drafts, and a draft model (device drafters propose without the adapter; the target
    # verifies with it: tests/model/test_lora_engine.py)
    for spec in ({"method": "ngram", "num_speculative_tokens": 2}, {"method": "suffix"},
                 {"model": tiny, "num_speculative_tokens": 2}):
        assert _config(tiny, enable_lora=True, lora_dtype="float32", speculative_config=spec).lora is not None
    # tensor parallelism: each rank holds its cut of the adapters (lora/sharding.py)
    tp = _config(tiny, enable_lora=True, tensor_parallel_size=2)
    assert tp.lora is not None and tp.parallel.tensor_parallel_size == 2


def test_hybrid_models_take_adapters_and_other_architectures_are_refused(tmp_path):
    from types import SimpleNamespace

    from tiny_models import make_tiny_hybrid
    from voltllm.lora.adapter import lora_architecture_error

    path = make_tiny_hybrid(str(tmp_path / "h"), "qwen3_5", seed=0, gen_seed=0)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    assert _config(path, enable_lora=True).lora is not None
    assert _config(path, enable_lora=True, tensor_parallel_size=2).lora is not None  # (cut by the model's tp_part)
    assert "not 'gemma2'" in lora_architecture_error(SimpleNamespace(model_type="gemma2"))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_hybrid_modules_are_mapped_and_the_others_refused_by_name(tmp_path, kind):
    """A hybrid's layers 0-2 are Gated DeltaNet, 3 full attention (make_tiny_hybrid): each takes its own modules;
    another layer kind's module, a MoE layer's MLP (experts, router, shared expert) are refused naming them."""
    from transformers import AutoConfig

    from tiny_models import make_tiny_hybrid, small_moe
    from voltllm.lora.adapter import peft_modules

    path = make_tiny_hybrid(str(tmp_path / kind), kind, seed=0, gen_seed=0, **small_moe(kind))
    if path is None:
        pytest.skip(f"this transformers has no {kind}")
    cfg = AutoConfig.from_pretrained(path)
    shapes, modules = projection_shapes(cfg), peft_modules(cfg)
    assert shapes["layers.3.self_attn.qkv_proj"].shard_sizes == (2 * 4 * 32, 2 * 32, 2 * 32)  # q_proj: [q | gate]
    assert shapes["layers.0.linear_attn.in_proj"].shard_sizes == (32, 32, 64, 64, 4, 4)
    gdn = ("in_proj_qkvz", "in_proj_ba") if kind == "qwen3_next" else ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                      "in_proj_a")
    assert {m.rpartition(".")[2] for m in modules if m.startswith("layers.0.") and ".shared_expert." not in m} == \
        set(gdn) | {"out_proj"} | ({"gate_proj", "up_proj", "down_proj"} if kind == "qwen3_5" else set())
    covered = sorted(pc.shard for m in gdn for pc in modules[f"layers.0.linear_attn.{m}"])
    assert covered == [0, 1, 2, 3, 4, 5]  # (every in_proj shard, once)
    adapter = _read(make_adapter(str(tmp_path / "all"), path, rank=4, targets=_HYBRID_TARGETS), cfg)
    assert adapter.weights["layers.1.linear_attn.in_proj"].keys() == {0, 1, 2, 3, 4, 5}
    bad = {"base_model.model.model.layers.0.self_attn.q_proj": ("layer 0 has no self_attn module (it is a Gated "
                                                                "DeltaNet (linear_attn) layer)", 64),
           "base_model.model.model.layers.3.linear_attn.out_proj": ("layer 3 has no linear_attn module (it is a "
                                                                    "full attention (self_attn) layer)", 64),
           "base_model.model.model.layers.1.linear_attn.conv1d": ("LoRA on linear_attn.conv1d is not built", 4)}
    if kind != "qwen3_5":  # (the shared expert's and the experts' modules are taken: tests/model/test_lora_moe.py)
        assert modules["layers.0.mlp.shared_expert.up_proj"][0].linear == "layers.0.mlp.shared_expert.gate_up_proj"
        bad["base_model.model.model.layers.0.mlp.shared_expert_gate"] = ("LoRA on the MoE's shared_expert_gate", 64)
        bad["base_model.model.model.layers.0.mlp.experts.9.up_proj"] = ("past layer 0's 4 experts", 64)
        bad["base_model.model.model.layers.2.mlp.gate_proj"] = ("sparse MoE", 64)
    for i, (module, (match, n_in)) in enumerate(bad.items()):
        extra = {f"{module}.lora_A.weight": torch.zeros(4, n_in), f"{module}.lora_B.weight": torch.zeros(8, 4)}
        with pytest.raises(LoRAAdapterError, match=re.escape(match)):
            _read(make_adapter(str(tmp_path / f"bad{i}"), path, rank=4, targets=("k_proj",), extra_tensors=extra),
                  cfg)
    # a multimodal Qwen3.5's adapters name the text model's layers under language_model
    mm = {"base_model.model.model.language_model.layers.3.self_attn.k_proj.lora_A.weight": torch.zeros(4, 64),
          "base_model.model.model.language_model.layers.3.self_attn.k_proj.lora_B.weight": torch.zeros(64, 4)}
    mm_path = make_adapter(str(tmp_path / "mm"), path, rank=4, targets=(), extra_tensors=mm)
    assert list(_read(mm_path, cfg).weights) == ["layers.3.self_attn.qkv_proj"]


def test_lora_modules_are_checked_before_the_engine_starts(tiny, tmp_path):
    from voltllm.lora.modules import LoRAModulePath, resolve_lora_modules

    good = make_adapter(str(tmp_path / "good"), tiny, rank=8, targets=("q_proj",))
    wide = make_adapter(str(tmp_path / "wide"), tiny, rank=32, targets=("q_proj",))
    config = _config(tiny, enable_lora=True, max_lora_rank=16)
    loras = resolve_lora_modules([LoRAModulePath("g", good), LoRAModulePath("h", good, "tiny")], config, ["tiny"])
    assert [(r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name) for r in loras.values()] == [
        ("g", 1, good, None), ("h", 2, good, "tiny")]
    for modules, match in (([LoRAModulePath("w", wide)], "--lora-modules w: LoRA adapter 'w' .*rank 32 is greater"),
                           ([LoRAModulePath("g", good)] * 2, "the name 'g' is given twice"),
                           ([LoRAModulePath("tiny", good)], "'tiny' is already a served model name"),
                           ([LoRAModulePath("g", good, "other")], "base_model_name 'other' is not a served"),
                           ([LoRAModulePath("g", str(tmp_path / "nope"))], "no such directory")):
        with pytest.raises(ConfigError, match=match):
            resolve_lora_modules(modules, config, ["tiny"])
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        resolve_lora_modules([LoRAModulePath("g", good)], _config(tiny), ["tiny"])


def test_serve_refuses_lora_modules_without_enable_lora(tiny, tmp_path, capsys):
    from voltllm.cli import main

    good = make_adapter(str(tmp_path / "good"), tiny, rank=8, targets=("q_proj",))
    assert main(["serve", tiny, "--device", "cpu", "--lora-modules", f"g={good}"]) == 2
    assert "voltllm: error: --lora-modules needs --enable-lora" in capsys.readouterr().err


def test_lora_request_checks_its_fields():
    r = LoRARequest("sql", 3, "/p")
    assert (r.name, r.adapter_id, r.path) == ("sql", 3, "/p")
    for args, match in ((("", 1, "/p"), "lora_name"), (("a", 0, "/p"), "lora_int_id must be an integer > 0"),
                        (("a", 1), "lora_path")):
        with pytest.raises(ValueError, match=match):
            LoRARequest(*args)


# -- prefix-cache keys ---------------------------------------------------------------------------------------------
def test_block_hashes_differ_by_adapter_and_keep_plain_ones():
    from voltllm.cache.prefix import extend_block_hashes, hash_block

    tokens = list(range(12))

    def hashes(**kw):
        out: list[bytes] = []
        extend_block_hashes(out, tokens, 4, **kw)
        return out

    from voltllm.lora.manager import LoRAKey

    a_key = LoRAKey("a", 1)
    plain, a, b = hashes(), hashes(lora_key=a_key), hashes(lora_key=LoRAKey("b", 2))
    assert plain[0] == hash_block(None, tokens[:4])  # unchanged for requests without an adapter
    assert all(len({plain[i], a[i], b[i]}) == 3 for i in range(3))  # every block, through the chain
    assert hashes(lora_key=LoRAKey("a", 1)) == a
    # a reload of "a" (a new key: removed, or loaded in place) does not read the old load's blocks
    assert all(x != y for x, y in zip(hashes(lora_key=LoRAKey("a", 3)), a))
    # a cache salt cannot stand for an adapter, and a salted adapter request is its own tenant
    assert hashes(cache_salt="a") != a and hashes(cache_salt="('lora', 'a', 1)") != a
    assert hashes(cache_salt="t", lora_key=a_key) not in (a, hashes(cache_salt="t"))


def test_cudagraph_specialize_lora_is_taken_at_false():
    """One graph set computes the LoRA terms for every batch (vLLM's cudagraph_specialize_lora false); separate graphs
    for batches without adapters (its default, true) are not built."""
    from voltllm.cuda_graph_config import CompilationConfigError, resolve_cuda_graphs

    assert resolve_cuda_graphs({"cudagraph_specialize_lora": False}).mode == "FULL_AND_PIECEWISE"
    with pytest.raises(CompilationConfigError, match="cudagraph_specialize_lora true: graphs specialized"):
        resolve_cuda_graphs({"cudagraph_specialize_lora": True})


def test_serve_refuses_runtime_lora_updating_without_enable_lora(tiny, capsys):
    from voltllm.cli import main

    assert main(["serve", tiny, "--device", "cpu", "--allow-runtime-lora-updating"]) == 2
    assert "voltllm: error: --allow-runtime-lora-updating loads LoRA adapters at run time: add --enable-lora" in \
        capsys.readouterr().err


def test_a_request_naming_an_adapter_unloaded_meanwhile_is_a_404_not_the_base_model():
    """ServerState.lora_request (called as the request is submitted, after its name was checked): an adapter unloaded
    in between must not run the request on the base model."""
    from voltllm.entrypoints.openai.errors import OpenAIError
    from voltllm.entrypoints.openai.serving_common import ServerState

    lora = LoRARequest("a", 1, "/p")
    state = ServerState(engine=None, served_model_names=["tiny"], max_model_len=64, model_path="/m",
                        lora_modules={"a": lora})
    assert state.lora_request("a") is lora and state.lora_request("tiny") is None and state.lora_request(None) is None
    del state.lora_modules["a"]  # /v1/unload_lora_adapter
    with pytest.raises(OpenAIError) as e:
        state.lora_request("a")
    assert e.value.status == 404 and e.value.code == "model_not_found"
