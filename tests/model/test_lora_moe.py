"""LoRA adapters on MoE experts (CPU, tiny random qwen3_moe / qwen3_5_moe checkpoints and adapters with random A and B
on every routed expert's gate / up / down, a shared expert's and the attention's): each request's greedy tokens and
logprobs equal transformers' on the checkpoint with the adapter merged (W + scaling * B A, expert by expert), in
batches mixing two adapters and the base model; -tp 2 (gloo), with and without expert parallelism, equals -tp 1."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from lora_adapters import make_adapter, merged_copy
from tiny_models import make_model
from voltllm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox jumps over", "What is the capital of France? The capital",
           "def add(a, b):\n    return", "Hello world! Voltllm serves language models on old GPUs, fast.",
           "0123456789 0123", "Paris"]
NAMES = [None, "a1", "a2", "a1", None, "a2"]
# a1: the attention and every routed expert; a2: the experts alone, a smaller rank (zero-padded to --max-lora-rank)
ADAPTERS = {"a1": dict(rank=8, alpha=16, seed=1, targets=("q_proj", "v_proj", "o_proj", "experts"), std=0.2),
            "a2": dict(rank=4, alpha=8, seed=2, targets=("experts",), std=0.3)}
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, max_num_batched_tokens=16,
              max_num_seqs=6)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


class Setup:
    def __init__(self, root: str):
        self.model = make_model(f"{root}/moe", "qwen3_moe")
        self.paths = {n: make_adapter(f"{root}/moe-{n}", self.model, **kw) for n, kw in ADAPTERS.items()}
        self.requests = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(self.paths.items(), 1)}
        self.root = root

    @functools.lru_cache(maxsize=None)
    def reference(self, name):
        """transformers on the checkpoint with the adapter merged into its per-expert weights."""
        from transformers import AutoModelForCausalLM

        path = self.model if name is None else merged_copy(self.model, self.paths[name], f"{self.root}/merged-{name}")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def check(self, llm, names=NAMES, prompts=PROMPTS):
        tok = llm.get_tokenizer()
        outs = llm.generate(prompts, GREEDY, lora_request=[self.requests.get(n) for n in names], use_tqdm=False)
        for prompt, name, out in zip(prompts, names, outs):
            ids = tok.encode(prompt)
            with torch.no_grad():
                ref = self.reference(name).generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens,
                                                    do_sample=False, min_new_tokens=GREEDY.max_tokens)
                full = ref[0].tolist()
                logits = self.reference(name)(torch.tensor([full])).logits[0].log_softmax(-1)
            assert list(out.outputs[0].token_ids) == full[len(ids):], (prompt, name)
            for j, (tid, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
                assert lp[tid].logprob == pytest.approx(logits[len(ids) + j - 1, tid].item(), abs=1e-4), (name, j)
        llm.engine.check_integrity()
        return outs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return Setup(str(tmp_path_factory.mktemp("lora-moe")))


def test_expert_adapters_match_the_merged_model_in_a_mixed_batch(setup):
    """Two adapters with random expert A and B, and the base model, in one batch (chunked prefill, decode steps mixing
    them): each request equals transformers with its adapter merged; the adapters change the output."""
    llm = LLM(setup.model, **ENGINE)
    outs = setup.check(llm)
    base = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    changed = [o.outputs[0].token_ids != b.outputs[0].token_ids for o, b, n in zip(outs, base, NAMES) if n]
    assert all(changed)


def test_expert_only_adapter_changes_the_output_where_attention_adapters_are_absent(setup):
    """a2 adapts the experts alone: without its expert terms the engine would serve the base model."""
    llm = LLM(setup.model, **ENGINE)
    setup.check(llm, ["a2", "a2"], PROMPTS[:2])


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_ranks_cut_expert_adapters_as_their_experts(setup, expert_parallel):
    """-tp 2 (gloo): each rank holds its band of every expert's intermediate rows (or whole experts of its own under
    --enable-expert-parallel) and cuts the adapters alike; tokens and logprobs equal the merged model's."""
    two = LLM(setup.model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        setup.check(two)
    finally:
        two.engine.shutdown()
