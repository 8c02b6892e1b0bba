"""FP8 (E4M3 / E5M2) KV cache in the engine on the CPU (torch reference backend): KV capacity at the same
memory, end-to-end generation, exactness against torch's own float8 rounding, greedy top-1 agreement with
the float KV cache, and per-layer k/v scales loaded from a checkpoint.

Greedy top-1 agreement is measured teacher-forced: the fp32-KV engine's own greedy continuation (256 tokens)
is fed to each engine, the prompt as one prefill step and then one decode step per token, and the argmax at
every step is compared. On *random tiny* models the logit margins are small (median top-1/top-2 gap ~0.25),
so fp8's per-element K/V rounding (~2.6% RMS for e4m3, ~5% for e5m2) flips near-ties: measured 0.926
(e4m3) and 0.81-0.86 (e5m2) on the tiny qwen3 below. The bounds (0.85 / 0.70) catch a broken codec or scale
(which gives ~0.1-0.5); correctness itself is pinned by the exactness test (the fp8 engine equals fp32
attention over K/V rounded by torch's float8 cast). For the record, SmolLM2-135M (real weights, same
measure, CPU): e4m3 0.988 / 0.980 / 0.949 on a factual / code / story prompt, e5m2 0.957 / 0.938.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.attention.torch_ref import TorchReferenceBackend
from voltllm.config import EngineArgs


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "unit" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_load("_attention_interp_check")
teacher_forced_logits = _load("_fp8_kv_interp_check").teacher_forced_logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_fp8")), "qwen3", max_position_embeddings=1024)


# --- capacity ---------------------------------------------------------------------------------------------
def _runner(path: str, kv: str, dtype: str, cache_bytes: int):
    from voltllm.worker.runner import ModelRunner
    cfg = EngineArgs(model=path, device="cpu", dtype=dtype, kv_cache_dtype=kv, max_model_len=256).create_engine_config()
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, cpu_kv_cache_bytes=cache_bytes))
    return ModelRunner(cfg)


@pytest.mark.parametrize("dtype,ratio", [("float16", 2), ("float32", 4)])
def test_fp8_capacity_doubles(tiny, dtype, ratio):
    """Same cpu_kv_cache_bytes: fp8 blocks are 1 byte per element, so 2x the tokens of an fp16 cache."""
    per_block_auto = _runner(tiny, "auto", dtype, 1 << 20).kv_block_bytes()
    budget = per_block_auto * 40
    auto = _runner(tiny, "auto", dtype, budget)
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        fp8 = _runner(tiny, kv, dtype, budget)
        assert fp8.kv_dtype == torch.uint8
        assert auto.kv_block_bytes() == ratio * fp8.kv_block_bytes()
        assert auto.determine_num_blocks() == 40
        assert fp8.determine_num_blocks() == 40 * ratio
        fp8.initialize_kv_cache()
        assert all(c.dtype == torch.uint8 and c.shape == (2, 40 * ratio, 16, 2, 16) for c in fp8.kv_caches)


# --- engine end to end (CPU, torch reference backend) ----------------------------------------------------
class FakeQuantBackend(TorchReferenceBackend):
    """An independent reference: a float cache holding K/V rounded through torch's own float8 cast."""

    def __init__(self, fp8_dtype: torch.dtype):
        super().__init__()
        self.fp8_dtype = fp8_dtype

    def forward(self, q, k, v, kv_cache, meta, scale, k_scale=None, v_scale=None):
        k = k.float().to(self.fp8_dtype).to(k.dtype)
        v = v.float().to(self.fp8_dtype).to(v.dtype)
        return super().forward(q, k, v, kv_cache, meta, scale)


@pytest.fixture(scope="module")
def engines(tiny):
    return {kv: LLM(tiny, device="cpu", kv_cache_dtype=kv, max_model_len=512)
            for kv in ("auto", "fp8_e4m3", "fp8_e5m2")}


@pytest.fixture(scope="module")
def reference_run(engines):
    """(tokens, prompt length, {kv: teacher-forced logits}) over the fp32-KV engine's 256 greedy tokens."""
    llm = engines["auto"]
    prompt = llm.tokenizer("The quick brown fox jumps over the lazy dog. What is")["input_ids"]
    gen = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))[0].outputs[0].token_ids
    seq = list(prompt) + list(gen)
    logits = {kv: teacher_forced_logits(e.engine.runner, seq, len(prompt)) for kv, e in engines.items()}
    return seq, len(prompt), logits


def test_engine_fp8_generates_and_keeps_cache_consistent(engines):
    prompts = ["The quick brown fox jumps", "What is the capital of France?", "Hi", "0123456789 " * 20]
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        llm = engines[kv]
        assert all(c.dtype == torch.uint8 for c in llm.engine.runner.kv_caches)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16))  # prefix hits
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
        llm.engine.check_integrity()


@pytest.mark.parametrize("kv,fp8_dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_engine_fp8_equals_fake_quant_reference(engines, reference_run, kv, fp8_dtype):
    """The fp8 engine is exactly attention over K/V rounded by torch's float8 conversion (scale 1)."""
    seq, plen, logits = reference_run
    n = plen + 64  # exactness needs no long run
    got = logits[kv][:n - plen + 1]
    want = teacher_forced_logits(engines["auto"].engine.runner, seq[:n], plen, backend=FakeQuantBackend(fp8_dtype))
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("kv,bound", [("fp8_e4m3", 0.85), ("fp8_e5m2", 0.70)])
def test_engine_fp8_top1_agreement(engines, reference_run, kv, bound):
    seq, plen, logits = reference_run
    ref, got = logits["auto"], logits[kv]
    n = len(seq) - plen  # the positions of the reference's generated tokens
    assert (ref[:n].argmax(-1) == torch.tensor(seq[plen:])).all()  # teacher forcing replays the engine
    agree = (got[:n].argmax(-1) == ref[:n].argmax(-1)).float().mean().item()
    delta = (got - ref).abs().max().item()
    print(f"\n{kv}: teacher-forced greedy top-1 agreement with fp32 KV over {n} tokens: "
          f"{agree:.4f} (max |logit diff| {delta:.3f})")
    assert agree >= bound
    assert delta > 0.0  # the cache really is quantized
    # the engine's own greedy continuation follows the teacher-forced argmax of its first step
    first = engines[kv].generate({"prompt_token_ids": seq[:plen]},
                                 SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids
    assert first[0] == int(got[0].argmax())


# --- checkpoint scales ---------------------------------------------------------------------------------
def test_checkpoint_kv_scales_loaded_and_used(tmp_path):
    from safetensors.torch import load_file, save_file
    path = make_model(str(tmp_path / "m"), "llama", max_position_embeddings=512)
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    w["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    w["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25])
    w["model.layers.1.self_attn.k_proj.k_scale"] = torch.tensor(2.0)
    w["model.layers.2.self_attn.kv_scale"] = torch.tensor(0.125)
    save_file(w, f, metadata={"format": "pt"})
    llm = LLM(path, device="cpu", kv_cache_dtype="fp8_e4m3", max_model_len=256)
    layers = llm.engine.runner.model.layers
    got = [(float(layer.self_attn.k_scale), float(layer.self_attn.v_scale)) for layer in layers]
    assert got == [(0.5, 0.25), (2.0, 1.0), (0.125, 0.125)]
    assert all(layer.self_attn.k_scale.dtype == torch.float32 for layer in layers)
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
    assert len(out[0].outputs[0].token_ids) == 16
    llm.engine.check_integrity()
    auto = LLM(path, device="cpu", max_model_len=256)  # a float cache loads (and ignores) the scales
    assert float(auto.engine.runner.model.layers[0].self_attn.k_scale) == 0.5
    # used on both sides: stored = encode(k / scale), read = decode * scale. A scale applied on one side
    # only would scale K or V by 2..8 and wreck the agreement with the float cache
    prompt = auto.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    gen = auto.generate({"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0].outputs[0].token_ids
    seq = list(prompt) + list(gen)
    ref = teacher_forced_logits(auto.engine.runner, seq, len(prompt))[:64]
    got = teacher_forced_logits(llm.engine.runner, seq, len(prompt))[:64]
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\nfp8_e4m3 with checkpoint scales vs float KV: top-1 agreement {agree:.3f} over 64 tokens")
    assert agree >= 0.8
    for layer in llm.engine.runner.model.layers:  # and with every scale at 1.0 the numbers change
        layer.self_attn.k_scale.fill_(1.0)
        layer.self_attn.v_scale.fill_(1.0)
    unscaled = teacher_forced_logits(llm.engine.runner, seq, len(prompt))[:64]
    assert not torch.equal(unscaled, got)


# --- checkpoint scales (qwen3.5: the hybrid models' attention class) ----------------------------------------
def test_qwen3_5_loads_kv_scales(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from voltllm.model.loader.safetensors_loader import safetensors_weights
    from voltllm.model.models.qwen3_next import Qwen3_5ForCausalLM
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, intermediate_size=96, max_position_embeddings=512)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    ref.save_pretrained(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    w = load_file(str(f))
    attn = next(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    w[f"model.layers.{attn}.self_attn.k_scale"] = torch.tensor(0.5)
    w[f"model.layers.{attn}.self_attn.v_proj.v_scale"] = torch.tensor(3.0)
    save_file(w, str(f), metadata={"format": "pt"})
    model = Qwen3_5ForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path), torch.float32, 512)
    model.load_weights(safetensors_weights(str(tmp_path)))
    a = model.layers[attn].self_attn
    assert (float(a.k_scale), float(a.v_scale)) == (0.5, 3.0)
