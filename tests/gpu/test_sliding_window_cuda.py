"""Sliding-window layers on the GPU (a tiny qwen3 whose later layers attend over 24 tokens): in fp32 the engine's
greedy tokens and prompt logprobs equal transformers' (CPU, eager) on the native and --compat sm70 routes, with decode
graphs and prompt graphs replaying, chunked prompts through the paged prefill kernel (native) or SDPA with the window's
mask (compat), long-context decode rows through split-KV; fp16 runs finite. Run on the GPU machine: pytest -m gpu."""
import pytest
import torch

from tiny_models import assert_prompt_logprobs_match, make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

WINDOW = 24
PROMPTS = ["The quick brown fox jumps over the lazy dog, again and again and again.", "Hi",
           "0123456789 " * 60, "def add(a, b):\n    return a + b\n" * 4]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_model(str(tmp_path_factory.mktemp("swa")), "qwen3", use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1, max_position_embeddings=2048)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, ref


def _hf_greedy(ref, ids, n):
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("compat", ["none", "sm70"])
def test_fp32_greedy_and_logprobs_equal_transformers(windowed, compat):
    path, ref = windowed
    llm = LLM(path, device="cuda", dtype="float32", compat=compat, gpu_memory_utilization=0.3,
              max_num_batched_tokens=256)
    runner = llm.engine.runner
    assert [layer.self_attn.sliding_window for layer in runner.model.layers] == [0, WINDOW, WINDOW]
    tok = llm.get_tokenizer()
    n = 40
    expected = [_hf_greedy(ref, tok.encode(p), n) for p in PROMPTS]
    got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, min_tokens=n))
    assert [o.outputs[0].token_ids for o in got] == expected
    assert runner.graphs is not None and runner.graphs.replays > 0
    assert_prompt_logprobs_match(llm, ref, PROMPTS[:2] + PROMPTS[3:], atol=1e-3)
    one = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=n, min_tokens=n))
    assert one[0].outputs[0].token_ids == expected[0]
    if compat == "none":
        assert runner.prompt_graphs is not None and runner.prompt_graphs.replays > 0
    llm.engine.check_integrity()


def test_fp16_runs(windowed):
    path, _ = windowed
    llm = LLM(path, device="cuda", dtype="float16", gpu_memory_utilization=0.3)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=32, logprobs=1))
    for o in out:
        assert len(o.outputs[0].token_ids) == 32
        assert all(torch.isfinite(torch.tensor(lp[t].logprob)) for t, lp in zip(o.outputs[0].token_ids,
                                                                                  o.outputs[0].logprobs))
    llm.engine.check_integrity()
