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


@pytest.mark.parametrize("tp,overrides,words", [
    (3, {}, "4 attention heads do not divide by 3"),
    (2, {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, "3 KV heads"),
    (2, {"intermediate_size": 129}, "intermediate size 129"),
    (0, {}, "must be >= 1"),
    (2, {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32}, "MoE is not supported"),
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
def test_mtp_and_dflash_refused(method):
    """They draft from the target's own hidden states through its embedding / head, which TP shards."""
    spec = SimpleNamespace(method=method)
    err = tensor_parallel_error(2, _cfg(**QWEN35), torch.device("cpu"), spec, "dequantized")
    assert f"speculative method {method!r} is not supported under tensor parallelism" in err and "\n" not in err
    assert tensor_parallel_error(2, _cfg(**QWEN35), torch.device("cpu"), SimpleNamespace(method="ngram"),
                                 "dequantized") is None
    assert tensor_parallel_error(1, _cfg(**QWEN35), torch.device("cpu"), spec, "dequantized") is None


def _cfg(**kw):
    base = dict(model_type="qwen3", num_attention_heads=8, num_key_value_heads=2, intermediate_size=256)
    return SimpleNamespace(**{**base, **kw})


def test_support_rules():
    cpu = torch.device("cpu")
    assert tensor_parallel_error(1, _cfg(model_type="qwen3_next"), cpu, None, "quantized") is None  # tp 1: all
    assert tensor_parallel_error(4, _cfg(), cpu, None, "dequantized") is None  # 2 KV heads replicated twice
    assert "kept quantized" in tensor_parallel_error(2, _cfg(), cpu, None, "quantized")


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
    (2, {"num_experts": 8}, "hybrid + MoE"),
])
def test_dense_hybrid_refusals(tp, overrides, words):
    err = tensor_parallel_error(tp, _cfg(**{**QWEN35, **overrides}), torch.device("cpu"), None, "dequantized")
    assert err is not None and words in err and "\n" not in err and err.startswith(f"--tensor-parallel-size {tp}")


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"])
def test_moe_hybrids_refused(kind):
    err = tensor_parallel_error(2, _cfg(**{**QWEN35, "model_type": kind}), torch.device("cpu"), None, "dequantized")
    assert f"not {kind!r} (hybrid + MoE is not supported under tensor parallelism)" in err and "\n" not in err


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
