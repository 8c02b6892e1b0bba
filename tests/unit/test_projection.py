"""The V100 roofline projection (voltllm.bench.projection): counted shapes, kernel arithmetic, calibration."""
from __future__ import annotations

import os

import pytest

from voltllm.bench import projection as pj

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "benchmarks", "results")


def test_counted_qwen3_8b_shape():
    s = pj.count_shape("qwen3-8b-shape")
    per_layer = 6144 * 4096 + 4096 * 4096 + 2 * 12288 * 4096 + 4096 * 12288  # qkv, o, gate_up, down
    assert s.linear_params == 36 * per_layer
    assert s.lm_head_params == s.embed_params == 151936 * 4096
    assert (s.attn_layers, s.q_heads, s.kv_heads, s.head_dim) == (36, 32, 8, 128)
    assert s.gdn_layers == 0
    # KV per token at fp16 = the bench's model_cost figure for this shape
    assert 2 * s.attn_layers * s.kv_heads * s.head_dim * 2 == 147456


def test_counted_qwen35_27b_shape():
    s = pj.count_shape("qwen3.5-27b-shape")
    total = s.linear_params + s.lm_head_params + s.embed_params + s.other_params
    assert 26.8e9 < total < 27.0e9  # MODELS.md: 26.9 B
    assert (s.attn_layers, s.gdn_layers) == (16, 48)  # 3:1 linear : full attention over 64 layers
    assert (s.q_heads, s.kv_heads, s.head_dim) == (24, 4, 256)
    assert s.ssm_elems == 48 * 128 * 128  # 48 value heads of 128 x 128 (key dim x value dim)
    assert s.conv_elems == 3 * (2 * 16 * 128 + 48 * 128)  # (kernel - 1) x conv channels (q, k, v)


def test_decode_step_by_hand():
    s = pj.count_shape("qwen3-8b-shape")
    gpu = pj.V100
    step = pj.decode_step(s, 1000, gpu=gpu, bw=900e9, tc=125e12)
    weights = s.linear_params * 2 + s.lm_head_params * 2 + s.other_params * 2 + s.hidden * 2
    assert step["weight_bytes"] == weights
    assert step["gemv_s"] == pytest.approx(weights / 900e9)
    assert step["kv_bytes"] == 1000 * 147456
    assert step["attention_bound"] == "memory"  # fp16 KV, group 4: bytes dominate the FMAs
    assert step["roofline_s"] == pytest.approx(step["gemv_s"] + step["attention_s"])
    # 4-bit weights: a quarter of the linear bytes
    q = pj.decode_step(s, 1000, gpu=gpu, bw=900e9, tc=125e12, weight_bits=4)
    assert weights - q["weight_bytes"] == pytest.approx(s.linear_params * 2 * 3 / 4)


def test_fma_kernel_arithmetic():
    # qwen3-8b: group 4 -> BLOCK_G 4; d128 -> BLOCK_N from the kernel's own rule
    from voltllm.kernels.attention.paged_decode import _default_block_n

    t = pj.fma_attention_time(1e9, 4, 128, "fp16", pj.V100, 796e9)
    bn = _default_block_n(128, 4, False, False)
    assert t["block_g"] == 4 and t["block_n"] == bn
    assert t["fma_per_elem"] == pytest.approx(4 + 4 / (2 * bn))
    assert t["bound"] == "memory"
    # 27B: group 6 pads to 8; fp8 e4m3 adds integer decode work and is no longer memory bound
    t8 = pj.fma_attention_time(1e9, 6, 256, "fp8_e4m3", pj.V100, 796e9)
    assert t8["block_g"] == 8 and t8["bound"] != "memory"
    assert t8["pipes_s"]["int"] == pytest.approx(1e9 * 10 / pj.V100.rate(64))
    # 8 query rows (speculative verify) multiply the FMAs
    t8r = pj.fma_attention_time(1e9, 6, 256, "fp8_e4m3", pj.V100, 796e9, rows=8)
    bn = t8["block_n"]
    assert t8r["fma_per_elem"] == pytest.approx(8 * (8 + 8 / (2 * bn)) + 2)  # + scale multiply + 2^8 rebias
    assert t8r["pipes_s"]["fma"] > 6 * t8["pipes_s"]["fma"]


def test_calibration_from_h200_results():
    cal = pj.calibrate(RESULTS)
    assert 0.8 < cal.copy_ratio < 0.95  # 4.25 TB/s of 4.8
    assert 0.7 < cal.matmul_ratio < 0.85  # ~765 of 989.4 TFLOP/s
    assert 0.5 < cal.decode_eff < 0.8 and 0.6 < cal.prefill_eff < 0.85
    assert cal.sources["decode"]["measured_tok_s"] == pytest.approx(176.34, abs=0.01)


def test_projection_tables():
    p = pj.project(pj.calibrate(RESULTS))
    rows = p["decode_27b_tp4"]
    assert len(rows) == 12
    by = {(r["context"], r["weights"], r["kv"]): r for r in rows}
    for ctx in (4096, 32768, 131072):
        fp16 = by[(ctx, "fp16", "fp16")]
        q4 = by[(ctx, "4-bit (bytes/4)", "fp16")]
        assert q4["roofline_tok_s"] > 2.5 * fp16["roofline_tok_s"]
        assert by[(ctx, "4-bit (bytes/4)", "fp8_e4m3")]["roofline_tok_s"] >= q4["roofline_tok_s"] * 0.999
        for r in (fp16, q4):
            assert r["current_tok_s"] <= r["roofline_tok_s"]
    assert p["v100"]["achievable_GBps"] == pytest.approx(900 * p["calibration"]["copy_ratio"])
    assert p["prefill_8b_8k"]["sdpa"]["projected_tok_s"] > p["prefill_8b_8k"]["triton_fma"]["projected_tok_s"]
    assert len(p["verify_27b_tp4"]) == 3
    text = pj.format_projection(p)
    assert "PROJECTION" in text and "229.34" in text


def test_calibration_ignores_runs_of_other_commits(tmp_path):
    """New result files (faster or slower, other commits) do not move the projection: only CALIBRATION_COMMIT's
    runs calibrate it."""
    import json
    import shutil

    for name in os.listdir(RESULTS):
        if name.endswith(".json"):
            shutil.copy(os.path.join(RESULTS, name), tmp_path / name)
    base = pj.calibrate(str(tmp_path))
    with open(tmp_path / "qwen3-8b-shape-fp16-decode-b1.json") as f:
        run = json.load(f)
    run.update(commit="fffffff", name="qwen3-8b-shape-fp16-decode-b1-zzz")
    run["limit"]["copy_GBps"] *= 0.5
    run["metrics"]["pure_decode_tok_s"] *= 2
    for i in range(5):
        with open(tmp_path / f"zz-{i}.json", "w") as f:
            json.dump(run, f)
    again = pj.calibrate(str(tmp_path))
    assert (again.copy_ratio, again.matmul_ratio, again.decode_eff, again.prefill_eff) == \
        (base.copy_ratio, base.matmul_ratio, base.decode_eff, base.prefill_eff)
    with pytest.raises(FileNotFoundError, match="commit"):
        pj.calibrate(str(tmp_path / "nowhere"))
