"""The start-up mixed-step warm-up (voltllm/worker/warm_up.py) on tiny dense and hybrid MoE models (CPU): one forward
of a decode row and two prompts of unequal lengths, on the runner's own caches, that stores nothing. Which kernels it
compiles on the GPU: benchmarks/micro/bench_compiles.py; the compat backend's route for its metadata:
tests/unit/_fp8_kv_interp_check.py (compat_warm_up_mixed_step)."""
import pytest
import torch

from tiny_models import make_model, make_tiny_hybrid, small_moe
from voltllm.config import EngineArgs
from voltllm.worker.warm_up import WARM_UP_QUERY_LENS, mixed_step_forward, mixed_step_metadata


def _runner(path: str):
    from voltllm.worker.runner import ModelRunner

    cfg = EngineArgs(model=path, device="cpu", dtype="float32", max_model_len=256).create_engine_config()
    runner = ModelRunner(cfg)
    runner.initialize_kv_cache()
    return runner


def test_metadata_is_a_decode_row_and_two_unequal_prompts_storing_nothing():
    meta = mixed_step_metadata(torch.device("cpu"))
    lens = [b - a for a, b in zip(meta.query_start_loc_cpu, meta.query_start_loc_cpu[1:])]
    assert lens == list(WARM_UP_QUERY_LENS) == meta.seq_lens_cpu  # every sequence from token 0
    assert lens[0] == 1 and len(set(lens[1:])) == len(lens) - 1 and min(lens[1:]) > 1
    assert meta.longest_one_row_context == 1 and not meta.is_pure_decode
    assert bool((meta.slot_mapping == -1).all()) and meta.slot_mapping.numel() == meta.num_tokens
    assert meta.block_tables.shape == (len(lens), max(lens)) and not bool(meta.block_tables.any())


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5_moe"])
def test_warm_up_forward_runs_and_stores_nothing(tmp_path, kind):
    path = (make_model(str(tmp_path), "qwen3") if kind == "qwen3"
            else make_tiny_hybrid(str(tmp_path), kind, 3, 4, **small_moe(kind)))
    if path is None:
        pytest.skip(f"this transformers has no {kind}")
    runner = _runner(path)
    caches = [c.clone() for c in runner.kv_caches]
    state = runner.state_cache
    states = [t.clone() for t in (state.ssm + state.conv)] if state is not None else []
    hidden = mixed_step_forward(runner)
    assert hidden.shape[0] == sum(WARM_UP_QUERY_LENS) and bool(torch.isfinite(hidden).all())
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches))
    if state is not None:
        assert all(torch.equal(a, b) for a, b in zip(states, state.ssm + state.conv))
