"""`voltllm bench --scenario kernels` on the CPU: layer shapes of the named model shapes, the timing / agreement
harness (the reference on both sides, so it runs without a GPU), the report file, the refusal without CUDA, and
every case with the real Triton kernels at tiny shapes under the Triton interpreter (a subprocess)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from interp_util import check_names, run_interp_checks
from voltllm.bench import limits as L
from voltllm.bench.kernel_cases import LayerShapes, Sizes, build_cases
from voltllm.bench.kernel_timings import format_kernel_table, relerr, run_cases

CPU = torch.device("cpu")
TINY = LayerShapes(hidden=64, gdn=(2, 4, 16, 16, 4), moe=(8, 2, 32, True))
TINY_SIZES = Sizes(prefill=((70,), (20, 9)), decode=(1, 3), moe_tokens=(1, 5))
HELPER = Path(__file__).with_name("_bench_kernels_interp_check.py")


def test_layer_shapes_of_the_named_shapes():
    from voltllm.bench.shapes import make_config

    assert LayerShapes.from_config(make_config("qwen3.5-27b-shape")) == LayerShapes(5120, (16, 48, 128, 128, 4))
    assert LayerShapes.from_config(make_config("qwen3.5-35b-a3b-shape")) == LayerShapes(
        2048, (16, 32, 128, 128, 4), (256, 8, 512, True))
    assert LayerShapes.from_config(make_config("qwen3-next-80b-a3b-shape")) == LayerShapes(
        2048, (16, 32, 128, 128, 4), (512, 10, 512, True))
    assert LayerShapes.from_config(make_config("qwen3-8b-shape")) == LayerShapes(4096)


def test_relerr():
    assert relerr(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])) == (0.0, 0.0)
    assert relerr(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0])) == pytest.approx((0.2, 1.0))


def test_harness_on_cpu_with_the_reference_on_both_sides():
    cases, _ = build_cases(TINY, torch.float32, CPU, TINY_SIZES, use_triton=False)
    assert [(c.kernel, c.label) for c in cases] == [
        ("gdn_chunk", "1x70"), ("gdn_chunk", "20+9"), ("gdn_decode", "b1"), ("gdn_decode", "b3"),
        ("conv_decode", "b1"), ("conv_decode", "b3"), ("conv_prefill", "1x70"), ("conv_prefill", "20+9"),
        ("moe", "t1"), ("moe", "t5")]
    dev = L.DeviceLimits("cpu", 10.0, 1.0, "float32", 1, 1)
    rows = run_cases(cases, CPU, torch.float32, iters=2, ref_iters=1, warmup=1, dev=dev)
    for r in rows:
        assert r["relerr"] == 0.0 and r["ok"] and r["tol"] == 1e-3, r
        assert r["ms"] > 0 and r["ref_ms"] > 0 and len(r["ms_samples"]) == 2 and len(r["ref_ms_samples"]) == 1
        assert r["graph_ms"] is None and r["rate_from"] == "ms" and r["speedup"] > 0
    by = {(r["kernel"], r["case"]): r for r in rows}
    dec = by["gdn_decode", "b3"]  # fp32 state read + written, q k v in, out, g and beta
    assert dec["bytes"] == 3 * (4 * 16 * 16 * 4 * 2 + (2 * 2 * 16 + 2 * 4 * 16) * 4 + 4 * 8)
    assert dec["memory_bound"] and dec["copy_ratio"] == pytest.approx(dec["GBps"] / 10.0)
    assert set(dec["relerr_parts"]) == {"out", "state"}
    conv = by["conv_decode", "b1"]  # conv channels 2*2*16 + 4*16 = 128, kernel 4
    assert conv["bytes"] == 128 * 4 * 4 + 128 * 4 * (2 + 2 * 3)
    assert by["conv_prefill", "20+9"]["bytes"] == 128 * 4 * 4 + 2 * 29 * 128 * 4 + 2 * 2 * 3 * 128 * 4
    assert by["gdn_chunk", "1x70"]["flops"] == 70 * 4 * (6 * 16 * 16 + 4 * 64 * 16 + 4 * 64 * 16)
    moe = by["moe", "t5"]
    assert moe["flops"] == 2 * 5 * 2 * 3 * 32 * 64 and moe["matmul_ratio"] is None  # fp32: no tensor cores
    weights = moe["bytes"] - 2 * 5 * 64 * 4
    assert weights % (3 * 32 * 64 * 4) == 0 and 2 <= weights // (3 * 32 * 64 * 4) <= 8  # active experts
    table = format_kernel_table(rows, "tiny")
    assert table.splitlines()[0] == "tiny" and "MISMATCH" not in table and "conv_decode" in table


def test_a_wrong_kernel_is_flagged_and_sides_do_not_share_state():
    case = build_cases(TINY, torch.float32, CPU, Sizes(prefill=(), decode=(2,), moe_tokens=()), ["gdn_decode"],
                       use_triton=False)[0][0]
    ref = case.ref
    case.triton = lambda d: {k: v * 1.1 for k, v in ref(d).items()}  # writes its own copy of the pool
    row = run_cases([case], CPU, torch.float32, iters=1, ref_iters=1, warmup=0)[0]
    assert not row["ok"]
    # exactly 10%: the reference ran on the original pool, not on the one the "kernel" updated
    assert row["relerr_parts"]["out"] == pytest.approx(0.1, rel=1e-5)
    assert row["relerr_parts"]["state"] == pytest.approx(0.1, rel=1e-5)


def test_build_cases_selection():
    dense_gdn = LayerShapes(64, (2, 4, 16, 16, 4))
    assert build_cases(dense_gdn, torch.float32, CPU, TINY_SIZES, ["moe"], use_triton=False)[0] == []
    assert {c.kernel for c in build_cases(TINY, torch.float32, CPU, TINY_SIZES, ["moe", "conv_decode"],
                                          use_triton=False)[0]} == {"moe", "conv_decode"}
    with pytest.raises(ValueError, match="unknown"):
        build_cases(TINY, torch.float32, CPU, TINY_SIZES, ["gemv"])


def test_kernels_scenario_refuses_without_cuda():
    from voltllm.bench.cli import main

    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        main(["--scenario", "kernels", "--random-weights", "qwen3.5-27b-shape", "--device", "cpu"])


def test_kernels_scenario_report_on_cpu(tmp_path, monkeypatch):
    """The scenario end to end with its GPU-only parts swapped out: CPU device, tiny sizes, reference kernels."""
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, "Qwen3_5MoeTextConfig", None)
    if cls is None:
        pytest.skip("this transformers has no Qwen3_5MoeTextConfig")
    from voltllm.bench import kernel_timings as KT
    from voltllm.bench.cli import main

    model_dir = tmp_path / "tiny-moe"
    cls(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32).save_pretrained(model_dir)
    real = KT.build_cases
    monkeypatch.setattr(KT, "_device", lambda flag: CPU)
    monkeypatch.setattr(KT, "Sizes", lambda: TINY_SIZES)
    monkeypatch.setattr(KT, "build_cases", lambda *a, **k: real(*a, **k, use_triton=False))
    out = tmp_path / "results"
    argv = ["--scenario", "kernels", "--random-weights", str(model_dir), "--dtype", "float32", "--kernels",
            "gdn_decode,moe", "--kernel-iters", "2", "--kernel-ref-iters", "1", "--limit-copy-mib", "4",
            "--limit-matmul-n", "64", "--limit-iters", "2", "--output-dir", str(out), "--name", "k", "--commit", "abc"]
    assert main(argv) == 0
    res = json.loads((out / "k.json").read_text())
    for key in ("name", "gpu", "commit", "command", "created", "model", "metrics", "limit", "env", "config"):
        assert key in res, key
    assert res["name"] == "k" and res["commit"] == "abc" and res["command"].startswith("voltllm bench --scenario")
    assert res["model"]["layers"]["moe"] == {"experts": 8, "top_k": 2, "intermediate": 32, "renormalize": True}
    assert res["model"]["dtype"] == "float32"
    m = res["metrics"]
    assert m["all_ok"] and set(m["speedup"]) == {"gdn_decode/b1", "gdn_decode/b3", "moe/t1", "moe/t5"}
    assert {r["kernel"] for r in m["kernels"]} == {"gdn_decode", "moe"}
    assert res["limit"]["copy_GBps"] > 0 and all(r["copy_ratio"] > 0 for r in m["kernels"] if r["memory_bound"])


CHECKS = check_names(HELPER)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, str]:
    return run_interp_checks(HELPER, ('cpu',), timeout=600, shared=True)


@pytest.mark.parametrize("name", CHECKS)
def test_bench_kernel_case_with_triton_interpreter(interp_results, name):
    assert name in interp_results, f"case {name} did not run"
    assert interp_results[name].startswith("ok"), interp_results[name]
