"""qwen3moe GGUF files (llama.cpp's Qwen3-30B-A3B layout: each layer's experts stacked into one tensor per
projection): a tiny qwen3_moe written the way llama.cpp's converter lays it out reads back as the HF model (config,
per-expert weights), runs in the engine with the logits of transformers holding the file's weights, and keeps its
experts quantized (gate / up Q8_0, down Q4_0: one kind per stacked weight) with the dequantized model's outputs."""
import shutil

import numpy as np
import pytest
import torch
from gguf_files import writer_with_header
from tiny_models import assert_prompt_logprobs_match, make_model

gguf = pytest.importorskip("gguf")

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}
_EXPERTS = {"gate_proj": ("ffn_gate_exps", gguf.GGMLQuantizationType.Q8_0),
            "up_proj": ("ffn_up_exps", gguf.GGMLQuantizationType.Q8_0),
            "down_proj": ("ffn_down_exps", gguf.GGMLQuantizationType.Q4_0)}


def _write(path: str, cfg, tensors: dict) -> dict:
    """The GGUF file; returns the HF-named float32 weights it holds (after its quantization)."""
    w = writer_with_header(path, "qwen3moe", cfg)
    expected = {}
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    for hf, name in glob.items():
        w.add_tensor(name, tensors[hf].float().numpy())
        expected[hf] = tensors[hf].float()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, name in _NAMES.items():
            t = tensors[f"{p}{hf}.weight"].float()
            w.add_tensor(f"blk.{i}.{name}.weight", t.numpy())
            expected[f"{p}{hf}.weight"] = t
        for proj, (name, qtype) in _EXPERTS.items():
            stacked = np.stack([tensors[f"{p}mlp.experts.{e}.{proj}.weight"].float().numpy()
                                for e in range(cfg.num_experts)])
            q = gguf.quants.quantize(stacked, qtype)
            w.add_tensor(f"blk.{i}.{name}.weight", q, raw_dtype=qtype)
            deq = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(q, qtype)))
            for e in range(cfg.num_experts):
                expected[f"{p}mlp.experts.{e}.{proj}.weight"] = deq[e]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("qwen3moe")
    hf = make_model(str(root / "hf"), "qwen3_moe", hidden_size=128, intermediate_size=256, head_dim=32,
                    moe_intermediate_size=64, mlp_only_layers=[], std=0.08)
    cfg = AutoConfig.from_pretrained(hf)
    tensors = load_file(f"{hf}/model.safetensors")
    expected = _write(str(root / "tiny.gguf"), cfg, tensors)
    ref = str(root / "ref")  # the HF checkpoint holding what the file holds (its quantized experts)
    shutil.copytree(hf, ref)
    save_file({k: v.contiguous() for k, v in expected.items()}, f"{ref}/model.safetensors", metadata={"format": "pt"})
    return str(root / "tiny.gguf"), hf, ref, cfg, expected


def test_config_and_weights(moe_gguf):
    from voltllm.model.loader.gguf_loader import gguf_config, gguf_weights

    path, _, _, cfg, expected = moe_gguf
    ours = gguf_config(path)
    assert ours.model_type == "qwen3_moe"
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "hidden_size", "head_dim",
                "num_hidden_layers", "num_key_value_heads"):
        assert getattr(ours, key) == getattr(cfg, key), key
    assert ours.norm_topk_prob and ours.mlp_only_layers == []
    got = dict(gguf_weights(path, ours))
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name


def test_engine_logits_match_transformers(moe_gguf):
    from transformers import AutoModelForCausalLM

    from voltllm import LLM

    path, hf, ref, _, _ = moe_gguf
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    assert_prompt_logprobs_match(LLM(path, tokenizer=hf, block_size=4), model, PROMPTS)


def test_experts_kept_quantized(moe_gguf):
    from voltllm.model.layers.quantized_linear import QuantizedLinearMethod
    from voltllm.model.loader.gguf_loader import gguf_config, gguf_weights
    from voltllm.model.models.registry import build_model

    path = moe_gguf[0]
    cfg = gguf_config(path)
    kept = build_model(cfg, torch.float32, 64, QuantizedLinearMethod())
    kept.load_weights(gguf_weights(path, cfg, keep_quantized=True))
    dense = build_model(cfg, torch.float32, 64)
    dense.load_weights(gguf_weights(path, cfg))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    for kept_layer, dense_layer in zip(kept.layers, dense.layers):
        q = kept_layer.mlp.qexperts
        assert q is not None and (q.w13.kind.name, q.w2.kind.name) == ("Q8_0", "Q4_0")
        torch.testing.assert_close(kept_layer.mlp(x), dense_layer.mlp(x), rtol=1e-5, atol=1e-5)


class _ExpertRank:
    """A stand-in tensor-parallel group placing whole experts (--enable-expert-parallel); the all-reduce is the test's
    own sum."""

    expert_parallel = True

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce_(self, x):
        return x


@pytest.mark.parametrize("keep", [False, True])
def test_expert_parallel_reads_only_the_ranks_experts(moe_gguf, keep):
    """Under expert parallelism the loader yields a rank's experts only (their stacked rows sliced before the copy /
    dequantization), with the values the whole file gives them (8 experts over 3 ranks: 3, 3, 2); over 2 ranks the
    rank's layers hold them (kept quantized: planes of its experts), and the ranks' MoE outputs add up to the whole
    layer's."""
    from voltllm.distributed.experts import ExpertShard
    from voltllm.model.layers.quantized_linear import QuantizedLinearMethod
    from voltllm.model.loader.gguf_loader import gguf_config, gguf_weights
    from voltllm.model.models.registry import build_model

    path = moe_gguf[0]
    cfg = gguf_config(path)
    whole = dict(gguf_weights(path, cfg, keep_quantized=keep))
    for rank in range(3):
        shard = ExpertShard.of(8, rank, 3)
        got = dict(gguf_weights(path, cfg, keep_quantized=keep, experts=shard))
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in got if ".experts." in n}
        assert experts == set(range(shard.start, shard.start + shard.count))
        assert {n for n in whole if ".experts." not in n} == {n for n in got if ".experts." not in n}
        for name, t in got.items():
            if not keep:
                assert torch.equal(t, whole[name]), name
            elif ".experts." in name:  # the expert's raw blocks
                assert torch.equal(t.raw, whole[name].raw), name
    parts = []
    for rank in range(2):
        model = build_model(cfg, torch.float32, 64, QuantizedLinearMethod() if keep else None,
                            tp=_ExpertRank(rank, 2))
        model.load_weights(gguf_weights(path, cfg, keep_quantized=keep, experts=ExpertShard.of(8, rank, 2)))
        parts.append(model)
    dense = build_model(cfg, torch.float32, 64)
    dense.load_weights(gguf_weights(path, cfg))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(dense.layers):
        mlps = [p.layers[i].mlp for p in parts]
        assert [(m.experts_shard.start, m.num_local_experts) for m in mlps] == [(0, 4), (4, 4)]
        if keep:
            assert all(m.qexperts.w13.kind.name == "Q8_0" and m.qexperts.w2.n == 4 * 128 for m in mlps)
        else:
            assert all(tuple(m.w13.shape) == (4, 128, 128) for m in mlps)
        with torch.no_grad():
            torch.testing.assert_close(sum(m(x) for m in mlps), layer.mlp(x), rtol=1e-5, atol=1e-5)
