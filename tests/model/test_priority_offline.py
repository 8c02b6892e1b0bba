"""LLM(scheduling_policy="priority").generate(..., priority=[...]) (vLLM's): with room for one sequence, a later prompt
with a higher priority (lower value) runs first; outputs stay in the prompts' order and equal their fcfs runs; under
fcfs a non-zero priority is a ValueError before anything runs."""
from __future__ import annotations

import pytest

from tiny_models import make_model
from voltllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (9, 14, 6, 11)]
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_priority")), "llama", max_position_embeddings=256)


def _llm(path, policy):
    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, block_size=4, max_num_seqs=1,
               skip_tokenizer_init=True, scheduling_policy=policy)


def _run_order(outs):
    return sorted(range(len(outs)), key=lambda i: outs[i].metrics.scheduled_time)


def test_a_later_higher_priority_prompt_runs_first(path):
    fcfs = _llm(path, "fcfs").generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _run_order(fcfs) == [0, 1, 2, 3]
    llm = _llm(path, "priority")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[3, 1, 0, 1])
    assert _run_order(outs) == [2, 1, 3, 0]  # priority 0, then the two 1s in submission order, then 3
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fcfs]
    assert _run_order(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == [0, 1, 2, 3]  # all 0: arrival order


def test_priority_is_checked_before_anything_runs(path):
    llm = _llm(path, "fcfs")
    with pytest.raises(ValueError, match="Got priority 2 but Priority scheduling is not enabled"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0, 2])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0, 0])) == 2
    prio = _llm(path, "priority")
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        prio.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority must be an integer, got 0.5"):
        prio.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[1, 0.5])
    assert not prio.engine.has_unfinished_requests()


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_preemption_under_priority_keeps_outputs_and_frees_everything(tmp_path, kind):
    """A KV cache too small for the batch (async scheduling, chunked prefill, prefix caching; a hybrid's state slots
    and snapshots): the lowest-priority requests are preempted and recomputed, outputs equal an uncontended run's,
    greedy and seeded, and nothing is left held."""
    from tiny_models import make_tiny_hybrid

    if kind == "hybrid":
        model = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", seed=0, gen_seed=0)
        if model is None:
            pytest.skip("this transformers has no qwen3_5")
        kw = dict(block_size=16, mamba_block_size=16, num_gpu_blocks_override=9, max_num_batched_tokens=32)
    else:
        model = make_model(str(tmp_path / "tiny"), "qwen3", max_position_embeddings=256)
        kw = dict(block_size=4, num_gpu_blocks_override=24, max_num_batched_tokens=32)
    prompts = [{"prompt_token_ids": list(range(5 + i, 5 + i + n))} for i, n in enumerate((30, 21, 37, 26, 33))]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, seed=11)
    params = [greedy, seeded, greedy, seeded, greedy]
    common = dict(device="cpu", dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_num_seqs=4)
    free = LLM(model, **common).generate(prompts, params, use_tqdm=False)
    tight = LLM(model, scheduling_policy="priority", **common, **kw)
    outs = tight.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1, 0, 3])
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in free]
    tight.engine.check_integrity()
    assert tight.engine.kv.usage() == 0.0 and not tight.engine.scheduler.requests
