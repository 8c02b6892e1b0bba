"""The V100 roofline projection (voltllm.bench.projection): counted shapes, kernel arithmetic, calibration."""
from __future__ import annotations

import math
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
    # the per-lane route (the default): qwen3-8b group 4 -> BLOCK_G 4; d128 -> BLOCK_N from the kernel's own rule
    from voltllm.kernels.attention.paged_decode import _default_block_n

    t = pj.fma_attention_time(1e9, 4, 128, "fp16", pj.V100, 796e9)
    bn = _default_block_n(128, 4, False, True)
    assert t["block_g"] == 4 and t["block_n"] == bn
    # 16-byte vectors of 8 fp16 along D -> 16 threads per row -> 4 shuffle + add rounds per (head, position)
    vec = min(16 // 2, bn * 128 // (32 * 4))
    lanes = 128 // vec
    assert (t["vector"], t["row_lanes"]) == (vec, lanes) == (8, 16)
    red = lanes * math.log2(lanes) / 128  # shuffles (and as many adds) per K element and head
    rep = lanes / 128  # lanes computing each (head, position) softmax value, per K element
    per_head = 1 + 0.5 + red / 2 + pj.LANES_SOFTMAX_OPS * rep / 2  # FMA, V rescale, reduction adds, softmax
    assert t["fma_per_elem"] == pytest.approx(4 * per_head + 1)  # + the fp16->fp32 conversion
    assert t["shfl_per_elem"] == pytest.approx(4 * red / 2)
    assert t["mufu_per_elem"] == pytest.approx(4 * pj.LANES_SOFTMAX_EXP2 * rep / 2)
    # the loop of the kernel cross-compiled for sm_70, per thread per tile of 32 elements: 304 FMA-pipe
    # instructions (FFMA 128, FMUL 72, FADD 48, FSEL 16, FMNMX 8, HADD2.F32 32), 32 SHFL.BFLY, 16 MUFU.EX2
    assert (t["fma_per_elem"], t["shfl_per_elem"], t["mufu_per_elem"]) == pytest.approx((304 / 32, 1.0, 0.5))
    assert t["bound"] == "memory"
    # 27B: group 6 pads to 8, d256 with BLOCK_N 4: fp8 e4m3 codes in 8-byte vectors (the tile has 8 per thread),
    # 32 threads per row; the decode adds integer work and the padded group's arithmetic outweighs the byte
    t8 = pj.fma_attention_time(1e9, 6, 256, "fp8_e4m3", pj.V100, 796e9)
    bn8 = _default_block_n(256, 8, False, True)
    assert t8["block_g"] == 8 and t8["block_n"] == bn8 == 4
    assert (t8["vector"], t8["row_lanes"]) == (8, 32)
    red8, rep8 = 32 * 5 / 256, 32 / 256
    per_head8 = 1 + 0.5 + red8 / 2 + pj.LANES_SOFTMAX_OPS * rep8 / 2
    assert t8["fma_per_elem"] == pytest.approx(8 * per_head8 + 1 + 0.5)  # + conversion + half an HMUL2 (rebias)
    assert t8["fma_per_elem"] == pytest.approx(304 / 16)  # sm_70 SASS: 280 fp32 + 16 HADD2.F32 + 8 HMUL2 / 16
    assert t8["bound"] == "fma"
    assert t8["pipes_s"]["int"] == pytest.approx(1e9 * 10 / pj.V100.rate(64))
    assert t8["issue_per_elem"] == pytest.approx(t8["fma_per_elem"] + 10 + 8 * red8 / 2
                                                 + 8 * pj.LANES_SOFTMAX_EXP2 * rep8 / 2 + pj.LANES_LOOP_OPS)
    # 8 query rows (speculative verify) multiply the per-head work, not the conversion or the decode
    t8r = pj.fma_attention_time(1e9, 6, 256, "fp8_e4m3", pj.V100, 796e9, rows=8)
    assert t8r["fma_per_elem"] == pytest.approx(8 * 8 * per_head8 + 1.5)
    assert t8r["pipes_s"]["fma"] > 6 * t8["pipes_s"]["fma"]
    # the per-row route keeps its count: BLOCK_G FMAs + the rescale every BLOCK_N positions
    r = pj.fma_attention_time(1e9, 4, 128, "fp16", pj.V100, 796e9, lanes=False)
    bnr = _default_block_n(128, 4, False, False)
    assert r["block_n"] == bnr and r["fma_per_elem"] == pytest.approx(4 + 4 / (2 * bnr) + 1)


def test_calibration_from_h200_results():
    cal = pj.calibrate(RESULTS)
    assert 0.8 < cal.copy_ratio < 0.95  # 4.25 TB/s of 4.8
    assert 0.7 < cal.matmul_ratio < 0.85  # ~765 of 989.4 TFLOP/s
    assert 0.5 < cal.decode_eff < 0.8 and 0.6 < cal.prefill_eff < 0.85
    assert cal.sources["decode"]["measured_tok_s"] == pytest.approx(176.34, abs=0.01)
    # the per-lane route at batch 1 x 32K (fp16: also the lowest of the three shapes)
    assert cal.fma_decode_TBps_h200 == pj.H200_FMA_DECODE_TBps[0] == min(pj.H200_FMA_DECODE_TBps) == 1.73
    assert cal.fma_decode_fp8_TBps_h200 == pj.H200_FMA_DECODE_FP8_TBps[0] == 0.68


def test_current_kernels_fma_rate():
    """"current kernels": the FMA decode kernel at its H200 element rate scaled by SMs x clock, never above its
    roofline; fp8 KV at its own measured rate."""
    cal = pj.calibrate(RESULTS)
    s = pj.count_shape("qwen3-8b-shape")
    scale = (80 * 1.53) / (132 * 1.98)  # V100 / H200 SMs x clock
    rate = cal.fma_decode_TBps_h200 * 1e12 / 2 * scale  # K/V elements per second (fp16: 2 bytes each)
    assert rate * 2 / 1e12 == pytest.approx(0.81, abs=0.005)  # TB/s of fp16 KV on the V100
    fp16 = pj.decode_step(s, 32768, kv="fp16", cal=cal)
    assert fp16["attention_bound"] == "memory"
    assert fp16["current_attention_s"] == pytest.approx(fp16["attention_s"])  # 0.81 TB/s > the 796 GB/s read
    fp8 = pj.decode_step(s, 32768, kv="fp8_e4m3", cal=cal)
    kv_elems = 32768 * 36 * 8 * 128 * 2
    rate8 = cal.fma_decode_fp8_TBps_h200 * 1e12 * scale  # one byte per element
    assert fp8["current_attention_s"] > fp8["attention_s"]
    assert fp8["current_attention_s"] == pytest.approx(kv_elems / rate8, rel=0.01)  # (+ the split partials)
    assert fp8["current_tok_s"] < fp16["current_tok_s"]  # the software decode: slower than fp16 on the H200 too


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
