"""4-bit AWQ / GPTQ checkpoints end to end on the CPU: a tiny qwen3 quantized and packed as AutoAWQ / GPTQ write
it (tests/int4_checkpoints.py) runs in the engine with the logits of transformers holding the same dequantized
weights; the kept-quantized layers (int4 planes) multiply like the dequantized ones."""
import pytest
import torch
from int4_checkpoints import quantize_checkpoint
from tiny_models import make_model

from voltllm import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]
VARIANTS = {"awq": dict(method="awq"), "gptq-sym": dict(method="gptq", symmetric=True),
            "gptq-act-order": dict(method="gptq", act_order=True)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def quantized(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    # inputs of 128 and 256 features: whole 64-element groups, as the planes need
    path = make_model(str(tmp_path_factory.mktemp(request.param)), "qwen3", hidden_size=128, intermediate_size=256,
                      head_dim=32, std=0.08)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    deq = quantize_checkpoint(path, **VARIANTS[request.param])
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name, w in deq.items():
            params[name].copy_(w)
    return request.param, path, ref


def test_logits_match_transformers_on_dequantized_weights(quantized):
    variant, path, ref = quantized
    llm = LLM(path, block_size=4, max_num_seqs=4)
    assert llm.engine.config.model.quantization == VARIANTS[variant]["method"]
    tok = llm.get_tokenizer()
    vocab = ref.config.vocab_size
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=vocab))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
        for pos in range(1, len(ids)):
            got = out.prompt_logprobs[pos]
            top = int(want[pos - 1].argmax())
            assert abs(got[top].logprob - float(want[pos - 1, top])) < 1e-3, (variant, prompt, pos)


def test_kept_quantized_layers_multiply_like_dequantized(quantized):
    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.linear import Linear
    from voltllm.model.layers.quantized_linear import QuantizedLinearMethod
    from voltllm.model.loader import iter_weights, load_hf_config, resolve_model
    from voltllm.model.models.registry import build_model

    variant, path, _ = quantized
    src = resolve_model(path)
    cfg = load_hf_config(src)
    kept = build_model(cfg, torch.float32, 64, QuantizedLinearMethod())
    kept.load_weights(iter_weights(src, cfg, keep_quantized=True))
    dense = build_model(cfg, torch.float32, 64)
    dense.load_weights(iter_weights(src, cfg, keep_quantized=False))
    dense_linears = dict(dense.named_modules())
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    checked = 0
    for name, mod in kept.named_modules():
        if not isinstance(mod, Linear) or name == "lm_head":
            continue
        segs = mod.gguf_segments
        planes = [s.weight for s in segs if isinstance(s.weight, Planes)]
        if variant == "gptq-act-order":
            assert not planes  # act-order groups: dequantized at load
        else:
            assert len(segs) == 1 and planes and planes[0].kind.name.startswith("INT4_G32")
            assert planes[0].kind.zero_points == (variant == "awq")
        xi = x[:, :mod.in_features]
        torch.testing.assert_close(mod(xi), dense_linears[name](xi), rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked == 3 * 4  # qkv, o, gate_up, down per layer
