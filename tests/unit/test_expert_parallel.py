"""--enable-expert-parallel (-ep) without processes: vLLM's linear placement and expert map, the flag's parsing and
refusals, a sparse MoE layer whose ranks hold whole experts (their outputs before the all-reduce add up to the whole
layer's), and the safetensors loader reading a rank's experts only."""
import json

import pytest
import torch

from voltllm.cli import build_parser
from voltllm.cli_args import engine_args_from
from voltllm.config import ConfigError, EngineArgs
from voltllm.distributed.experts import ExpertShard
from voltllm.model.layers.moe import SparseMoE

H, K, I, IS = 32, 2, 24, 24  # noqa: E741 (hidden, top-k, expert and shared-expert intermediate sizes)


# --- placement ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts,size,want", [
    (8, 2, [(0, 4), (4, 4)]),
    (7, 2, [(0, 4), (4, 3)]),  # vLLM: the first E % N ranks hold one more
    (6, 4, [(0, 2), (2, 2), (4, 1), (5, 1)]),
    (128, 8, [(16 * r, 16) for r in range(8)]),
])
def test_linear_placement(experts, size, want):
    shards = [ExpertShard.of(experts, r, size) for r in range(size)]
    assert [(s.start, s.count) for s in shards] == want
    for s in shards:
        m = s.expert_map().tolist()
        assert m[:experts] == [e - s.start if s.start <= e < s.start + s.count else -1 for e in range(experts)]
        assert m[experts] == s.count  # moe_route's shared-expert entry -> the local shared id
        assert m[:experts].count(-1) == experts - s.count


def test_a_rank_reads_its_experts_tensors_only():
    s = ExpertShard.of(8, 1, 2)  # experts 4..7
    assert s.reads("model.layers.0.mlp.experts.5.down_proj.weight")
    assert s.reads("model.layers.3.mlp.experts.7.gate_proj.qweight")  # (every part of a quantized expert)
    assert not s.reads("model.layers.0.mlp.experts.3.up_proj.weight")
    assert not s.reads("model.language_model.layers.1.mlp.experts.0.gate_proj.weight_packed")
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert.down_proj.weight",
                 "model.layers.0.mlp.experts.gate_up_proj", "model.embed_tokens.weight",
                 "model.layers.0.self_attn.q_proj.weight"):
        assert s.reads(name), name


# --- flag, config, refusals -------------------------------------------------------------------------------------
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
       "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
DENSE = {k: v for k, v in MOE.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
DENSE.update(architectures=["LlamaForCausalLM"], model_type="llama")


def _dir(tmp_path, cfg) -> str:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _config(tmp_path, cfg, tp, **kw):
    return EngineArgs(model=_dir(tmp_path, cfg), tensor_parallel_size=tp, device="cpu",
                      **kw).create_engine_config()


@pytest.mark.parametrize("words,want", [
    ([], False), (["--enable-expert-parallel"], True), (["-ep"], True), (["--enable_expert_parallel"], True),
    (["-ep", "--no-enable-expert-parallel"], False),
])
def test_flag_parses(words, want):
    from voltllm.cli import dashed_flags

    ns = build_parser().parse_args(dashed_flags(["serve", "m", "-tp", "2", *words]))
    args = engine_args_from(ns)
    assert args.enable_expert_parallel is want and args.expert_placement_strategy == "linear"


def test_moe_model_under_tp_places_whole_experts(tmp_path):
    config = _config(tmp_path, MOE, 2, enable_expert_parallel=True)
    assert config.parallel.enable_expert_parallel and config.parallel.tensor_parallel_size == 2
    assert not _config(tmp_path, MOE, 2).parallel.enable_expert_parallel


def test_one_rank_is_a_no_op_as_in_vllm(tmp_path):
    assert not _config(tmp_path, MOE, 1, enable_expert_parallel=True).parallel.enable_expert_parallel


@pytest.mark.parametrize("tp", [1, 2])
def test_a_model_without_experts_is_refused_as_in_vllm(tmp_path, tp):
    with pytest.raises(ConfigError, match=r"--enable-expert-parallel: the model \('llama'\) has no routed experts"):
        _config(tmp_path, DENSE, tp, enable_expert_parallel=True)


def test_fewer_experts_than_ranks_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="the model's 2 experts are fewer than the 4 ranks") as e:
        _config(tmp_path, {**MOE, "num_experts": 2}, 4, enable_expert_parallel=True)
    assert "\n" not in str(e.value)


def test_whole_experts_need_no_divisible_expert_width(tmp_path):
    """An expert width -tp cannot split is refused without -ep and runs with it (the shared expert and the dense
    MLP are still split); 7 experts over 2 ranks are fine too (4 + 3)."""
    odd = {**MOE, "moe_intermediate_size": 33, "num_experts": 7}
    with pytest.raises(ConfigError, match="MoE intermediate size 33 does not divide by 2"):
        _config(tmp_path, odd, 2)
    assert _config(tmp_path, odd, 2, enable_expert_parallel=True).parallel.enable_expert_parallel


def test_quantized_group_rule_leaves_whole_experts_alone():
    """AWQ groups of 128: 128 expert rows at -tp 4 (32 per rank cut a group; one group cannot go whole to 4 ranks)
    are refused without -ep, and 384 rows at -tp 2 are split in whole groups (2 + 1); whole experts are never cut, so
    with -ep only the attention, dense-MLP and shared-expert widths count."""
    from types import SimpleNamespace

    from voltllm.distributed.support import intermediate_alignment, quantized_split_error

    cfg = SimpleNamespace(**{**MOE, "hidden_size": 512, "num_attention_heads": 4, "head_dim": 128,
                             "intermediate_size": 1024, "moe_intermediate_size": 128,
                             "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                     "zero_point": True, "version": "gemm"}})
    assert "MoE intermediate size 128 / 4" in quantized_split_error(4, cfg, "awq")
    assert quantized_split_error(4, cfg, "awq", expert_parallel=True) is None
    cfg.moe_intermediate_size = 384  # 3 groups over 2 ranks: whole groups 2 + 1 without -ep, whole experts with it
    assert intermediate_alignment(2, cfg, "awq") == 128
    assert intermediate_alignment(2, cfg, "awq", expert_parallel=True) == 1


def test_placement_strategy(tmp_path, caplog):
    """linear is vLLM's default; round_robin falls back to it with a warning, as vLLM does for models without expert
    groups (none of the MoE models voltllm runs has them)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="voltllm"):
        config = _config(tmp_path, MOE, 2, enable_expert_parallel=True, expert_placement_strategy="round_robin")
    assert config.parallel.enable_expert_parallel and "placed linearly" in caplog.text
    with pytest.raises(ConfigError, match="--expert-placement-strategy striped: not a placement"):
        _config(tmp_path, MOE, 2, enable_expert_parallel=True, expert_placement_strategy="striped")


@pytest.mark.parametrize("flag", ["--enable-eplb", "--all2all-backend"])
def test_load_balancer_and_all_to_all_stay_refused(capsys, flag):
    from voltllm.cli import main

    assert main(["serve", "m", "-tp", "2", "-ep", flag, "naive"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"voltllm: error: {flag}: ") and "not built" in err


def test_offline_llm_keyword_reaches_the_config(tmp_path):
    """LLM(enable_expert_parallel=True) is an EngineArgs field (no longer an unbuilt vLLM keyword)."""
    from voltllm.cli_unbuilt import unbuilt_setting_error

    assert unbuilt_setting_error("enable_expert_parallel", True) is None
    assert "enable_expert_parallel" in EngineArgs.field_names()


# --- the layer ------------------------------------------------------------------------------------------------
class _Rank:
    """A stand-in tensor-parallel group that places whole experts; the all-reduce is left to the test."""

    expert_parallel = True

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce_(self, x):
        return x


def _weights(e: int, seed: int, layout: str) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    w = {"gate.weight": rnd(e, H), "shared_expert_gate.weight": rnd(1, H),
         "shared_expert.gate_proj.weight": rnd(IS, H), "shared_expert.up_proj.weight": rnd(IS, H),
         "shared_expert.down_proj.weight": rnd(H, IS)}
    gate, up, down = rnd(e, I, H), rnd(e, I, H), rnd(e, H, I)
    if layout == "per-expert":
        for i in range(e):
            w[f"experts.{i}.gate_proj.weight"], w[f"experts.{i}.up_proj.weight"] = gate[i], up[i]
            w[f"experts.{i}.down_proj.weight"] = down[i]
    else:  # transformers' stacked modules, [E, out, in] or (Qwen3-VL-MoE style) [E, in, out]
        gate_up = torch.cat([gate, up], dim=1)
        tr = layout == "stacked-transposed"
        w["experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous() if tr else gate_up
        w["experts.down_proj"] = down.transpose(1, 2).contiguous() if tr else down
    return w


def _layer(weights: dict, e: int, tp=None) -> SparseMoE:
    moe = SparseMoE(H, e, K, I, IS, True, torch.float32, tp=tp)
    loaded = set()
    for name, t in weights.items():
        loaded.update(moe.load_hf_weight(name, t.clone(), "mlp."))
    assert loaded == moe.expected_weight_keys("mlp.")
    return moe


@pytest.mark.parametrize("layout", ["per-expert", "stacked", "stacked-transposed"])
@pytest.mark.parametrize("e,size", [(6, 2), (6, 4), (7, 3)])
def test_ranks_hold_whole_experts_and_add_up_to_the_layer(layout, e, size):
    weights = _weights(e, 0, layout)
    whole = _layer(weights, e)
    parts = [_layer(weights, e, _Rank(r, size)) for r in range(size)]
    for r, part in enumerate(parts):
        s = ExpertShard.of(e, r, size)
        assert part.num_local_experts == s.count and part.inter == I  # whole experts: every intermediate row
        assert part.w13.shape == (s.count, 2 * I, H) and part.w2.shape == (s.count, H, I)
        assert torch.equal(part.w13, whole.w13[s.start:s.start + s.count])
        assert torch.equal(part.w2, whole.w2[s.start:s.start + s.count])
        assert part.shared_expert.down_proj.in_features == IS // size  # the shared expert: still split by rows
        assert part.gate.weight.shape == (e, H)  # the router scores every expert on every rank
        keys = part.expected_weight_keys("mlp.")
        assert {k.split(".")[2] for k in keys if ".experts." in k} == {str(i) for i in range(s.start,
                                                                                          s.start + s.count)}
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = whole(x)
        total = sum(part(x) for part in parts)
    assert torch.allclose(total, ref, atol=1e-5, rtol=0), (total - ref).abs().max()


def test_another_ranks_expert_tensor_is_skipped():
    moe = SparseMoE(H, 4, K, I, 0, True, torch.float32, tp=_Rank(0, 2))
    before = moe.w13.clone()
    assert moe.load_hf_weight("experts.3.gate_proj.weight", torch.ones(I, H), "mlp.") == []
    assert torch.equal(moe.w13, before) and moe.w13.shape[0] == 2


def _q8_experts(e: int, inter: int, h: int = 64) -> dict:
    from voltllm.model.layers.gguf_planes import random_blocks
    from voltllm.model.layers.quantized_linear import GGUFBlocks

    g = torch.Generator().manual_seed(2)
    w = {"gate.weight": torch.randn(e, h, generator=g) * 0.3}
    for i in range(e):
        for kind, (n, k) in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
            w[f"experts.{i}.{kind}_proj.weight"] = GGUFBlocks("Q8_0", random_blocks("Q8_0", n, k, g), n, k)
    return w


def test_quantized_experts_stay_whole():
    """Experts kept quantized (Q8_0 planes): a rank's planes hold its experts' every row and input column, so a
    width whose 1/4 share would cut a 64-input group (128 rows: 32 per rank, refused under plain -tp 4) is fine."""
    e, inter = 6, 128
    weights = _q8_experts(e, inter)

    def layer(tp=None):
        moe = SparseMoE(64, e, K, inter, 0, True, torch.float32, quantized_experts=True, tp=tp)
        for name, t in weights.items():
            moe.load_hf_weight(name, t, "layers.0.mlp.")
        return moe

    whole, parts = layer(), [layer(_Rank(r, 4)) for r in range(4)]
    for r, part in enumerate(parts):
        q = part.qexperts
        assert q.ready and q.num_experts == ExpertShard.of(e, r, 4).count and q.inter == inter
        assert q.w13.n == q.num_experts * 2 * inter and q.w2.n == q.num_experts * 64 and q.w2.k == inter
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, total = whole(x), sum(p(x) for p in parts)
    assert torch.allclose(total, ref, atol=1e-4, rtol=1e-4), (total - ref).abs().max()


# --- loading --------------------------------------------------------------------------------------------------
def test_safetensors_loader_never_reads_other_ranks_experts(tmp_path, monkeypatch):
    """iter_weights(experts=...) asks safetensors for none of the other ranks' expert tensors (their bytes stay on
    disk), in every checkpoint format's per-expert names."""
    from safetensors.torch import save_file

    from voltllm.model.loader import ModelSource, iter_weights

    tensors = {f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.full((2, 2), float(e))
               for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(4, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    read = []
    import safetensors

    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    from types import SimpleNamespace

    got = dict(iter_weights(ModelSource(str(tmp_path), "hf"), SimpleNamespace(), experts=ExpertShard.of(4, 1, 2)))
    assert sorted(got) == sorted(read)
    assert {n.split(".")[5] for n in read if ".experts." in n} == {"2", "3"}
    assert "model.layers.0.mlp.gate.weight" in read
    assert torch.equal(got["model.layers.0.mlp.experts.3.up_proj.weight"], torch.full((2, 2), 3.0))
