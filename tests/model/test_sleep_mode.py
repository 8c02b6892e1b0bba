"""Sleep mode (vLLM's LLM(enable_sleep_mode=True).sleep / wake_up / is_sleeping) on the CPU: the weights' and the KV
cache's storages are released (0 bytes) and restored; greedy outputs after wake-up are the ones before sleep."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_model, make_tiny_hybrid
from voltllm import SamplingParams
from voltllm.config import ConfigError
from voltllm.engine.types import EngineCoreRequest

PROMPTS = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(50, 61))}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _llm(path, **kw):
    from voltllm.entrypoints.llm import LLM

    kw.setdefault("enable_sleep_mode", True)
    return LLM(path, device="cpu", dtype="float32", enforce_eager=True, max_num_seqs=4, block_size=16, **kw)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3")


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return _llm(qwen3_path)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _weight_bytes(llm) -> int:
    return sum(p.untyped_storage().nbytes() for p in llm.engine.runner.model.parameters())


def _kv_bytes(llm) -> int:
    return sum(t.untyped_storage().nbytes() for t in llm.engine.runner.kv_caches)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_and_wake_up_restores(llm, level):
    before = _tokens(llm)
    assert _weight_bytes(llm) > 0 and _kv_bytes(llm) > 0
    llm.sleep(level=level)
    assert llm.is_sleeping()
    assert _weight_bytes(llm) == 0 and _kv_bytes(llm) == 0, "the device storages must be released"
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.cached, "every KV block free, no cached prefix"
    llm.engine.check_integrity()
    llm.wake_up()
    assert not llm.is_sleeping()
    after = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == before
    assert after[0].num_cached_tokens == 0, "the prefix cache was forgotten at sleep"
    llm.engine.check_integrity()


def test_wake_up_by_tag(llm):
    before = _tokens(llm)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and _weight_bytes(llm) > 0 and _kv_bytes(llm) == 0
    with pytest.raises(ValueError, match="the engine is sleeping"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])  # (awake already: a warning, nothing changes)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and _kv_bytes(llm) > 0
    assert _tokens(llm) == before


def test_kv_cache_first_then_weights(llm):
    before = _tokens(llm)
    llm.sleep(level=1)
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping() and _weight_bytes(llm) == 0 and _kv_bytes(llm) > 0
    llm.wake_up(tags=["weights"])
    assert _tokens(llm) == before


def test_level_2_reload_really_reloads(llm):
    """The level-2 weights come from the checkpoint: overwritten parameters are the checkpoint's again after wake-up
    (level 1 would restore the overwritten values)."""
    before = _tokens(llm)
    with torch.no_grad():
        for p in llm.engine.runner.model.parameters():
            p.mul_(0.5)
    assert _tokens(llm) != before
    llm.sleep(level=2)
    llm.wake_up()
    assert _tokens(llm) == before


def test_level_1_restores_what_was_there(llm):
    before = _tokens(llm)
    first = next(llm.engine.runner.model.parameters())
    with torch.no_grad():
        first.add_(1.0)
        changed = first.clone()
    llm.sleep(level=1)
    llm.wake_up()
    assert torch.equal(first, changed), "level 1 restores the weights as they were at sleep"
    with torch.no_grad():
        first.sub_(1.0)
    assert _tokens(llm) == before


def test_bad_level_tag_and_repeated_calls(llm):
    for level in (0, 3, "1", True):
        with pytest.raises(ValueError, match="sleep level must be 1"):
            llm.sleep(level=level)
    assert not llm.is_sleeping()
    for tags in (["weight"], "weights", []):
        with pytest.raises(ValueError, match="tag"):
            llm.wake_up(tags=tags)
    llm.wake_up()  # (not sleeping: a warning)
    llm.sleep(level=1)
    llm.sleep(level=2)  # (already sleeping: a warning, still level 1)
    assert llm.engine.sleep_state.level == 1
    with pytest.raises(ValueError, match="unknown wake_up tag 'kv'"):
        llm.wake_up(tags=["kv"])
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()


def test_sleep_aborts_unfinished_requests_and_frees_their_blocks(llm):
    core = llm.engine
    core.add_request(EngineCoreRequest("r1", PROMPTS[0]["prompt_token_ids"], SamplingParams(max_tokens=50)))
    core.add_request(EngineCoreRequest("r2", PROMPTS[1]["prompt_token_ids"], SamplingParams(max_tokens=50)))
    core.step()
    core.step()
    assert core.kv.pool.num_free_blocks < core.kv.pool.num_blocks
    outputs = core.sleep(1)
    finished = {o.request_id: o.finish_reason for o in outputs if o.finish_reason is not None}
    assert finished == {"r1": "abort", "r2": "abort"}
    assert not core.has_unfinished_requests()
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    core.check_integrity()
    core.wake_up()
    core.check_integrity()


def test_sleep_mode_off_is_refused(qwen3_path):
    llm = _llm(qwen3_path, enable_sleep_mode=False)
    with pytest.raises(ValueError, match="sleep mode is off.*enable_sleep_mode=True"):
        llm.sleep()
    with pytest.raises(ValueError, match="sleep mode is off"):
        llm.wake_up()
    assert llm.is_sleeping() is False


def test_weight_offloading_is_refused(qwen3_path):
    """(Tensor and pipeline parallelism run it: tests/model/test_sleep_mode_parallel.py)"""
    with pytest.raises(ConfigError, match="--enable-sleep-mode: not built with weight offloading"):
        _llm(qwen3_path, cpu_offload_gb=1)


def test_a_tied_llama_and_a_hybrid_sleep_and_wake(tmp_path):
    """Tied embeddings share one storage; a hybrid's recurrent-state slots and snapshots are KV-cache memory too."""
    llama = _llm(make_model(str(tmp_path / "llama"), "llama"))
    before = _tokens(llama)
    for level in (1, 2):
        llama.sleep(level)
        llama.wake_up()
        assert _tokens(llama) == before
    path = make_tiny_hybrid(str(tmp_path / "hybrid"), "qwen3_5", seed=0, gen_seed=0)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    hybrid = _llm(path, skip_tokenizer_init=True, mamba_block_size=16)
    before = _tokens(hybrid)
    runner = hybrid.engine.runner
    for level in (1, 2):
        hybrid.sleep(level)
        assert runner.state_cache._ssm_all.untyped_storage().nbytes() == 0
        assert runner.state_snapshots.store._ssm_all.untyped_storage().nbytes() == 0
        hybrid.wake_up()
        assert _tokens(hybrid) == before
        hybrid.engine.check_integrity()


def test_a_sleep_that_runs_out_of_host_memory_leaves_the_engine_awake(qwen3_path, monkeypatch):
    """Every host copy is taken before anything is released: the failure leaves every weight in place."""
    import voltllm.worker.sleep_mode as sleep_mode

    llm = _llm(qwen3_path)
    before = _tokens(llm)
    real_empty, copies = torch.empty, [0]

    def empty(*args, **kw):
        if "pin_memory" in kw:  # (the host copies)
            copies[0] += 1
            if copies[0] > 5:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_empty(*args, **kw)

    monkeypatch.setattr(sleep_mode.torch, "empty", empty)
    with pytest.raises(RuntimeError, match="failed before releasing anything, the engine stays awake"):
        llm.sleep(1)
    monkeypatch.undo()
    assert not llm.is_sleeping()
    assert all(p.untyped_storage().nbytes() > 0 for p in llm.engine.runner.model.parameters())
    assert _tokens(llm) == before


def test_a_level_2_reload_from_a_broken_checkpoint_stays_asleep_and_can_be_retried(tmp_path):
    import os
    import shutil

    path = make_model(str(tmp_path / "m"), "qwen3")
    llm = _llm(path)
    before = _tokens(llm)
    llm.sleep(2)
    f = os.path.join(path, "model.safetensors")
    shutil.move(f, f + ".bak")
    with open(f, "wb") as out:
        out.write(b"\x00" * 16)  # (a checkpoint being rewritten in place)
    with pytest.raises(RuntimeError, match="reloading the weights from the checkpoint failed"):
        llm.wake_up()
    assert llm.is_sleeping()
    shutil.move(f + ".bak", f)
    llm.wake_up()
    assert not llm.is_sleeping() and _tokens(llm) == before
