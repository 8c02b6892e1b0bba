"""This session's flags on a CUDA GPU (written while no GPU was lent; run with `pytest -m gpu`): --max-model-len auto
fits the context to the sized cache, --kv-cache-memory-bytes sizes it, --compilation-config's capture sizes are the
decode graphs captured, and the sampled tokens' vocabulary ranks match a reference from the logits."""
import pytest
import torch

from tiny_models import make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox jumps", "Hi", "0123456789 " * 30]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=100_000)


def _greedy(llm, n=16):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, min_tokens=n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_auto_length_with_a_fixed_cache_size(tiny):
    per_block = 3 * 2 * 2 * 16 * 2 * 16  # layers x K,V x KV heads x head dim x fp16 x block
    llm = LLM(tiny, device="cuda", dtype="float16", max_model_len="auto", kv_cache_memory_bytes=300 * per_block)
    assert llm.engine.kv.num_blocks == 300 and llm.config.model.max_model_len == 300 * 16
    ref = LLM(tiny, device="cuda", dtype="float16", max_model_len=4800, gpu_memory_utilization=0.3)
    assert _greedy(llm) == _greedy(ref)
    llm.engine.check_integrity()


def test_auto_length_with_the_utilization_share(tiny):
    llm = LLM(tiny, device="cuda", dtype="float16", max_model_len="auto", gpu_memory_utilization=0.2)
    r = llm.engine.runner
    assert llm.config.model.max_model_len == min(100_000, r.num_blocks * r.block_size)
    assert len(_greedy(llm)[0]) == 16


def test_a_fixed_cache_larger_than_the_card_is_refused(tiny):
    with pytest.raises(RuntimeError, match="--kv-cache-memory-bytes .* does not fit"):
        LLM(tiny, device="cuda", dtype="float16", max_model_len=4096, kv_cache_memory_bytes=10 * 2**40)


def test_capture_sizes_are_the_graphs_captured(tiny):
    llm = LLM(tiny, device="cuda", dtype="float16", max_model_len=4096, gpu_memory_utilization=0.3,
              compilation_config={"cudagraph_capture_sizes": [1, 3, 8]})
    assert llm.engine.runner.graphs.sizes == [1, 3, 8]
    assert len(_greedy(llm)[0]) == 16 and llm.engine.runner.graphs.replays > 0


def test_sampled_token_ranks_on_the_gpu():
    from voltllm.sampling.sampler import token_ranks

    gen = torch.Generator(device="cuda").manual_seed(0)
    logprobs = torch.randn(64, 151_936, device="cuda", generator=gen).log_softmax(-1)
    chosen_ids = torch.randint(0, 151_936, (64,), device="cuda", generator=gen)
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1)
    want = (logprobs.cpu() >= chosen.cpu()[:, None]).sum(-1)
    assert torch.equal(token_ranks(logprobs, chosen).cpu(), want)
