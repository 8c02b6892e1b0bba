"""LoRA on Qwen4-Exp on a CUDA GPU (a tiny random qwen4_exp_text with PLE and QSA past its budget, adapters with random
A and B): with CUDA graphs on, steps whose adapters leave the experts alone (attention, GDN, shared expert) replay
graphs, those with expert adapters run eagerly; fp32 greedy tokens equal transformers on the checkpoint with each
adapter merged, in a batch mixing two adapters and the base model. Run on the GPU machine: pytest -m gpu
tests/gpu/test_lora_qwen4_exp_cuda.py."""
from __future__ import annotations

import pytest
import torch

from lora_adapters import make_adapter, merged_copy
from tiny_models import HYBRID_VOCAB, QWEN4_EXP_INDEXER, QWEN4_EXP_PLE, make_tiny_qwen4_exp
from voltllm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 3) % HYBRID_VOCAB for i in range(n)] for n in (37, 5, 26, 3)]
N = 12


def _want(path, prompt):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_fp32_graphs_and_expert_steps_give_the_merged_models_tokens(tmp_path):
    model = make_tiny_qwen4_exp(str(tmp_path / "q4"), 3, **dict(QWEN4_EXP_INDEXER, indexer_budget=8),
                                **QWEN4_EXP_PLE, layer_types=["linear_attention", "indexed_attention"] * 2)
    if model is None:
        pytest.skip("this transformers has no Qwen4-Exp")
    paths = {"dense": make_adapter(str(tmp_path / "dense"), model, rank=8, alpha=16, seed=1, std=0.15,
                                   targets=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                            "in_proj_b", "in_proj_a", "out_proj", "shared_expert")),
             "experts": make_adapter(str(tmp_path / "experts"), model, rank=4, alpha=8, seed=2, std=0.25,
                                     targets=("experts", "q_proj"))}
    loras = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(paths.items(), 1)}
    refs = {None: model} | {n: merged_copy(model, p, str(tmp_path / f"merged-{n}")) for n, p in paths.items()}
    llm = LLM(model, device="cuda", dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.2,
              enable_lora=True, max_loras=2, max_lora_rank=8, max_num_batched_tokens=32, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=N, min_tokens=N)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    for names in ([None, "dense", None, "dense"], [None, "dense", "experts", "dense"]):
        before = graphs.replays
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            lora_request=[loras.get(n) for n in names], use_tqdm=False)
        for p, n, o in zip(PROMPTS, names, outs):
            assert o.outputs[0].token_ids == _want(refs[n], p), n
        if "experts" not in names:  # (decode steps past the QSA budget, PLE and the adapters' terms replayed)
            assert graphs.replays >= before + N - 1
    llm.engine.check_integrity()
