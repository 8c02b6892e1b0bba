"""bitsandbytes checkpoints end to end on the CPU: tiny llama / qwen3 / qwen3_moe models whose projections are
quantized with the reference codec and saved in bitsandbytes' layout (tests/bnb_checkpoints.py: NF4 and FP4, with
and without double quantization, a bf16 weight dtype with bf16 quant storage, 8-bit rows; one projection left dense as
llm_int8_skip_modules leaves it) give the engine the same full-vocabulary prompt logprobs and greedy tokens as the
dense checkpoint holding the dequantized weights; `--quantization bitsandbytes` on an unquantized checkpoint equals
the dense checkpoint holding its NF4-rounded projections; 4-bit and 8-bit layers kept quantized as planes equal the
dense checkpoint holding the planes' values."""
import os

import pytest
import torch
from bnb_checkpoints import nf4_at_load_reference, planes_reference, quantize_bnb_checkpoint
from tiny_models import full_prompt_logprobs, make_model

from voltllm import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]
SKIP = "layers.1.self_attn.o_proj"
VARIANTS = {"nf4-double": ("qwen3", dict()), "nf4": ("llama", dict(double_quant=False)),
            "fp4-double": ("llama", dict(quant_type="fp4")),
            "fp4": ("qwen3", dict(quant_type="fp4", double_quant=False)),
            "nf4-bf16": ("qwen3", dict(dtype=torch.bfloat16, storage=torch.bfloat16)), "int8": ("qwen3", dict(bits=8)),
            "moe-nf4-double": ("qwen3_moe", dict())}


def _tiny(path: str, kind: str) -> str:
    # odd sizes too: inputs of 96 and 160 (blocks of 64 cross rows; the last block of a matrix is partial)
    return make_model(path, kind, hidden_size=96, intermediate_size=160, head_dim=24, moe_intermediate_size=40,
                      std=0.08)


def _run(path: str, **kwargs):
    llm = LLM(path, block_size=4, max_num_seqs=4, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs], full_prompt_logprobs(llm, PROMPTS)


def _assert_same(got, ref):
    assert got[1] == ref[1]
    assert torch.equal(got[2], ref[2])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_equals_the_dequantized_dense_checkpoint(tmp_path, variant):
    kind, kw = VARIANTS[variant]
    path = _tiny(str(tmp_path / "bnb"), kind)
    quantize_bnb_checkpoint(path, str(tmp_path / "ref"), skip=(SKIP,), **kw)
    if kind == "qwen3_moe":  # the routed experts are 4-bit layers too
        from voltllm.model.loader.bnb_checkpoint import quantized_layers

        assert "model.layers.0.mlp.experts.3.down_proj.weight" in quantized_layers(path)
    # vLLM's spellings: the method is read from the checkpoint, `--quantization` / `--load-format bitsandbytes` agree
    flags = dict(quantization="bitsandbytes", load_format="bitsandbytes") if variant == "nf4-double" else {}
    got = _run(path, **flags)
    assert got[0].engine.config.model.quantization == "bitsandbytes"
    assert got[0].engine.config.model.quantized_weights == "dequantized"
    ref = _run(str(tmp_path / "ref"))
    assert ref[0].engine.config.model.quantization is None
    _assert_same(got, ref)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_quantized_at_load(tmp_path, kind):
    path = _tiny(str(tmp_path / "dense"), kind)
    nf4_at_load_reference(path, str(tmp_path / "ref"))
    got = _run(path, quantization="bitsandbytes")
    assert got[0].engine.config.model.quantization == "bitsandbytes"
    plain = _run(path)
    assert not torch.equal(got[2], plain[2])  # the projections really are NF4-rounded
    _assert_same(got, _run(str(tmp_path / "ref")))


def test_refusals(tmp_path, capsys):
    from voltllm.cli import main
    from voltllm.config import ConfigError

    path = _tiny(str(tmp_path / "dense"), "llama")
    with pytest.raises(ConfigError, match="--load-format bitsandbytes reads bitsandbytes checkpoints"):
        LLM(path, load_format="bitsandbytes")
    assert main(["generate", "hi", path, "--device", "cpu", "--load-format", "bitsandbytes"]) == 2
    assert "voltllm: error: --load-format bitsandbytes reads bitsandbytes checkpoints" in capsys.readouterr().err
    quantize_bnb_checkpoint(path, str(tmp_path / "ref"))
    with pytest.raises(ConfigError, match="--quantization fp8: the model is a bitsandbytes checkpoint"):
        LLM(path, quantization="fp8")
    assert os.path.isdir(str(tmp_path / "ref"))


# kept quantized (as on a GPU: the config says "quantized"; the CPU's QuantizedLinearMethod multiplies by the torch
# reference's dequantized planes): (architecture, checkpoint options, --quantization, the plane kind, bits per weight)
KEPT = {"nf4-double": ("qwen3", dict(), None, "BNB_NF4_B64", 4.25),
        "fp4-bf16": ("llama", dict(quant_type="fp4", double_quant=False, dtype=torch.bfloat16), None, "BNB_FP4_B64",
                     4.25),
        "moe-nf4-double": ("qwen3_moe", dict(), None, "BNB_NF4_B64", 4.25),
        "at-load": ("qwen3", None, "bitsandbytes", "BNB_NF4_B64", 4.25),
        # 8-bit rows: 8-bit GPTQ's symmetric kind, the row's scale per 64 inputs
        "int8": ("qwen3", dict(bits=8), None, "INT8_G64", 8.25),
        "int8-bf16": ("llama", dict(bits=8, dtype=torch.bfloat16), None, "INT8_G64", 8.25),
        "moe-int8": ("qwen3_moe", dict(bits=8), None, "INT8_G64", 8.25)}


@pytest.mark.parametrize("variant", list(KEPT))
def test_kept_quantized_layers(tmp_path, monkeypatch, variant):
    """4-bit and 8-bit layers held as planes (4.25 / 8.25 bits per weight; the layer llm_int8_skip_modules left out
    stays dense) give the greedy tokens and logprobs of the dense checkpoint holding the planes' values
    (tests/bnb_checkpoints.py planes_reference), and the dequantized load's prompt logprobs up to the planes' rounding
    (the absmax or SCB / 127 in fp16, the 4-bit product not rounded to the stored dtype)."""
    import voltllm.config
    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.quantized_linear import held_segments

    kind, kw, flag, plane_kind, bits = KEPT[variant]
    # inputs of 128 / 256 / 64 (experts): whole blocks per row, as the planes need
    path = make_model(str(tmp_path / "bnb"), kind, hidden_size=128, intermediate_size=256, head_dim=32,
                      moe_intermediate_size=64, std=0.08)
    if kw is not None:
        quantize_bnb_checkpoint(path, str(tmp_path / "deq"), skip=(SKIP,), **kw)
    planes_reference(path, str(tmp_path / "ref"), flag)
    with monkeypatch.context() as mp:
        mp.setattr(voltllm.config, "_quantized_weights", lambda *a, **k: "quantized")
        kept = _run(path, quantization=flag)
    assert kept[0].engine.runner.keep_quantized
    kinds, nbytes, elements, dense_layers = set(), 0, 0, []
    for name, mod in kept[0].engine.runner.model.named_modules():
        planes = [s.weight for s in held_segments(mod) if isinstance(s.weight, Planes)]
        experts = getattr(mod, "qexperts", None)
        if experts is not None and experts.ready:
            planes += [experts.w13, experts.w2]
        if held_segments(mod) and not planes and "layers." in name:  # (not the embedding / LM head: never bnb's)
            dense_layers.append(name)
        for p in planes:
            kinds.add(p.kind.name)
            nbytes += p.nbytes
            elements += p.n * p.k
    assert kinds == {plane_kind} and nbytes * 8 / elements == bits
    assert dense_layers == (["layers.1.self_attn.o_proj"] if kw is not None else [])
    ref = _run(str(tmp_path / "ref"))
    assert kept[1] == ref[1]
    torch.testing.assert_close(kept[2], ref[2], rtol=0, atol=1e-5)
    dense = _run(path, quantization=flag)
    assert not dense[0].engine.runner.keep_quantized
    # (a bf16 4-bit layer's dequantized load rounds each weight to bf16, 2^-9; the planes' fp32 product does not)
    bf16 = kw is not None and kw.get("dtype") == torch.bfloat16 and kw.get("bits", 4) == 4
    torch.testing.assert_close(kept[2], dense[2], rtol=0, atol=2e-2 if bf16 else 5e-3)
