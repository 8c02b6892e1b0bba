"""The speculative round micros (benchmarks/micro/) on the CPU, on a tiny random hybrid target.

dflash_round.py: its whole measurement (plain step, DFlash round) with a drafter of its own head layout; the engine
sizing it does for a hybrid's recurrent states (state bytes per request = the engine's StateCache, --max-num-seqs
capped by --state-gib); the drafter configs it writes for the named shapes (the 27B's public layout, the 8B's as
before) pass the engine's DFlash checks. hybrid_spec_round.py and mtp_round.py: their main() end to end. All three:
each engine is freed before the next is built (two 27B-shape engines do not fit the GPU together)."""
import json
import weakref
from pathlib import Path

import pytest

from interp_util import load_script
from tiny_models import make_tiny_hybrid
from voltllm import LLM

MICRO = Path(__file__).resolve().parents[2] / "benchmarks" / "micro"


@pytest.fixture(scope="module")
def micros():
    """name -> the script loaded as a module (each its own copy, so patches stay within a test)."""
    import sys

    sys.path.insert(0, str(MICRO))  # (their `from hybrid_spec_round import ...`)
    try:
        yield lambda name: load_script(MICRO / f"{name}.py")
    finally:
        sys.path.remove(str(MICRO))


@pytest.fixture(scope="module")
def micro(micros):
    return micros("dflash_round")


def _track_engines(monkeypatch, mod) -> list:
    """Wrap mod._engine: every engine it builds is recorded (weakly), and none may be built while an earlier one is
    alive."""
    built: list = []
    engine = mod._engine

    def engine_freeing_the_last(*args):
        assert all(ref() is None for ref in built), "the previous engine is still alive"
        llm = engine(*args)
        built.append(weakref.ref(llm.engine.runner.model))
        return llm

    monkeypatch.setattr(mod, "_engine", engine_freeing_the_last)
    return built


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = make_tiny_hybrid(str(tmp_path_factory.mktemp("qwen3_5")), "qwen3_5", seed=0, gen_seed=1)
    if path is None:
        pytest.skip("this transformers has no qwen3_5")
    return path


def test_state_sizing_matches_the_engine(micro, hybrid, tmp_path):
    per = micro.state_bytes_per_request(hybrid, "float32")
    drafter = micro.write_drafter(hybrid, str(tmp_path), 1, 16)
    llm = LLM(hybrid, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_num_seqs=5,
              speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": 3})
    runner = llm.engine.runner
    from voltllm.model.state_cache import StateCache

    assert per == StateCache.bytes_per_slot(runner.model.state_spec) > 0
    assert runner.state_cache_bytes() == (1 + 5 * (3 + 1)) * per  # n + 1 + n x K states
    # batch x (K + 1) rows, capped where the states would pass the budget, never under the batch
    assert micro.engine_rows(1, 15, per, 1e12) == 16 and micro.engine_rows(4, 15, 0, 0) == 64
    assert micro.engine_rows(4, 15, per, (1 + 17 * 16) * per) == 17
    assert micro.engine_rows(4, 15, per, 10 * per) == 4


def test_measures_plain_and_dflash_rounds_on_a_hybrid(micro, hybrid, tmp_path, capsys, monkeypatch):
    per = micro.state_bytes_per_request(hybrid, "float32")
    built = _track_engines(monkeypatch, micro)
    out = tmp_path / "round.json"
    # room for 1 + 5 x (K + 1) states: batch 1 gets its 4 rows, batch 2 five of its 8
    gib = (1 + 5 * 4) * per / 2**30
    assert micro.main(["--target", hybrid, "-k", "3", "--batch", "1,2", "--layers", "2", "--heads", "2",
                       "--kv-heads", "1", "--head-dim", "16", "--intermediate", "48", "--layer-ids", "1,3",
                       "--dtype", "float32", "--output-len", "6", "--state-gib", str(gib), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["drafter"] == {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                                 "intermediate_size": 48, "block_size": 16, "target_layer_ids": [1, 3]}
    assert result["state_bytes_per_request"] == per
    assert [(r["batch"], r["k"], r["spec"]["max_num_seqs"]) for r in result["rows"]] == [(1, 3, 4), (2, 3, 5)]
    for r in result["rows"]:
        assert r["plain"]["step_ms"] > 0 and r["spec"]["step_ms"] > 0
        assert r["spec"]["drafts"] > 0 and 0 <= r["spec"]["acceptance"] <= 1
        assert r["spec"]["graph_replays"] == {"verify": None, "block": None}  # the CPU captures no graphs
        assert set(r["projected_tok_s"]) == {"2.0", "3.7", "5.0", "6.5"}
    assert "--max-num-seqs 5, graph replays" in capsys.readouterr().out
    assert len(built) == 4 and all(ref() is None for ref in built)


@pytest.mark.parametrize("shape, heads, kv, dim, inter, ids", [
    ("qwen3.5-27b-shape", 32, 8, 128, 17408, [1, 16, 31, 46, 61]),  # the public drafter's layout, not the target's
    ("qwen3-8b-shape", 32, 8, 128, 12288, [1, 9, 17, 25, 33]),  # the target's own layout (as before)
])
def test_named_shape_drafters_pass_the_engine_checks(micro, tmp_path, shape, heads, kv, dim, inter, ids):
    from transformers import AutoConfig

    from voltllm.bench.shapes import materialize
    from voltllm.engine.dflash import dflash_params

    target = materialize(shape, str(tmp_path))
    drafter = micro.write_drafter(target, str(tmp_path), 5, 16, micro.DRAFTER_LAYOUTS.get(shape))
    d = json.loads((Path(drafter) / "config.json").read_text())
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"], d["intermediate_size"],
            d["dflash_config"]["target_layer_ids"]) == (heads, kv, dim, inter, ids)
    params = dflash_params(AutoConfig.from_pretrained(drafter), AutoConfig.from_pretrained(target), 15)
    assert params.block_size == 16 and list(params.target_layer_ids) == ids and params.v2 is None
    v2 = micro.write_drafter(target, str(tmp_path / "v2"), 5, 16, micro.DRAFTER_LAYOUTS.get(shape), micro.DFLASH2_KEYS)
    params = dflash_params(AutoConfig.from_pretrained(v2), AutoConfig.from_pretrained(target), 15)
    assert params.v2 is not None and params.v2.selector_top_k == 16 and params.v2.conv_group_size == 16


def test_hybrid_spec_round_runs(micros, hybrid, tmp_path, monkeypatch):
    from voltllm.engine.scheduler import Scheduler

    mod = micros("hybrid_spec_round")
    monkeypatch.setattr(Scheduler, "_propose", Scheduler._propose)  # (main patches in its oracle: restored after)
    built = _track_engines(monkeypatch, mod)
    out = tmp_path / "round.json"
    monkeypatch.setattr("sys.argv", ["hybrid_spec_round.py", "--target", hybrid, "-k", "3", "--batch", "1,2",
                                     "--dtype", "float32", "--output-len", "8", "--out", str(out)])
    assert mod.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["round_rejected"]["accepted"] == 0 and r["round_accepted"]["acceptance"] > 0.9
        assert r["same_tokens"] == 1.0  # float32 on the CPU: no near-ties between the verification and decode
    assert len(built) == 4 and all(ref() is None for ref in built)


def test_mtp_round_runs(micros, hybrid, tmp_path, monkeypatch):
    from voltllm.worker.mtp_runner import MTPRunner

    mod = micros("mtp_round")
    monkeypatch.setattr(MTPRunner, "propose", MTPRunner.propose)  # (main patches in its oracle: restored after)
    built = _track_engines(monkeypatch, mod)
    out = tmp_path / "round.json"
    monkeypatch.setattr("sys.argv", ["mtp_round.py", "--target", hybrid, "-k", "1,2", "--batch", "2",
                                     "--dtype", "float32", "--output-len", "8", "--out", str(out)])
    assert mod.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["k"] for r in rows] == [1, 2]
    for r in rows:
        assert r["round_oracle_drafts"]["acceptance"] > 0.9 and r["same_tokens"] == 1.0
    assert len(built) == 3 and all(ref() is None for ref in built)
