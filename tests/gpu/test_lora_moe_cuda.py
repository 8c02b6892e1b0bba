"""LoRA on MoE experts on a CUDA GPU (tiny random qwen3_moe, adapters with random A and B on every routed expert and
the attention): with CUDA graphs on, steps with expert adapters run eagerly and the rest replay graphs; fp32 greedy
tokens equal transformers on the checkpoint with each adapter merged, in a batch mixing two adapters and the base
model. Run on the GPU machine: pytest -m gpu tests/gpu/test_lora_moe_cuda.py."""
from __future__ import annotations

import pytest
import torch

from lora_adapters import make_adapter, merged_copy
from tiny_models import make_model
from voltllm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox jumps over", "What is the capital of France? The capital", "def add(a, b):",
           "0123456789 " * 12, "Paris"]
NAMES = [None, "a1", "a2", "a1", "a2"]


def test_fp32_expert_adapters_give_the_merged_models_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_model(str(tmp_path / "moe"), "qwen3_moe")
    paths = {"a1": make_adapter(str(tmp_path / "a1"), model, rank=8, alpha=16, seed=1,
                                targets=("q_proj", "v_proj", "o_proj", "experts"), std=0.2),
             "a2": make_adapter(str(tmp_path / "a2"), model, rank=4, alpha=8, seed=2, targets=("experts",), std=0.3)}
    loras = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(paths.items(), 1)}
    llm = LLM(model, device="cuda", dtype="float32", gpu_memory_utilization=0.3, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_num_seqs=8)
    n = 12
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, min_tokens=n),
                        lora_request=[loras.get(name) for name in NAMES], use_tqdm=False)
    tok = llm.get_tokenizer()
    refs = {None: model} | {name: merged_copy(model, p, str(tmp_path / f"merged-{name}")) for name, p in paths.items()}
    for prompt, name, out in zip(PROMPTS, NAMES, outs):
        ref = AutoModelForCausalLM.from_pretrained(refs[name], dtype=torch.float32).eval()
        ids = tok.encode(prompt)
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0]
        assert list(out.outputs[0].token_ids) == want[len(ids):].tolist(), (prompt, name)
    llm.engine.check_integrity()
