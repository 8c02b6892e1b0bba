"""`voltllm bench`: metric definitions on synthetic timestamps, limits math, named shapes, the streaming
client's token counting (mock server), and one tiny end-to-end in-process run on the CPU."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from voltllm.bench import limits as L
from voltllm.bench.inprocess import (Plan, Workload, arrival_times, length_range, make_plans, make_workload,
                                     random_prompts, run_protocol)
from voltllm.bench.metrics import (RequestTiming, RunResult, common_window, concurrent_decode_tok_s, headline,
                                   itl_p99_ms, output_tok_s, prefill_tok_s, pure_decode_tok_s, speedup, summarize,
                                   table_rows, tpot_ms)

from bench_runs import sse_body


# -- metric definitions ---------------------------------------------------------------------------
def test_pure_decode_excludes_first_token_and_ttft():
    # 5 tokens, first at t=1.0 (after a long prefill), last at t=3.0: 4 decode tokens in 2 s
    assert pure_decode_tok_s(5, 1.0, 3.0) == pytest.approx(2.0)
    assert pure_decode_tok_s(1, 1.0, 1.0) is None  # no decode phase
    assert pure_decode_tok_s(3, 2.0, 2.0) is None


def test_common_window_uniform_batch_equals_batch_over_step_time():
    step, n, c = 0.01, 10, 4
    times = [[1.0 + step * k for k in range(n)] for _ in range(c)]
    assert concurrent_decode_tok_s(times) == pytest.approx(c / step)
    # batch 1: the common window is the request's decode phase, so it equals pure decode
    assert concurrent_decode_tok_s(times[:1]) == pytest.approx(pure_decode_tok_s(n, times[0][0], times[0][-1]))


def test_common_window_staggered_requests():
    a = [1.0, 2.0, 3.0, 4.0, 5.0]
    b = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    c = [1.5, 2.5, 3.5, 4.5]
    assert common_window([a, b, c]) == (2.0, 4.5)  # latest first token, earliest last token
    # tokens stamped in (2.0, 4.5]: a 3,4; b 3,4; c 2.5,3.5,4.5 -> 7 tokens over 2.5 s
    assert concurrent_decode_tok_s([a, b, c]) == pytest.approx(7 / 2.5)
    # no overlap (one request ends before another starts): no common window
    assert concurrent_decode_tok_s([[1.0, 2.0], [3.0, 4.0]]) is None


def test_output_and_prefill_rates():
    assert output_tok_s(64 * 128, 2.0) == pytest.approx(4096.0)
    assert output_tok_s(10, 0.0) is None
    assert prefill_tok_s(8192, 0, 0.5) == pytest.approx(16384.0)
    assert prefill_tok_s(8192, 8000, 0.5) == pytest.approx(384.0)  # prefix-cache hits are not computed


def test_compile_log_counts_triton_compiles_and_chains():
    import types

    from triton import knobs

    from voltllm.bench.compiles import CompileLog

    seen = []

    def earlier(**kw):
        seen.append(kw["fn"].name)
        return True  # an earlier hook's answer (skip the compile) is kept

    original = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = earlier
    try:
        with CompileLog() as log:
            mark = log.mark()
            hook = knobs.runtime.jit_cache_hook
            assert hook(key="k", repr="r", fn=types.SimpleNamespace(name="kern_a"), compile={},
                        is_manual_warmup=False, already_compiled=False) is True
            hook(key="k2", repr="r", fn=types.SimpleNamespace(name="kern_b"), compile={}, is_manual_warmup=False,
                 already_compiled=False)
            assert log.since(mark) == ["kern_a", "kern_b"] and log.since(1) == ["kern_b"] and seen == log.names
        assert knobs.runtime.jit_cache_hook is earlier  # restored on exit
        knobs.runtime.jit_cache_hook = None
        with CompileLog() as log:  # no earlier hook: compiles go ahead
            assert knobs.runtime.jit_cache_hook(fn=types.SimpleNamespace(name="k")) is False
        assert knobs.runtime.jit_cache_hook is None
    finally:
        knobs.runtime.jit_cache_hook = original


def test_warm_runs_that_compiled_are_reported(caplog):
    from voltllm.bench.metrics import format_report

    warm = _run("warm1", 1.0)
    warm.compiles = ["_paged_decode_kernel", "kv_fp8_gather_kernel"]
    cold = _run("cold", 1.0)
    cold.compiles = ["kv_fp8_gather_kernel"]  # the cold run's compiles are expected
    runs = [cold, warm, _run("warm2", 1.0)]
    assert [r.to_json()["triton_compiles"] for r in runs] == [["kv_fp8_gather_kernel"], warm.compiles, None]
    report = {"model": {"shape": "x"}, "metrics": {"table": table_rows(runs), "runs": [r.to_json() for r in runs]}}
    assert "warm runs that compiled Triton kernels (their numbers include the compiles): decode c=1 warm1: 2" in (
        format_report(report))
    clean = {"model": {"shape": "x"}, "metrics": {"table": [], "runs": [cold.to_json()]}}
    assert "compiled" not in format_report(clean)
    it = iter(runs)
    with caplog.at_level("WARNING", logger="voltllm.bench"):
        run_protocol([Plan("decode", 1, 8, 2)], lambda plan, run, work: next(it), vocab_size=100, seed=0, num_warm=2)
    assert [r.getMessage() for r in caplog.records if "compiled" in r.getMessage()] == [
        "voltllm decode c=1 warm1 compiled 2 Triton kernels during the run (_paged_decode_kernel, "
        "kv_fp8_gather_kernel): its numbers include the compiles"]


def test_tpot_and_itl_p99():
    def req(times):
        return RequestTiming(prompt_tokens=4, output_tokens=len(times), arrival=0.0, first_token=times[0],
                             last_token=times[-1], token_times=times)
    a = req([1.0, 1.1, 1.2, 1.3])  # 100 ms per token
    b = req([2.0, 2.5])  # 500 ms
    c = req([3.0])  # no decode
    assert tpot_ms([a, b, c]) == pytest.approx(300.0) and tpot_ms([c]) is None
    assert tpot_ms([a, b, req([0.0, 0.2, 0.4])]) == pytest.approx(200.0)
    gaps = [[k * 0.01 for k in range(101)], [0.0, 1.0]]  # 100 gaps of 10 ms and one of 1 s
    assert itl_p99_ms(gaps) == pytest.approx(10.0) and itl_p99_ms(gaps + [[0.0, 1.0]]) == pytest.approx(1000.0)
    assert itl_p99_ms([[1.0]]) is None


def _run(label: str, decode_s: float, ttft: float = 0.1) -> RunResult:
    first = 10.0 + ttft
    times = [first + decode_s * k / 9 for k in range(10)]
    req = RequestTiming(prompt_tokens=100, output_tokens=10, arrival=10.0, first_token=first, last_token=times[-1],
                        scheduled=10.0, token_times=times)
    return RunResult("decode", 1, label, 100, 10, 10.0, times[-1], [req])


def test_protocol_summary_reports_warm_median_and_all_values():
    runs = [_run("cold", 9.0), _run("warm1", 1.0), _run("warm2", 3.0), _run("warm3", 1.5)]
    s = summarize(runs, "pure_decode_tok_s")
    assert s["warm"] == pytest.approx([9.0, 3.0, 6.0])
    assert s["median"] == pytest.approx(6.0)
    assert s["cold"] == pytest.approx(1.0)
    rows = table_rows(runs)
    assert {r["metric"] for r in rows} == {"pure_decode_tok_s", "ttft_ms", "output_tok_s"}
    hl = headline(rows)
    assert hl["pure_decode_tok_s"] == pytest.approx(6.0)
    assert hl["ttft_ms"] == pytest.approx(100.0)
    assert speedup(200.0, 100.0, "pure_decode_tok_s") == 2.0 and speedup(50.0, 100.0, "ttft_ms") == 2.0


def test_plans_and_prompts():
    plans = make_plans("all", [1, 4])
    assert plans == [Plan("decode", 1, 512, 256), Plan("concurrency", 1, 128, 128), Plan("concurrency", 4, 128, 128),
                     Plan("prefill", 1, 8192, 1)]
    assert make_plans("decode", [8], 32, 4) == [Plan("decode", 1, 32, 4)]
    p = random_prompts(3, 7, 100, seed=5)
    assert p == random_prompts(3, 7, 100, seed=5) and len(p) == 3 and all(0 <= t < 100 for r in p for t in r)
    # every run gets fresh prompts (no prefix-cache hits between warm runs), the same ones for every runner
    seen = []
    run_protocol([Plan("decode", 1, 8, 2)], lambda plan, run, work: seen.append(work) or _run(run, 1.0),
                 vocab_size=1000, seed=0, num_warm=3)
    assert len(seen) == 4 and len({tuple(w.prompts[0]) for w in seen}) == 4
    assert all(w.output_lens == [2] for w in seen)


def test_range_ratio_spreads_lengths_like_vllm():
    assert make_plans("all", [4], range_ratio=0.5) == [
        Plan("decode", 1, 512, 256), Plan("concurrency", 4, 128, 128, 0.5), Plan("prefill", 1, 8192, 1)]
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="range-ratio"):
            make_plans("concurrency", [4], range_ratio=bad)
    with pytest.raises(ValueError, match="one request at a time"):
        make_plans("decode", [1], range_ratio=0.3)
    assert length_range(128, 0.5) == (64, 192) and length_range(10, 0.25) == (7, 13) and length_range(1, 0.9) == (1, 2)
    plan = Plan("concurrency", 400, 100, 40, 0.5)
    w = make_workload(plan, vocab_size=50, seed=3)
    assert w == make_workload(plan, vocab_size=50, seed=3) and w != make_workload(plan, vocab_size=50, seed=4)
    in_lens = [len(p) for p in w.prompts]
    assert len(in_lens) == len(w.output_lens) == 400
    assert min(in_lens) == 50 and max(in_lens) == 150 and min(w.output_lens) == 20 and max(w.output_lens) == 60
    assert 90 < sum(in_lens) / 400 < 110 and 36 < sum(w.output_lens) / 400 < 44
    assert all(0 <= t < 50 for p in w.prompts for t in p)
    # ratio 0 keeps the equal-length prompts of random_prompts (results stay comparable with earlier ones)
    flat = make_workload(Plan("concurrency", 3, 7, 2), vocab_size=100, seed=5)
    assert flat == Workload(random_prompts(3, 7, 100, seed=5), [2, 2, 2])


# -- limits ---------------------------------------------------------------------------------------
def test_decode_and_prefill_limit_math():
    cost = L.ModelCost(weight_bytes=16_000_000_000, matmul_params=7_000_000_000, logits_params=600_000_000,
                       kv_bytes_per_token=100_000, state_bytes_per_request=0, attention_layers=36, q_heads=32,
                       head_dim=128)
    dev = L.DeviceLimits("cuda", copy_GBps=4000.0, matmul_TFLOPs=800.0, matmul_dtype="float16", copy_bytes=1,
                         matmul_n=8192)
    step = (16e9 + 100_000 * 640) / 4000e9
    assert L.decode_limit_tok_s(cost, dev, 1, 640) == pytest.approx(1 / step)
    assert L.decode_limit_tok_s(cost, dev, 4, 640) == pytest.approx(4 / ((16e9 + 4 * 100_000 * 640) / 4000e9))
    flops = 2 * 7e9 * 8192 + 2 * 600e6 + 4 * 36 * 32 * 128 * 8192 ** 2 / 2
    assert L.prefill_limit_tok_s(cost, dev, 8192) == pytest.approx(8192 / (flops / 800e12))
    # roofline: a huge batch is capped by FLOPs, not bytes
    big = L.decode_limit_tok_s(cost, dev, 4096, 640, roofline=True)
    assert big < L.decode_limit_tok_s(cost, dev, 4096, 640)


def test_sliding_window_limit_math():
    """Sliding-window layers read at most their window of KV per decode row, and a prompt's attention pairs stop
    growing quadratically past it; full layers as before (half the layers windowed at 512 here)."""
    args = dict(weight_bytes=16_000_000_000, matmul_params=7_000_000_000, logits_params=600_000_000,
                kv_bytes_per_token=100_000, state_bytes_per_request=0, attention_layers=4, q_heads=32, head_dim=128)
    full, windowed = L.ModelCost(**args), L.ModelCost(**args, layer_windows=(0, 512, 0, 512))
    dev = L.DeviceLimits("cuda", copy_GBps=4000.0, matmul_TFLOPs=800.0, matmul_dtype="float16", copy_bytes=1,
                         matmul_n=8192)
    assert windowed.attended(300) == 300 and windowed.attended(2048) == (2048 + 512) / 2
    step = (16e9 + 2 * 100_000 * (2048 + 512) / 2) / 4000e9
    assert L.decode_limit_tok_s(windowed, dev, 2, 2048) == pytest.approx(2 / step)
    assert L.decode_limit_tok_s(windowed, dev, 2, 2048) > L.decode_limit_tok_s(full, dev, 2, 2048)
    pairs = (8192 ** 2 / 2 + 512 ** 2 / 2 + (8192 - 512) * 512) / 2
    assert windowed.prefill_flops(8192) == pytest.approx(2 * 7e9 * 8192 + 2 * 600e6 + 4 * 4 * 32 * 128 * pairs)
    assert windowed.prefill_flops(400) == full.prefill_flops(400)


def test_moe_limit_math():
    """Routed experts: a token multiplies by top_k / E of them; a decode step of B rows reads 1 - (1 - top_k / E)^B
    of their bytes (uniform routing), the dense weights always."""
    cost = L.ModelCost(weight_bytes=70_000, matmul_params=30_000, logits_params=1_000, kv_bytes_per_token=0,
                       state_bytes_per_request=0, attention_layers=0, q_heads=1, head_dim=1,
                       expert_bytes=60_000, expert_params=25_000, expert_fraction=0.25)
    assert cost.active_matmul_params() == pytest.approx(5_000 + 25_000 * 0.25)
    assert cost.decode_bytes_per_step(1, 0) == pytest.approx(10_000 + 60_000 * 0.25)
    assert cost.decode_bytes_per_step(2, 0) == pytest.approx(10_000 + 60_000 * (1 - 0.75 ** 2))
    assert cost.prefill_flops(10) == pytest.approx(2 * (5_000 + 6_250) * 10 + 2 * 1_000)
    assert cost.decode_flops_per_step(4, 0) == pytest.approx(4 * 2 * (5_000 + 6_250 + 1_000))
    dense = L.ModelCost(weight_bytes=70_000, matmul_params=30_000, logits_params=1_000, kv_bytes_per_token=0,
                        state_bytes_per_request=0, attention_layers=0, q_heads=1, head_dim=1)
    assert dense.decode_bytes_per_step(8, 0) == 70_000 and dense.active_matmul_params() == 30_000


def test_moe_cost_of_a_transformers_model():
    """The baseline's transformers MoE model: its routed experts found by name (not the shared expert), the same
    split as voltllm's model of the config."""
    transformers = pytest.importorskip("transformers")
    from tiny_models import HYBRID_COMMON, HYBRID_MOE

    cls = getattr(transformers, "Qwen3_5MoeTextConfig", None)
    if cls is None:
        pytest.skip("no Qwen3.5 MoE in this transformers")
    cfg = cls(**dict(HYBRID_COMMON, **HYBRID_MOE))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    ours = L.meta_model_cost(cfg, torch.float16)
    theirs = L.model_cost(hf, cfg, torch.float16)
    per_layer = HYBRID_MOE["num_experts"] * 3 * HYBRID_MOE["moe_intermediate_size"] * cfg.hidden_size
    assert ours.expert_params == theirs.expert_params == cfg.num_hidden_layers * per_layer
    assert ours.expert_fraction == theirs.expert_fraction == 0.5


def test_measure_device_on_cpu():
    d = L.measure_device(torch.device("cpu"), torch.float32, copy_mib=4, matmul_n=64, iters=3)
    assert d.copy_GBps > 0 and d.matmul_TFLOPs > 0 and len(d.copy_samples_GBps) == 3
    assert d.copy_bytes == 4 << 20 and d.matmul_dtype == "float32"


def test_named_shapes_have_the_documented_sizes(tmp_path):
    from voltllm.bench.shapes import make_config, materialize, shape_names

    assert shape_names() == ["qwen3-0.6b-shape", "qwen3-30b-a3b-shape", "qwen3-8b-shape", "qwen3-next-80b-a3b-shape",
                             "qwen3.5-27b-shape", "qwen3.5-35b-a3b-shape", "qwen4-exp-shape", "smollm2-135m-shape"]
    moe = L.meta_model_cost(make_config("qwen3-30b-a3b-shape"), torch.bfloat16)  # Qwen3-30B-A3B: 30.53 B, 3.3 B active
    assert moe.weight_bytes / 2e9 == pytest.approx(30.53, abs=0.01) and moe.expert_fraction == 8 / 128
    assert 3.2e9 < moe.active_matmul_params() + 2 * moe.logits_params < 3.5e9
    cfg = make_config("qwen3-8b-shape")
    cost = L.meta_model_cost(cfg, torch.float16)
    # 8.19 B parameters in fp16 (norm weights may be kept in fp32: a few hundred KB more)
    assert cost.matmul_params + 2 * cost.logits_params == 8_190_735_360
    assert 2 * 8_190_735_360 <= cost.weight_bytes < 2 * 8_190_735_360 * 1.0001
    assert cost.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2
    # the weight-read floor on a ~4.26 TB/s card: ~3.8 ms per step (GPU.md)
    dev = L.DeviceLimits("cuda", 4260.0, 780.0, "float16", 1, 8192)
    assert 250 < L.decode_limit_tok_s(cost, dev, 1, 640) < 265
    hybrid = make_config("qwen3.5-27b-shape")
    assert hybrid.layer_types.count("full_attention") == 16 and hybrid.num_hidden_layers == 64
    # the MoE hybrids (Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B): parameter counts of the real checkpoints' text models
    for name, billions, experts, top_k in (("qwen3.5-35b-a3b-shape", 34.66, 256, 8),
                                           ("qwen3-next-80b-a3b-shape", 79.67, 512, 10)):
        cfg = make_config(name)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (experts, top_k, 512)
        moe_cost = L.meta_model_cost(cfg, torch.bfloat16)
        assert moe_cost.weight_bytes / 2e9 == pytest.approx(billions, abs=0.01)
        # routed experts: every layer's E x (gate, up, down) of 512 x 2048; a token uses top_k of them ("A3B":
        # about 3 B active parameters with the embedding and lm_head)
        assert moe_cost.expert_params == cfg.num_hidden_layers * experts * 3 * 512 * 2048
        assert moe_cost.expert_bytes == 2 * moe_cost.expert_params and moe_cost.expert_fraction == top_k / experts
        assert 2.5e9 < moe_cost.active_matmul_params() + 2 * moe_cost.logits_params < 4e9
        # batch 1 reads the dense weights and top_k experts per layer, 64 rows most of them
        one = moe_cost.decode_bytes_per_step(1, 0)
        assert one == pytest.approx(moe_cost.weight_bytes - moe_cost.expert_bytes * (1 - top_k / experts)
                                    + moe_cost.state_bytes_per_request)
        weights_64 = moe_cost.decode_bytes_per_step(64, 0) - 64 * moe_cost.state_bytes_per_request
        assert one - moe_cost.state_bytes_per_request < weights_64 < moe_cost.weight_bytes
    path = materialize("qwen3-0.6b-shape", str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    assert saved["hidden_size"] == 1024 and saved["tie_word_embeddings"] is True
    assert materialize(path, str(tmp_path)) == path  # a directory is used as it is
    with pytest.raises(ValueError):
        materialize("no-such-shape", str(tmp_path))


def test_qwen4_exp_shape_and_a_cut_down_random_weight_run(tmp_path):
    """qwen4-exp-shape: transformers' Qwen4ExpTextConfig sizes with QSA and PLE; the bench counts every parameter but
    the PLE n-gram tables (host memory, a step's rows read in place) and the PLE extras in the per-request state. The
    same config cut down to tiny widths runs `voltllm bench --random-weights` on the CPU."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        pytest.skip("this transformers has no Qwen4-Exp")
    from voltllm.bench.cli import main
    from voltllm.bench.shapes import SHAPES, make_config

    cfg = make_config("qwen4-exp-shape")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (2048, 40, 512, 10)
    assert cfg.layer_types.count("indexed_attention") == 10 and cfg.ple_layer_ids == [1, 2, 3]
    cost = L.meta_model_cost(cfg, torch.bfloat16)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tables = sum(p.numel() for n, p in hf.named_parameters() if "ngram_embedding" in n)
    assert 3 * 16 * 20_000 * 128 < tables < 3 * 16 * 20_300 * 128  # per PLE layer 16 heads of ~20K rows x 128
    hf_params = sum(p.numel() for p in hf.parameters())
    assert cost.matmul_params + 2 * cost.logits_params == hf_params - tables  # 67.4 B without the tables
    assert cost.expert_params == 40 * 512 * 3 * 512 * 2048 and cost.expert_fraction == 10 / 512
    gdn = 30 * (3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 4)  # conv (kernel - 1 rows, bf16) + fp32 SSM
    # + ple_ctx (2 token ids) and ple_conv (per PLE layer (kernel - 1) x ngram_size rows of hc x H)
    assert cost.state_bytes_per_request == gdn + 2 * 8 + 3 * (3 * 3) * 4 * 2048 * 2
    small = dict(SHAPES["qwen4-exp-shape"][1], vocab_size=512, hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, hc_lowrank=16,
                 indexer_head_dim=32, indexer_budget=8, ngram_vocab_size_base=101, eos_token_id=5,
                 max_position_embeddings=256)
    model_dir = tmp_path / "tiny-qwen4-exp"
    transformers.Qwen4ExpTextConfig(**small).save_pretrained(model_dir)
    out = tmp_path / "results"
    assert main(["--random-weights", str(model_dir), "--device", "cpu", "--output-dir", str(out), "--name", "q4",
                 "--commit", "abc123", "--scenario", "decode", "--input-len", "12", "--output-len", "4",
                 "--num-warm", "1", "--no-limits"]) == 0
    with open(out / "q4.json") as f:
        assert json.load(f)["metrics"]["pure_decode_tok_s"] > 0


# -- client against a mock streaming server -------------------------------------------------------
@pytest.mark.parametrize("continuous", [True, False])
def test_client_counts_tokens_per_chunk(continuous):
    httpx = pytest.importorskip("httpx")
    from voltllm.bench.client import ClientRunner

    sent, sent_at = [], []

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        sent.append(body)
        sent_at.append(time.monotonic())
        n = body["max_tokens"]
        chunks, made = [], 0
        for k, step in enumerate([1, 2, n - 3]):  # the second chunk carries two tokens (merged text)
            made += step
            c = {"choices": [{"index": 0, "text": "x" * step, "finish_reason": "length" if made == n else None}]}
            c["usage"] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": made} if continuous else None
            chunks.append(c)
        chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        chunks.append(b"[DONE]")
        return httpx.Response(200, content=sse_body(chunks), headers={"content-type": "text/event-stream"})

    runner = ClientRunner("http://test", transport=httpx.MockTransport(handler))
    try:
        r = runner(Plan("concurrency", 2, 5, 6, 0.5, 10.0), "warm1",
                   Workload([[1, 2, 3, 4, 5], [6, 7, 8]], [6, 4], [0.0, 0.05]))
    finally:
        runner.close()
    assert runner.model == "m" and len(sent) == 2
    body = sent[0]
    assert body["prompt"] == [1, 2, 3, 4, 5] and body["ignore_eos"] is True and body["stream"] is True
    assert body["max_tokens"] == body["min_tokens"] == 6
    assert sent[1]["prompt"] == [6, 7, 8] and sent[1]["max_tokens"] == sent[1]["min_tokens"] == 4
    got = [(req.output_tokens, len(req.token_times), req.prompt_tokens) for req in r.requests]
    assert got == [(6, 6, 5), (4, 4, 3)]
    assert r.side == "client" and r.metrics()["output_tok_s"] > 0 and r.range_ratio == 0.5 and r.request_rate == 10.0
    assert sent_at[1] - sent_at[0] > 0.04  # the second was sent at its offset, not with the first


# -- end to end, in-process, tiny random model on the CPU ------------------------------------------
def _tiny_bench(tmp_path, name: str, *flags: str) -> dict:
    """`voltllm bench` on a 2-layer random qwen3 on the CPU with these flags; returns its result file."""
    from transformers import Qwen3Config

    from voltllm.bench.cli import main

    model_dir = tmp_path / "tiny"
    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256).save_pretrained(model_dir)
    out = tmp_path / "results"
    argv = ["--random-weights", str(model_dir), "--device", "cpu", "--output-dir", str(out), "--name", name,
            "--commit", "abc123", *flags]
    assert main(argv) == 0
    with open(out / f"{name}.json") as f:
        return json.load(f)


def test_bench_end_to_end_tiny_model(tmp_path):
    res = _tiny_bench(tmp_path, "tiny", "--scenario", "all", "--concurrency", "1,3", "--input-len", "12",
                      "--output-len", "5", "--num-warm", "3", "--limit-copy-mib", "4", "--limit-matmul-n", "64",
                      "--limit-iters", "3", "--baseline", "hf", "--baseline-num-warm", "1",
                      "--baseline-max-concurrency", "1")
    for key in ("name", "gpu", "commit", "command", "metrics", "limit", "env", "baseline"):
        assert key in res, key
    assert res["name"] == "tiny" and res["gpu"] == "cpu" and res["commit"] == "abc123"
    assert res["command"].startswith("voltllm bench --random-weights")
    m = res["metrics"]
    assert m["pure_decode_tok_s"] > 0 and m["ttft_ms"] > 0 and m["prefill_tok_s"] > 0
    assert set(m["concurrent_decode_tok_s"]) == {"1", "3"} and set(m["output_tok_s"]) == {"1", "3"}
    assert all(v > 0 for v in m["output_tok_s"].values())
    assert len(m["runs"]) == 4 * 4  # (decode, c=1, c=3, prefill) x (1 cold + 3 warm)
    for run in m["runs"]:
        assert all(r["output_tokens"] == 5 for r in run["requests"])
    row = next(r for r in m["table"] if r["metric"] == "pure_decode_tok_s")
    assert len(row["warm"]) == 3 and row["cold"] is not None
    lim = res["limit"]
    for key in ("copy_GBps", "matmul_TFLOPs", "decode_limit_tok_s", "ratio"):
        assert lim[key] > 0, key
    assert lim["model_cost"]["weight_bytes"] == 4 * sum((512 * 64 * 2, 2 * (64 * 4 * 16 * 2 + 64 * 2 * 16 * 2),
                                                        2 * 3 * 64 * 128, 2 * (2 * 64 + 2 * 16), 64))
    for key in ("torch", "triton", "transformers"):
        assert key in res["env"]
    assert res["config"]["prompt_graph_tokens"] == [] and res["config"]["enforce_eager"] is False  # (CPU: no graphs)
    hf = res["baseline"]["hf"]
    assert "error" not in hf, hf.get("error")
    assert hf["metrics"]["pure_decode_tok_s"] > 0 and set(hf["metrics"]["output_tok_s"]) == {"1"}
    assert hf["ratios_voltllm_over_hf"]["pure_decode_tok_s"] > 0


def test_request_rate_spreads_arrivals_like_vllm():
    inf = float("inf")
    plans = make_plans("all", [4], request_rate=2.0, burstiness=0.5)
    assert plans[1] == Plan("concurrency", 4, 128, 128, 0.0, 2.0, 0.5)
    assert make_plans("decode", [1])[0].request_rate == inf
    for rate, burst in ((0.0, 1.0), (-1.0, 1.0), (2.0, 0.0), (2.0, inf)):
        with pytest.raises(ValueError, match="request-rate"):
            make_plans("concurrency", [4], request_rate=rate, burstiness=burst)
    with pytest.raises(ValueError, match="one request at a time"):
        make_plans("prefill", [1], request_rate=3.0)
    assert arrival_times(5, inf, 1.0, seed=1) is None
    t = arrival_times(4000, 8.0, 1.0, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps) and t == arrival_times(4000, 8.0, 1.0, seed=1)
    mean = sum(gaps) / len(gaps)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert abs(mean - 0.125) < 0.01 and abs(var / mean ** 2 - 1.0) < 0.15  # exponential: CV^2 = 1
    bursty = arrival_times(4000, 8.0, 0.25, seed=1)  # gamma of shape k: CV^2 = 1 / k
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 0.125) < 0.015 and 3.0 < sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean ** 2 < 5.0
    # a rate changes when requests are sent, not what they are
    plain, rated = make_workload(Plan("concurrency", 6, 10, 3, 0.5), 100, 9), make_workload(
        Plan("concurrency", 6, 10, 3, 0.5, 4.0), 100, 9)
    assert plain.prompts == rated.prompts and plain.output_lens == rated.output_lens
    assert plain.arrivals is None and plain.arrival(3) == 0.0 and len(rated.arrivals) == 6 and rated.arrival(5) > 0


def _tiny_concurrency_bench(tmp_path, name: str, c: int, input_len: int, output_len: int, *workload: str) -> dict:
    """A concurrency run of the tiny model shaped by workload flags, which the transformers baseline refuses."""
    flags = ("--scenario", "concurrency", "--concurrency", str(c), "--input-len", str(input_len), "--output-len",
             str(output_len), *workload, "--num-warm", "1", "--no-limits")
    with pytest.raises(ValueError, match="equal lengths sent together"):
        _tiny_bench(tmp_path, name, *flags, "--baseline", "hf")
    return _tiny_bench(tmp_path, name, *flags)


def test_bench_request_rate_tiny_model(tmp_path):
    from voltllm.bench.inprocess import prompt_seed

    res = _tiny_concurrency_bench(tmp_path, "rate", 5, 8, 4, "--request-rate", "40")
    assert res["config"]["request_rate"] == 40.0 and res["config"]["burstiness"] == 1.0
    plan = Plan("concurrency", 5, 8, 4, 0.0, 40.0)
    for k, run in enumerate(res["metrics"]["runs"]):
        assert run["request_rate"] == 40.0
        reqs = run["requests"]
        offsets = make_workload(plan, 512, prompt_seed(0, plan, k)).arrivals
        # each request is stamped at its own send time and answered after it
        assert [round(r["arrival"] - reqs[0]["arrival"], 9) for r in reqs] == [round(o, 9) for o in offsets]
        assert all(r["first_token"] > r["arrival"] and r["output_tokens"] == 4 for r in reqs)
        assert run["wall_s"] >= offsets[-1]
    assert all(row["request_rate"] == 40.0 for row in res["metrics"]["table"])


def test_bench_spread_lengths_tiny_model(tmp_path):
    res = _tiny_concurrency_bench(tmp_path, "spread", 6, 16, 6, "--random-range-ratio", "0.5")
    assert res["config"]["random_range_ratio"] == 0.5
    assert all(run["triton_compiles"] == [] for run in res["metrics"]["runs"])  # observed: none on the CPU
    runs = res["metrics"]["runs"]
    assert len(runs) == 2 and all(run["range_ratio"] == 0.5 for run in runs)
    for run in runs:
        outs = [r["output_tokens"] for r in run["requests"]]
        prompts = [r["prompt_tokens"] for r in run["requests"]]
        assert all(3 <= n <= 9 for n in outs) and all(8 <= n <= 24 for n in prompts)
        assert len(set(prompts)) > 1
        assert run["metrics"]["output_tok_s"] > 0
    # the requests the bench forced are the ones the workload drew
    from voltllm.bench.inprocess import prompt_seed

    plan = Plan("concurrency", 6, 16, 6, 0.5)
    want = make_workload(plan, 512, prompt_seed(0, plan, 0))
    assert [r["output_tokens"] for r in runs[0]["requests"]] == want.output_lens
    assert [r["prompt_tokens"] for r in runs[0]["requests"]] == [len(p) for p in want.prompts]
    assert all(row["range_ratio"] == 0.5 for row in res["metrics"]["table"])


def test_bench_is_a_voltllm_command():
    from voltllm.cli import build_parser

    from voltllm.bench.cli import resolve_scenario

    args = build_parser().parse_args(["bench", "--random-weights", "qwen3-8b-shape", "--dtype", "half"])
    assert args.func.__module__ == "voltllm.bench.cli" and resolve_scenario(args.scenario, args.dataset_name) == \
        "decode"


def test_report_title_names_the_server_model():
    """Against a server the title names the served model and its URL (there is no local path, shape or dtype);
    in-process it names the shape or path and the dtype."""
    from voltllm.bench.metrics import format_report

    table = {"table": []}
    server = {"model": {"source": None, "shape": None, "server": "http://h:8000", "server_model": "smol",
                        "dtype": None}, "gpu": "cpu", "commit": "abc", "metrics": table}
    assert "voltllm bench: smol at http://h:8000 on cpu (commit abc)" in format_report(server)
    local = {"model": {"source": "/m/x.gguf", "shape": None, "dtype": "float16"}, "gpu": "H200", "commit": "abc",
             "metrics": table}
    assert "voltllm bench: /m/x.gguf float16 on H200" in format_report(local)


def test_client_reads_the_server_platform():
    """A voltllm server's acceleration report names its GPU and dtype for the result file; a server without one
    (another engine: 404) leaves both to the local machine."""
    httpx = pytest.importorskip("httpx")
    from voltllm.bench.client import ClientRunner

    def voltllm_server(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        assert request.url.path == "/v1/acceleration"
        return httpx.Response(200, json={"platform": {"name": "Tesla V100-SXM2-32GB"},
                                         "configuration": {"dtype": "float16"}})

    def other_server(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(404, json={"detail": "Not Found"})

    for handler, want in ((voltllm_server, {"gpu": "Tesla V100-SXM2-32GB", "dtype": "float16"}), (other_server, {})):
        runner = ClientRunner("http://test", transport=httpx.MockTransport(handler))
        try:
            assert runner.server_platform() == want
        finally:
            runner.close()


def test_bench_refuses_a_pooling_model(tmp_path, capsys):
    from transformers import Qwen3Config

    from voltllm.cli import main

    model_dir = tmp_path / "tiny"
    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256).save_pretrained(model_dir)
    assert main(["bench", "--random-weights", str(model_dir), "--device", "cpu", "--runner", "pooling",
                 "--output-dir", str(tmp_path / "out")]) == 2
    assert "voltllm bench measures generation: a pooling (embedding) model" in capsys.readouterr().err


def test_speculative_runs_report_their_acceptance(tmp_path):
    """With --speculative-config each run records its drafts, draft and accepted tokens (the engine's counters over
    the run) and reports the mean acceptance length and acceptance rate beside the throughput."""
    from voltllm.bench.metrics import spec_delta, spec_metrics

    assert spec_metrics({"drafts": 4, "draft_tokens": 12, "accepted_tokens": 6}) == {
        "spec_acceptance_length": 2.5, "spec_acceptance_rate": 0.5}
    assert spec_metrics({"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0})["spec_acceptance_length"] is None
    assert spec_delta(None, {"drafts": 1}) is None
    res = _tiny_bench(tmp_path, "spec", "--scenario", "concurrency", "--concurrency", "2", "--input-len", "24",
                      "--output-len", "16", "--num-warm", "1", "--no-limits", "--speculative-config",
                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    for run in res["metrics"]["runs"]:
        spec = run["speculative"]
        assert spec["draft_tokens"] > 0 and spec["drafts"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
        assert run["metrics"]["spec_acceptance_length"] == 1 + spec["accepted_tokens"] / spec["drafts"]
    rows = {r["metric"] for r in res["metrics"]["table"]}
    assert {"spec_acceptance_length", "spec_acceptance_rate"} <= rows
    plain = _tiny_bench(tmp_path, "plain", "--scenario", "concurrency", "--concurrency", "2", "--input-len", "24",
                        "--output-len", "4", "--num-warm", "1", "--no-limits")
    assert all("speculative" not in run for run in plain["metrics"]["runs"])


def test_client_reads_the_acceptance_from_the_servers_counters():
    """Against a server (--base-url) the run's drafts, draft tokens and accepted tokens are the growth of its /metrics
    speculation counters (vLLM's names), so the acceptance metrics are reported as in process; a server without them
    gives none."""
    httpx = pytest.importorskip("httpx")
    from voltllm.bench.client import ClientRunner
    from voltllm.bench.inprocess import make_run_input

    state = {"drafts": 10.0, "tokens": 40.0, "accepted": 25.0, "spec": True}

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/metrics":
            if not state["spec"]:
                return httpx.Response(200, text="# no speculation\n")
            lab = '{engine="0",model_name="m"}'
            return httpx.Response(200, text=(f"vllm:spec_decode_num_drafts_total{lab} {state['drafts']}\n"
                                             f"vllm:spec_decode_num_draft_tokens_total{lab} {state['tokens']}\n"
                                             f"vllm:spec_decode_num_accepted_tokens_total{lab} {state['accepted']}\n"))
        body = json.loads(request.content)
        n = body["max_tokens"]
        state["drafts"] += 2  # each request: two verifications of 4 drafts, 5 of them accepted
        state["tokens"] += 8
        state["accepted"] += 5
        chunks = [{"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]}
                  for i in range(n)] + [{"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                                  "completion_tokens": n}}]
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=data, headers={"content-type": "text/event-stream"})

    plan = make_plans("concurrency", [3], 8, 4)[0]
    runner = ClientRunner("http://test", transport=httpx.MockTransport(handler))
    try:
        run = runner(plan, "warm1", make_run_input(plan, 50, 0, 1))
        state["spec"] = False
        plain = runner(plan, "warm2", make_run_input(plan, 50, 0, 2))
    finally:
        runner.close()
    assert run.spec == {"drafts": 6, "draft_tokens": 24, "accepted_tokens": 15}
    m = run.metrics()
    assert m["spec_acceptance_length"] == pytest.approx(1 + 15 / 6)
    assert m["spec_acceptance_rate"] == pytest.approx(15 / 24)
    assert plain.spec is None and "spec_acceptance_length" not in plain.metrics()
