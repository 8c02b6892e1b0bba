"""LLM.reset_prefix_cache() (vLLM's): later prompts get no hits from earlier ones and give the same greedy output;
a hybrid's state snapshots go too; nothing changes while a request holds blocks."""
from __future__ import annotations

import pytest

from tiny_models import make_model, make_tiny_hybrid
from voltllm import SamplingParams
from voltllm.engine.types import EngineCoreRequest

PROMPT = {"prompt_token_ids": list(range(3, 70))}
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _llm(path, **kw):
    from voltllm.entrypoints.llm import LLM

    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=2, **kw)


def test_reset_drops_the_hits(tmp_path):
    llm = _llm(make_model(str(tmp_path / "tiny"), "llama"), block_size=16)
    first = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    again = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache() is True
    fresh = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].token_ids == first.outputs[0].token_ids


def test_no_reset_while_a_request_holds_blocks(tmp_path):
    llm = _llm(make_model(str(tmp_path / "tiny"), "llama"), block_size=16)
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    core = llm.engine
    core.add_request(EngineCoreRequest("r", PROMPT["prompt_token_ids"], SamplingParams(max_tokens=50)))
    core.step()
    assert core.reset_prefix_cache() is False
    assert core.kv.pool.cached, "the cache must be left as it was"
    core.abort_requests(["r"])
    while core.has_unfinished_requests():
        core.step()
    assert core.reset_prefix_cache() is True and not core.kv.pool.cached


def test_reset_drops_a_hybrids_state_snapshots(tmp_path):
    path = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", seed=0, gen_seed=0)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    llm = _llm(path, skip_tokenizer_init=True, block_size=16, mamba_block_size=16)
    first = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    snapshots = llm.engine.runner.state_snapshots
    assert snapshots is not None and len(snapshots) > 0
    assert llm.reset_prefix_cache() is True and len(snapshots) == 0
    fresh = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].token_ids == first.outputs[0].token_ids
