"""GGUF files of llama.cpp's low-bit mixes (Q3_K_M, Q2_K, IQ4_XS; benchmarks/make_random_gguf.py writes them with
random blocks) kept quantized, run end to end on the CPU (as on a GPU: the config says "quantized"; the CPU's
QuantizedLinearMethod multiplies by the torch reference's dequantized planes): the layers, the quantized MoE experts
and the embedding / tied LM head hold planes of Q2_K / Q3_K / IQ4_XS / IQ4_NL, far smaller than fp16, and give the
dense load's greedy tokens and logprobs."""
from pathlib import Path

import pytest

from interp_util import load_script
from voltllm import LLM, SamplingParams
from voltllm.model.layers.gguf_planes import Planes
from voltllm.model.layers.quantized_linear import held_segments

pytest.importorskip("gguf")

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hi"]
# (GGUF arch's transformers config, shape, mix): 320 inputs (intermediate) are not whole 256-element blocks, so
# llama.cpp's fallback types come in for ffn_down (IQ4_NL for IQ4_XS, Q5_1 / Q5_0 for Q5_K / Q4_K); the tied head
# of the first is its Q3_K embedding table
COMMON = dict(vocab_size=1000, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
CASES = {
    "q3_k_m": ("Qwen3Config", dict(tie_word_embeddings=True), "Q3_K_M", {"Q3_K", "Q4_K", "Q5_K", "Q5_1", "Q5_0"}),
    "iq4_xs": ("Qwen3Config", dict(tie_word_embeddings=False), "IQ4_XS",
               {"IQ4_XS", "IQ4_NL", "Q5_K", "Q5_1", "Q6_K"}),
    "q2_k-moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=256), "Q2_K", {"Q2_K", "Q3_K", "Q4_K", "Q6_K"}),
}


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, tmp_path_factory, smollm2_gguf):
    from voltllm.bench import shapes

    cls, extra, mix, kinds = CASES[request.param]
    script = load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "make_random_gguf.py")
    out = str(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(shapes.SHAPES, "tiny-low-bit", (cls, {**COMMON, **extra}))
        mp.setattr(script, "SHAPES", shapes.SHAPES)
        script.write("tiny-low-bit", mix, smollm2_gguf, out)
    import voltllm.config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(voltllm.config, "_quantized_weights", lambda *a, **k: "quantized")
        kept = LLM(out, device="cpu", max_model_len=128, dtype="float32")
    dense = LLM(out, device="cpu", max_model_len=128, dtype="float32")
    yield kept, dense, kinds


def _held(model) -> tuple[set, int, int]:
    """The plane kinds a model holds (layers, embedding, MoE experts), their bytes and their elements."""
    kinds, nbytes, elements = set(), 0, 0
    for mod in model.modules():
        planes = [s.weight for s in held_segments(mod) if isinstance(s.weight, Planes)]
        experts = getattr(mod, "qexperts", None)
        if experts is not None and experts.ready:
            planes += [experts.w13, experts.w2]
        for p in planes:
            kinds.add(p.kind.name)
            nbytes += p.nbytes
            elements += p.n * p.k
    return kinds, nbytes, elements


def test_held_quantized(engines):
    kept, dense, kinds = engines
    assert kept.engine.runner.keep_quantized and not dense.engine.runner.keep_quantized
    held, nbytes, elements = _held(kept.engine.runner.model)
    assert held == kinds
    assert nbytes * 8 / elements < 8.5  # bits per weight: at most IQ4's 8.3-8.5, against fp16's 16


def test_greedy_and_logprobs_match_the_dense_load(engines):
    kept, dense, _ = engines
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    a, b = kept.generate(PROMPTS, params), dense.generate(PROMPTS, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for pa, pb in zip(x.outputs[0].logprobs + x.prompt_logprobs[1:], y.outputs[0].logprobs + y.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert abs(pa[t].logprob - pb[t].logprob) < 1e-4, (t, pa[t].logprob, pb[t].logprob)
