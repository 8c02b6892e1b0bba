"""Pipeline parallelism over two GPUs (NCCL point-to-point): -pp 2 against one GPU on a tiny qwen3 and a tiny dense
hybrid (qwen3_5, 8 layers) with decode CUDA graphs on (the hand-overs captured inside each rank's graphs), fp32 and
fp16; with 4 devices also -tp 2 -pp 2. Needs 2 CUDA devices (benchmarks/run_h200.sh s146pp, kind nvidia-h200-x2);
skipped otherwise."""
import pytest
import torch

from tiny_models import make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PROMPTS = ["The quick brown fox jumps", "What is the capital of France?", "Hi", "0123456789 " * 30]


def _greedy(llm, prompts=PROMPTS, n=24):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pp2_matches_one_gpu_with_cuda_graphs(tmp_path, dtype):
    path = make_model(str(tmp_path), "qwen3", num_hidden_layers=4, max_position_embeddings=2048)
    one = LLM(path, device="cuda", dtype=dtype, gpu_memory_utilization=0.3)
    ref = _greedy(one)
    del one
    two = LLM(path, device="cuda", dtype=dtype, gpu_memory_utilization=0.3, pipeline_parallel_size=2)
    try:
        assert two.engine.runner.graphs is not None and two.engine.runner.pp is not None
        got = _greedy(two)
        assert two.engine.runner.graphs.replays > 0
        assert _greedy(two) == got  # prefix-cache hits on both stages
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()
    if dtype == "float32":
        assert got == ref
    else:  # (the same kernels on each stage's layers: the split changes no arithmetic, but allow tie flips)
        agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
        assert agree >= 0.97, agree


def test_pp2_hybrid_matches_one_gpu(tmp_path):
    path = make_tiny_hybrid(str(tmp_path), "qwen3_5", seed=0, gen_seed=1, num_hidden_layers=8)
    if path is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 190 for i in range(n)]} for n in (19, 5, 260)]
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, skip_tokenizer_init=True)
    ref = _greedy(LLM(path, **kw), prompts)
    two = LLM(path, pipeline_parallel_size=2, **kw)
    try:
        assert _greedy(two, prompts) == ref
        assert two.engine.runner.graphs.replays > 0
    finally:
        two.engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_tp2_pp2_matches_one_gpu(tmp_path):
    """Two stages of two tensor-parallel ranks (their all-reduces and the hand-overs in the decode graphs)."""
    path = make_model(str(tmp_path), "llama", num_hidden_layers=4, max_position_embeddings=2048, vocab_size=401)
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    ref = _greedy(LLM(path, **kw))
    four = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **kw)
    try:
        assert _greedy(four) == ref
        assert four.engine.runner.graphs.replays > 0
    finally:
        four.engine.shutdown()
