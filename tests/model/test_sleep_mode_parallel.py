"""Sleep mode under tensor and pipeline parallelism on the CPU (gloo): every rank releases and restores its own
weights and KV cache (the workers' storages are checked inside them: tests/worker_probes.py), greedy outputs after
wake-up are the ones before sleep, level 2 reloads each rank's own shard / stage from the checkpoint, and a worker's
failure at wake-up is an error in the engine, not a hang."""
from __future__ import annotations

import os
import signal

import pytest

import worker_probes as probes
from tiny_models import make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams
from voltllm.distributed.executor import TPWorkerError

PROMPTS = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(50, 61))}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4, block_size=16,
              enable_sleep_mode=True)
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3", num_hidden_layers=4)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def llm(request, qwen3_path):
    llm = LLM(qwen3_path, **LAYOUTS[request.param], **ENGINE)
    yield llm
    llm.engine.shutdown()


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _bytes(llm, probe) -> list[int]:
    """probe's bytes on every rank, rank 0 first."""
    return [probe(llm.engine.runner)] + llm.engine.tp_workers.call_on_workers(probe)


def _check_asleep(llm, weights: bool, kv: bool) -> None:
    assert llm.is_sleeping()
    w, k = _bytes(llm, probes.weight_bytes), _bytes(llm, probes.kv_bytes)
    assert all(b == 0 for b in w) if weights else all(b > 0 for b in w), w
    assert all(b == 0 for b in k) if kv else all(b > 0 for b in k), k
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.cached
    llm.engine.check_integrity()


@pytest.mark.parametrize("level", [1, 2])
def test_every_rank_sleeps_and_wakes(llm, level):
    before = _tokens(llm)
    llm.sleep(level=level)
    _check_asleep(llm, weights=True, kv=True)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert all(b > 0 for b in _bytes(llm, probes.weight_bytes) + _bytes(llm, probes.kv_bytes))
    assert _tokens(llm) == before
    llm.engine.check_integrity()


def test_wake_up_by_tag(llm):
    before = _tokens(llm)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    _check_asleep(llm, weights=False, kv=True)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and _tokens(llm) == before


def test_level_2_reloads_the_workers_own_weights(llm):
    """Weights overwritten on rank 1 only: level 1 restores them as they were (still wrong), level 2 reloads rank
    1's own shard / stage from the checkpoint (right again)."""
    before = _tokens(llm)
    workers = llm.engine.tp_workers
    workers.call_on_workers(probes.scale_weights, 0.5, 1)
    assert llm.engine.reset_prefix_cache()  # (the cached prompts' KV was computed with the right weights)
    wrong = _tokens(llm)
    assert wrong != before
    llm.sleep(level=1)
    llm.wake_up()
    assert _tokens(llm) == wrong, "level 1 restores each rank's weights as they were at sleep"
    llm.sleep(level=2)
    llm.wake_up()
    assert _tokens(llm) == before


@pytest.mark.parametrize("failing", [1, 0])
def test_out_of_memory_at_wake_up(llm, failing):
    """A rank runs out of memory restoring the weights: the engine raises it (a worker's naming its rank), every
    rank's weights sleep again (the other ranks' came back and are released again), and a later wake_up succeeds."""
    before = _tokens(llm)
    llm.sleep(level=1)
    if failing:
        llm.engine.tp_workers.call_on_workers(probes.fail_next_restore, failing)
    else:
        probes.fail_next_restore(llm.engine.runner, 0)
    with pytest.raises(RuntimeError, match=("rank 1: " if failing else "^") + "not enough cpu memory to wake up the "
                       "weights"):
        llm.wake_up()
    _check_asleep(llm, weights=True, kv=True)
    llm.wake_up()
    assert not llm.is_sleeping() and _tokens(llm) == before


def test_a_worker_failing_in_sleep_is_an_engine_error(qwen3_path):
    llm = LLM(qwen3_path, pipeline_parallel_size=2, **ENGINE)
    try:
        llm.engine.tp_workers.fail_worker(1, "injected failure")
        with pytest.raises(TPWorkerError, match="tensor-parallel worker 1 failed: RuntimeError: injected failure"):
            llm.sleep(level=1)
        with pytest.raises(TPWorkerError, match="worker 1 failed"):
            llm.wake_up()
    finally:
        llm.engine.shutdown()


def test_a_worker_killed_while_asleep_is_reported_at_wake_up(qwen3_path):
    llm = LLM(qwen3_path, tensor_parallel_size=2, **ENGINE)
    try:
        llm.sleep(level=2)
        os.kill(llm.engine.tp_workers.procs[0].pid, signal.SIGKILL)
        with pytest.raises(TPWorkerError, match="tensor-parallel worker 1 exited"):
            llm.wake_up()
    finally:
        llm.engine.shutdown()


def test_hybrid_under_tp2_pp2(tmp_path):
    """-tp 2 -pp 2 on a Gated DeltaNet hybrid: four ranks release their recurrent-state slots and snapshots too."""
    path = make_tiny_hybrid(str(tmp_path), "qwen3_5", seed=0, gen_seed=1, num_hidden_layers=8)
    if path is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    kw = dict(ENGINE, block_size=4, mamba_block_size=8, max_num_batched_tokens=9, skip_tokenizer_init=True)
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 190 for i in range(n)]} for n in (19, 5)]
    four = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **kw)
    try:
        assert len(four.engine.tp_workers.procs) == 3
        before = [o.outputs[0].token_ids for o in four.generate(prompts, GREEDY, use_tqdm=False)]
        for level in (1, 2):
            four.sleep(level)
            _check_asleep(four, weights=True, kv=True)
            four.wake_up()
            assert [o.outputs[0].token_ids for o in four.generate(prompts, GREEDY, use_tqdm=False)] == before
            four.engine.check_integrity()
    finally:
        four.engine.shutdown()
