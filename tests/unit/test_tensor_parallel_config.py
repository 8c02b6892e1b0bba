"""--tensor-parallel-size: what is refused (one-line ConfigError naming it) and the sharding arithmetic. No engine
is started here."""
import json
from types import SimpleNamespace

import pytest
import torch

from voltllm.config import ConfigError, EngineArgs
from voltllm.distributed.sharding import HeadShard, take_rows, vocab_rows
from voltllm.distributed.support import tensor_parallel_error

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32"}


def _model_dir(tmp_path, **overrides) -> str:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**LLAMA, **overrides}))
    return str(d)


def _config(tmp_path, tp, **overrides):
    return EngineArgs(model=_model_dir(tmp_path, **overrides), tensor_parallel_size=tp,
                      device="cpu").create_engine_config()


def test_tp2_accepted_for_a_dense_llama(tmp_path):
    assert _config(tmp_path, 2).parallel.tensor_parallel_size == 2


def test_tp2_accepted_for_qwen3_moe(tmp_path):
    moe = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert _config(tmp_path, 2, **moe).parallel.tensor_parallel_size == 2


@pytest.mark.parametrize("tp,overrides,words", [
    (3, {}, "4 attention heads do not divide by 3"),
    (2, {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, "3 KV heads"),
    (2, {"intermediate_size": 129}, "intermediate size 129"),
    (0, {}, "must be >= 1"),
    (2, {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 33}, "MoE intermediate size 33 does not divide by 2"),
    (2, {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "not 'mixtral'"),
])
def test_refused_with_one_line(tmp_path, tp, overrides, words):
    with pytest.raises(ConfigError, match="--tensor-parallel-size") as e:
        _config(tmp_path, tp, **overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 2},
                                  {"model": "SELF", "num_speculative_tokens": 2}])
def test_ngram_and_draft_model_speculation_accepted(tmp_path, spec):
    path = _model_dir(tmp_path)
    spec = {k: path if v == "SELF" else v for k, v in spec.items()}
    config = EngineArgs(model=path, tensor_parallel_size=2, device="cpu",
                        speculative_config=spec).create_engine_config()
    assert config.parallel.tensor_parallel_size == 2 and config.speculative.method in ("ngram", "draft_model")


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_mtp_and_dflash_accepted(method):
    """They are split over the ranks as the target's layers (worker/mtp_runner.py, dflash_runner.py)."""
    spec = SimpleNamespace(method=method)
    assert tensor_parallel_error(2, _cfg(**QWEN35), torch.device("cpu"), spec, "dequantized") is None
    # the other checks still apply to them
    err = tensor_parallel_error(3, _cfg(**QWEN35), torch.device("cpu"), spec, "dequantized")
    assert err is not None and "divide" in err


def _cfg(**kw):
    base = dict(model_type="qwen3", num_attention_heads=8, num_key_value_heads=2, intermediate_size=256)
    return SimpleNamespace(**{**base, **kw})


def test_support_rules():
    cpu = torch.device("cpu")
    assert tensor_parallel_error(1, _cfg(model_type="qwen3_next"), cpu, None, "quantized") is None  # tp 1: all
    assert tensor_parallel_error(4, _cfg(), cpu, None, "dequantized") is None  # 2 KV heads replicated twice
    assert tensor_parallel_error(2, _cfg(), cpu, None, "quantized") is None  # kept quantized: split too


AWQ128 = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("tp,method,overrides,words", [
    (2, "awq", dict(quantization_config=AWQ128), None),  # 256 / 2 = 128: whole groups
    (4, "awq", dict(quantization_config=AWQ128), "intermediate size 256 / 4 = 64 inputs per rank is not a multiple "
                                                 "of 128 (AWQ in groups of 128"),
    (2, "gptq", dict(quantization_config={**AWQ128, "quant_method": "gptq", "group_size": -1, "desc_act": False}),
     "GPTQ with one scale per row (group_size -1)"),
    (2, "modelopt_fp4", dict(intermediate_size=192), None),  # 3 groups of 64: 2 on rank 0, 1 on rank 1
    (4, "modelopt_fp4", dict(intermediate_size=192), "intermediate size 192 / 4 = 48 inputs per rank is not a "
                                                     "multiple of 64 (NVFP4"),
    (4, "modelopt_fp4", {}, None),
    (2, "gguf", dict(num_attention_heads=8, head_dim=16), None),  # 64 inputs per rank: whole 64-groups
    (4, "gguf", dict(num_attention_heads=8, head_dim=16), "attention heads x head_dim 128 / 4 = 32 inputs per rank "
                                                          "is not a multiple of 64 (GGUF"),
    (2, "fp8", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), None),
    (4, "fp8", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     "not a multiple of 128 (FP8"),
    (4, "fp8", {}, None),  # quantized at load: the unquantized weight is cut, then quantized
    (2, "awq", dict(model_type="qwen3_moe", num_experts=128, moe_intermediate_size=768, intermediate_size=6144,
                    quantization_config=AWQ128), None),  # Qwen3-30B-A3B: 384 inputs of each expert's down per rank
    # Qwen3-30B-A3B at -tp 4: 192 inputs per rank would cut a group of 128, so the 6 groups go 2, 2, 1, 1
    (4, "awq", dict(model_type="qwen3_moe", num_experts=128, moe_intermediate_size=768, intermediate_size=6144,
                    quantization_config=AWQ128), None),
    (8, "awq", dict(model_type="qwen3_moe", num_experts=128, moe_intermediate_size=512, intermediate_size=8192,
                    num_attention_heads=32, head_dim=128, quantization_config=AWQ128),
     "MoE intermediate size 512 / 8 = 64 inputs per rank is not a multiple of 128 (AWQ in groups of 128: a row-"
     "parallel projection's quantized blocks cannot be split), and its 4 groups are fewer than the ranks"),
    (4, "qwen3_5", dict(model_type="qwen3_5_text", intermediate_size=512, linear_num_key_heads=4,
                        linear_num_value_heads=4, linear_value_head_dim=64, quantization_config=AWQ128),
     "Gated DeltaNet value heads x value dim 256 / 4 = 64 inputs per rank is not a multiple of 128"),
])
def test_quantized_split_rules(tp, method, overrides, words):
    """Weights kept quantized: each rank's inputs of a row-parallel projection must be whole blocks / groups."""
    method = "awq" if method == "qwen3_5" else method
    err = tensor_parallel_error(tp, _cfg(**overrides), torch.device("cpu"), None, "quantized", method)
    if words is None:
        assert err is None, err
    else:
        assert err is not None and words in err and "\n" not in err, err
        assert err.startswith(f"--tensor-parallel-size {tp}: ") and "drop --quantization" in err
    assert tensor_parallel_error(tp, _cfg(**overrides), torch.device("cpu"), None, "dequantized", method) is None


def test_intermediate_alignment_and_split():
    """The ranks' shares of an intermediate dimension: even where that keeps whole groups, else whole groups with the
    first ranks one more; they tile the dimension in order."""
    from types import SimpleNamespace

    from voltllm.distributed.sharding import intermediate_split
    from voltllm.distributed.support import intermediate_alignment

    moe = _cfg(model_type="qwen3_moe", num_experts=128, moe_intermediate_size=768, intermediate_size=6144,
               quantization_config=AWQ128)
    assert intermediate_alignment(4, moe, "awq") == 128 and intermediate_alignment(2, moe, "awq") == 1
    shares = [intermediate_split(768, SimpleNamespace(rank=r, size=4, intermediate_align=128)) for r in range(4)]
    assert shares == [(0, 256), (256, 256), (512, 128), (640, 128)]
    assert intermediate_split(6144, SimpleNamespace(rank=3, size=4, intermediate_align=128)) == (4608, 1536)
    assert intermediate_split(768, SimpleNamespace(rank=1, size=4)) == (192, 192)  # no alignment asked: even


def _awq_dir(tmp_path, group: int) -> str:
    return _model_dir(tmp_path, intermediate_size=256, quantization_config={**AWQ128, "group_size": group})


@pytest.mark.parametrize("setting", ["quantized", "auto"])
def test_misaligned_group_refused_or_dequantized(tmp_path, monkeypatch, setting):
    """--quantization awq (kept quantized) with groups that a rank's inputs would split: a one-line ConfigError;
    "auto" dequantizes at load instead (as a model too small to keep quantized)."""
    import voltllm.config

    monkeypatch.setattr(voltllm.config, "_quantized_weights", lambda *a, **k: setting)
    args = EngineArgs(model=_awq_dir(tmp_path, 128), tensor_parallel_size=4, device="cpu")
    if setting == "auto":
        assert args.create_engine_config().model.quantized_weights == "dequantized"
        return
    with pytest.raises(ConfigError, match="--tensor-parallel-size 4") as e:
        args.create_engine_config()
    assert "not a multiple of 128 (AWQ in groups of 128" in str(e.value) and "\n" not in str(e.value)


def test_kept_quantized_accepted_when_aligned(tmp_path, monkeypatch):
    import voltllm.config

    monkeypatch.setattr(voltllm.config, "_quantized_weights", lambda *a, **k: "quantized")
    path = _model_dir(tmp_path, hidden_size=128, intermediate_size=256,
                      quantization_config={**AWQ128, "group_size": 32})
    config = EngineArgs(model=path, tensor_parallel_size=2, device="cpu").create_engine_config()
    assert config.model.quantized_weights == "quantized" and config.parallel.tensor_parallel_size == 2


# a Qwen3.5-27B-shaped dense hybrid: 24 q / 4 KV heads, GDN 16 key / 48 value heads
QWEN35 = dict(model_type="qwen3_5_text", num_attention_heads=24, num_key_value_heads=4, intermediate_size=17408,
              linear_num_key_heads=16, linear_num_value_heads=48)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_dense_hybrid_accepted(tp):
    assert tensor_parallel_error(tp, _cfg(**QWEN35), torch.device("cpu"), None, "dequantized") is None


def test_multimodal_dense_hybrid_reads_its_text_config():
    outer = SimpleNamespace(model_type="qwen3_5", text_config=_cfg(**QWEN35))
    assert tensor_parallel_error(4, outer, torch.device("cpu"), None, "dequantized") is None
    outer = SimpleNamespace(model_type="qwen3_5", text_config=_cfg(**{**QWEN35, "linear_num_key_heads": 6,
                                                                      "linear_num_value_heads": 18}))
    assert "6 Gated DeltaNet key heads do not divide by 4" in tensor_parallel_error(
        4, outer, torch.device("cpu"), None, "dequantized")


@pytest.mark.parametrize("tp,overrides,words", [
    (3, {}, "16 Gated DeltaNet key heads do not divide by 3"),
    (4, {"linear_num_key_heads": 2, "linear_num_value_heads": 8}, "2 Gated DeltaNet key heads do not divide by 4"),
    (16, {}, "24 attention heads do not divide by 16"),
    (2, {"intermediate_size": 17407}, "intermediate size 17407"),
    (2, {"num_experts": 8, "moe_intermediate_size": 96, "shared_expert_intermediate_size": 17},
     "shared-expert intermediate size 17 does not divide by 2"),
    (4, {"num_experts": 8, "moe_intermediate_size": 98}, "MoE intermediate size 98 does not divide by 4"),
])
def test_dense_hybrid_refusals(tp, overrides, words):
    err = tensor_parallel_error(tp, _cfg(**{**QWEN35, **overrides}), torch.device("cpu"), None, "dequantized")
    assert err is not None and words in err and "\n" not in err and err.startswith(f"--tensor-parallel-size {tp}")


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"])
def test_moe_hybrids_accepted(kind):
    moe = {"model_type": kind, "num_experts": 8, "moe_intermediate_size": 96, "shared_expert_intermediate_size": 64}
    assert tensor_parallel_error(2, _cfg(**{**QWEN35, **moe}), torch.device("cpu"), None, "dequantized") is None


def test_more_ranks_than_gpus_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = tensor_parallel_error(2, _cfg(), torch.device("cuda"), None, "dequantized")
    assert err == "--tensor-parallel-size 2: needs 2 CUDA devices from cuda:0, but 1 are visible"


@pytest.mark.parametrize("heads,kv,tp", [(8, 8, 2), (8, 2, 2), (8, 2, 4), (8, 1, 8), (32, 8, 4), (16, 2, 8)])
def test_head_shards_cover_and_match_their_kv_groups(heads, kv, tp):
    group = heads // kv
    seen = []
    for rank in range(tp):
        s = HeadShard.of(heads, kv, rank, tp)
        seen += range(s.q_start, s.q_start + s.num_heads)
        for q in range(s.q_start, s.q_start + s.num_heads):  # every local query head reads a local KV head
            assert s.kv_start <= q // group < s.kv_start + s.num_kv_heads
        # local GQA grouping equals the global one (local query j reads local KV j // (local group))
        assert s.num_heads % s.num_kv_heads == 0
        assert (s.q_start // group) - s.kv_start == 0
    assert seen == list(range(heads))


def test_vocab_rows_pad_the_last_shard():
    full = torch.arange(5 * 2, dtype=torch.float32).view(5, 2)
    n = vocab_rows(5, 2)
    assert n == 3
    assert torch.equal(torch.cat([take_rows(full, 0, n), take_rows(full, n, n)])[:5], full)
    assert torch.equal(take_rows(full, n, n)[-1], torch.zeros(2))
