"""Image input on a CUDA GPU (tiny Qwen3.5, Qwen3-VL and Qwen2.5-VL checkpoints): fp32 with CUDA graphs gives
transformers' greedy tokens and logprobs (the fused rope and decode kernels read the M-RoPE scratch rows, Qwen2.5-VL's
by the contiguous rule; decode steps replay graphs with the shifted positions; Qwen3-VL's deepstack rows are added in
the eager image steps); fp16 agrees with fp16 --enforce-eager; --compat sm70 too. Qwen4-Exp (qwen4_exp) in fp32: with
graphs, and with PLE and QSA's sparse path (eager). Run on the GPU machine: pytest -m gpu
tests/gpu/test_image_input_cuda.py (not run yet, no case)."""
from __future__ import annotations

import pytest

from vl_models import (run_greedy as _run, same_greedy as _same, vl_image as _image, vl_prompt as _prompt,
                       vl_reference as _reference, vl_setup)
from voltllm.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl", "qwen2_5_vl"])
def vl(tmp_path_factory, request):
    return vl_setup(str(tmp_path_factory.mktemp("vl")), request.param)


def _cuda_llm(path, **kw):
    return LLM(path, device="cuda", max_num_seqs=4, gpu_memory_utilization=0.3, **kw)


def test_fp32_graphs_match_transformers(vl):
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    text_ids, _, _ = _prompt(vl, ["Just some text here."], [])
    llm = _cuda_llm(vl[0], dtype="float32", max_num_batched_tokens=32)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))


@pytest.mark.parametrize("compat", ["none", "sm70"])
def test_fp16_graphs_agree_with_eager(vl, compat):
    ids, _, mm = _prompt(vl, [None, "What is in this picture?"], [_image(0, 32, 48)])
    eager = _run(_cuda_llm(vl[0], dtype="float16", enforce_eager=True, compat=compat), [(ids, mm)])[0]
    graphs = _run(_cuda_llm(vl[0], dtype="float16", compat=compat), [(ids, mm)])[0]
    assert [t for t, _ in graphs] == [t for t, _ in eager]
    assert all(abs(a - b) < 2e-2 for (_, a), (_, b) in zip(graphs, eager))


@pytest.mark.parametrize("variant", ["graphs", "qsa-ple"])
def test_qwen4_exp_fp32_matches_transformers(tmp_path, variant):
    """Qwen4-Exp (Qwen3.5-MoE's tower): "graphs" without PLE, QSA's budget past every context (decode steps replay
    graphs at the shifted positions); "qsa-ple" with PLE (eager) and a budget of 8 tokens (the sparse path, pooled
    keys rotated by their M-RoPE positions, on the GPU)."""
    budget = 8 if variant == "qsa-ple" else 4096
    vl = vl_setup(str(tmp_path), "qwen4_exp", ple=variant == "qsa-ple", indexer_budget=budget)
    ids, out, mm = _prompt(vl, ["Compare", None, "with", None, "please."], [_image(1, 32, 48), _image(2, 40, 24)])
    text_ids, _, _ = _prompt(vl, ["Just some text here."], [])
    llm = _cuda_llm(vl[0], dtype="float32", max_num_batched_tokens=32)
    got = _run(llm, [(ids, mm), (text_ids, None)])
    assert _same(got[0], _reference(vl, ids, out)) and _same(got[1], _reference(vl, text_ids, None))
