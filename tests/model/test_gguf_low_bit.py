"""GGUF files of llama.cpp's low-bit mixes (Q3_K_M, Q2_K, IQ4_XS; benchmarks/make_random_gguf.py writes them with
random blocks) kept quantized, run end to end on the CPU (as on a GPU: the config says "quantized"; the CPU's
QuantizedLinearMethod multiplies by the torch reference's dequantized planes): the layers, the quantized MoE experts
and the embedding / tied LM head hold planes of Q2_K / Q3_K / IQ4_XS / IQ4_NL, far smaller than fp16, and give the
dense load's greedy tokens and logprobs."""
import pytest

from gguf_files import LOW_BIT_CASES, write_low_bit_gguf
from voltllm import LLM, SamplingParams
from voltllm.model.layers.gguf_planes import Planes
from voltllm.model.layers.quantized_linear import held_segments

pytest.importorskip("gguf")

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hi"]


@pytest.fixture(scope="module", params=list(LOW_BIT_CASES))
def engines(request, tmp_path_factory, smollm2_gguf):
    import voltllm.config

    out = str(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf")
    kinds = write_low_bit_gguf(out, request.param, smollm2_gguf)
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
    assert nbytes * 8 / elements < 6.6  # bits per weight: at most Q6_K's 6.56 (the LM head), against fp16's 16


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
