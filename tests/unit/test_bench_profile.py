"""`voltllm bench --profile`: the per-kernel summary on synthetic profiler records (names, calls and time per
step, GPU busy time as the union of intervals), and the profile run end to end on the CPU (a tiny model: no GPU
kernels there, but the requests, the two timed windows and the files are the GPU path's)."""
from __future__ import annotations

import gzip
import json

import pytest

from voltllm.bench.profile import (blocking_calls, busy_us, format_profiles, gpu_events, launch_counts, shorten,
                                   summarize)


def _ev(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_shorten_kernel_names():
    assert shorten("_gdn_decode_kernel") == "_gdn_decode_kernel"  # Triton: as it is
    assert shorten("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
                   "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)") == \
        "vectorized_elementwise_kernel<4, FillFunctor<float>, array<char*, 1ul> >"
    assert shorten("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
                   "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)") == \
        "cunn_SoftMaxForward<4, float, float, float, SoftMaxForwardEpilogue>"
    assert shorten("void cutlass::Kernel2<cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x1_tn_align8>("
                   "cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x1_tn_align8::Params)") == \
        "cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x1_tn_align8"
    assert shorten("Memcpy HtoD (Pinned -> Device)") == "Memcpy HtoD (Pinned -> Device)"
    assert len(shorten("k" * 200)) == 80


def test_busy_time_is_the_union_of_intervals():
    evs = [{"ts": 0.0, "dur": 10.0}, {"ts": 5.0, "dur": 10.0}, {"ts": 30.0, "dur": 5.0}, {"ts": 31.0, "dur": 1.0}]
    assert busy_us(evs) == 20.0
    assert busy_us([]) == 0.0


def test_trace_parsing_and_per_step_summary():
    # two steps of 100 us wall: gemv 2x per step (20 us each), norm once (5 us), one memcpy overlapping a gemv
    trace = {"traceEvents": [
        _ev("gemv", 0, 20), _ev("gemv", 25, 20), _ev("norm", 50, 5), _ev("Memcpy HtoD", 10, 4, "gpu_memcpy"),
        _ev("gemv", 100, 20), _ev("gemv", 125, 20), _ev("norm", 150, 5), _ev("Memcpy HtoD", 110, 4, "gpu_memcpy"),
        _ev("aten::mm", 0, 300, "cpu_op"), {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3},
        _ev("cudaLaunchKernel", 0, 2, "cuda_runtime"), _ev("cudaLaunchKernel", 3, 2, "cuda_runtime"),
        _ev("cudaGraphLaunch", 5, 2, "cuda_runtime"), _ev("cudaStreamSynchronize", 9, 50, "cuda_runtime")]}
    evs = gpu_events(trace)
    assert len(evs) == 8 and {e["cat"] for e in evs} == {"kernel", "gpu_memcpy"}
    launches = launch_counts(trace)
    assert launches == {"cudaLaunchKernel": 2, "cudaGraphLaunch": 1}
    s = summarize(evs, steps=2, wall_s=200e-6, wall_s_profiled=260e-6, launches=launches)
    assert s["wall_us_per_step"] == pytest.approx(100.0) and s["wall_us_per_step_profiled"] == pytest.approx(130.0)
    assert s["gpu_busy_us_per_step"] == pytest.approx(45.0)  # the memcpy hides under a gemv
    assert s["kernel_sum_us_per_step"] == pytest.approx(49.0)
    assert s["gpu_busy_frac"] == pytest.approx(0.45) and s["gpu_idle_us_per_step"] == pytest.approx(55.0)
    assert s["kernels_per_step"] == 4 and s["launches_per_step"] == {"cudaGraphLaunch": 0.5, "cudaLaunchKernel": 1.0}
    top = s["kernels"][0]
    assert (top["name"], top["calls_per_step"], top["us_per_step"]) == ("gemv", 2.0, 40.0)
    assert top["pct"] == pytest.approx(40 / 49)
    assert top["excl_us_per_step"] == pytest.approx(40.0) and top["excl_pct"] == pytest.approx(40 / 45)
    assert [k["name"] for k in s["kernels"]] == ["gemv", "norm", "Memcpy HtoD"]
    assert s["kernels"][2]["excl_us_per_step"] == 0.0  # hidden under a gemv
    # idle time between kernels (5 + 5 + 45 + 5 + 5 us over two steps), the longest gap named; the rest is outside
    assert s["gpu_gaps_us_per_step"] == pytest.approx(32.5)
    assert s["largest_gaps"][0] == {"us": 45.0, "after": "norm", "before": "gemv"} and len(s["largest_gaps"]) == 5
    waits = blocking_calls(trace)
    assert waits == {"cudaStreamSynchronize": {"calls": 1, "us": 50.0}}
    text = format_profiles([{"scenario": "decode", "concurrency": 1, "context_len_at_start": 640, **s,
                             "blocking_calls": waits}], top=2)
    assert "GPU busy 45.0 us/step (45% of wall" in text and "gemv" in text and "(1 more)" in text
    assert "32 us between kernels, 52 us before the first / after the last" in text  # of the profiled 130 us
    assert "45 us after norm before gemv" in text and "cudaStreamSynchronize 1x 0.05 ms" in text


def test_exclusive_time_charges_a_pdl_wait_to_the_predecessor():
    """A kernel launched early with PDL (norm starts at 5 and waits until the GEMM ends at 30) records 27 us, but
    only its 2 us after the GEMM are its own; exclusive times sum to the busy time and order the table."""
    from voltllm.bench.profile import exclusive_us

    evs = [{"name": "gemm", "ts": 0.0, "dur": 30.0}, {"name": "norm", "ts": 5.0, "dur": 27.0},
           {"name": "attn", "ts": 40.0, "dur": 10.0}, {"name": "tiny", "ts": 40.0, "dur": 1.0}]
    assert exclusive_us(evs) == [30.0, 2.0, 10.0, 0.0]
    assert sum(exclusive_us(evs)) == busy_us(evs)
    s = summarize(evs, steps=1, wall_s=60e-6, wall_s_profiled=60e-6)
    assert [k["name"] for k in s["kernels"]] == ["gemm", "attn", "norm", "tiny"]
    norm = s["kernels"][2]
    assert norm["us_per_step"] == 27.0 and norm["excl_us_per_step"] == 2.0
    text = format_profiles([{"scenario": "decode", "concurrency": 64, "context_len_at_start": 182, **s}])
    assert "exclusive us/step" in text


def test_summary_without_gpu_activity():
    s = summarize([], steps=3, wall_s=3e-3, wall_s_profiled=4e-3)
    assert s["gpu_busy_us_per_step"] is None and s["gpu_busy_frac"] is None and s["kernels"] == []
    assert s["wall_us_per_step"] == pytest.approx(1000.0)


def test_profile_end_to_end_on_cpu(tmp_path):
    from transformers import Qwen3Config

    from voltllm.bench.cli import main

    model_dir = tmp_path / "tiny"
    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256).save_pretrained(model_dir)
    out = tmp_path / "results"
    argv = ["--random-weights", str(model_dir), "--device", "cpu", "--scenario", "concurrency", "--concurrency",
            "1,2", "--input-len", "12", "--output-len", "6", "--num-warm", "1", "--no-limits", "--profile",
            "--profile-steps", "3", "--profile-trace", "--output-dir", str(out), "--name", "p", "--commit", "abc"]
    assert main(argv) == 0
    for c in (1, 2):  # the profiled decode steps' traces (CPU activity on a CPU run)
        with gzip.open(out / f"p-concurrency-c{c}.trace.json.gz", "rt") as f:
            assert json.load(f)["traceEvents"]
    res = json.loads((out / "p.json").read_text())
    assert len(res["metrics"]["runs"]) == 2 * 2  # the measured runs only (1 cold + 1 warm per concurrency)
    assert [p["concurrency"] for p in res["profile"]] == [1, 2]
    prof = json.loads((out / "p.profile.json").read_text())
    assert prof["name"] == "p" and prof["commit"] == "abc" and prof["command"] == res["command"]
    for p in prof["profiles"]:
        assert p["steps"] == 3 and p["scenario"] == "concurrency" and p["input_len"] == 12
        assert p["context_len_at_start"] >= 14  # decoding when the windows start
        assert p["wall_us_per_step"] > 0 and p["wall_us_per_step_profiled"] > 0
        assert p["kernels"] == [] and p["gpu_busy_us_per_step"] is None  # the CPU has no GPU kernels
        host = p["host_us_per_step"]  # the host's phases of the unprofiled window add up to its wall time
        assert set(host) == {"schedule", "prepare", "launch", "wait", "collect", "update", "other"}
        assert all(host[k] > 0 for k in ("schedule", "prepare", "launch", "update"))
        assert sum(host.values()) == pytest.approx(p["wall_us_per_step"])
        pp = p["prompt_phase"]  # profiled on its own: every step until each request had its first token
        assert pp["steps"] == 1 and 1 <= pp["engine_steps"] <= 3 and pp["wall_us_per_step"] > 0


def test_host_timings_of_every_plan_run_before_the_first_profiler(monkeypatch):
    """A torch.profiler session makes later CUDA calls cost the host more, so profile_plans times every plan's
    host phases before it profiles any plan, and hands each timing to that plan's profile."""
    from voltllm.bench import profile as P
    from voltllm.bench.inprocess import Plan

    calls = []
    monkeypatch.setattr(P, "time_host_phases", lambda eng, plan, *a, **k: calls.append(("host", plan.concurrency))
                        or {"tag": plan.concurrency})
    monkeypatch.setattr(P, "profile_plan", lambda eng, plan, prompts, steps, t, tp, tk, seed, trace, host:
                        calls.append(("trace", plan.concurrency, host["tag"])) or {"concurrency": plan.concurrency})
    engine = type("E", (), {"config": type("C", (), {"scheduler": type("S", (), {"max_num_seqs": 8})()})()})()
    plans = [Plan("concurrency", c, 4, 2) for c in (1, 2, 16)] + [Plan("prefill", 1, 8, 1)]
    out = P.profile_plans(engine, plans, vocab=50, seed=0, steps=2)
    assert calls == [("host", 1), ("host", 2), ("trace", 1, 1), ("trace", 2, 2)]  # 16 > max_num_seqs: skipped
    assert [p["concurrency"] for p in out] == [1, 2]


def test_the_profiled_prompt_phase_computes_its_prompts(monkeypatch):
    """The host timing runs before the profile and must not warm the prefix cache with the profile's prompts (a
    profiled prompt phase of cache hits computed only each prompt's last token): their first blocks differ."""
    from voltllm.bench import profile as P
    from voltllm.bench.inprocess import Plan

    seen = {}
    monkeypatch.setattr(P, "time_host_phases", lambda eng, plan, prompts, *a, **k: seen.update(host=prompts) or {})
    monkeypatch.setattr(P, "profile_plan", lambda eng, plan, prompts, *a: seen.update(profile=prompts) or {})
    engine = type("E", (), {"config": type("C", (), {"scheduler": type("S", (), {"max_num_seqs": 8})()})()})()
    P.profile_plans(engine, [Plan("concurrency", 4, 40, 2)], vocab=32000, seed=0, steps=2)
    host, prof = seen["host"], seen["profile"]
    assert [len(p) for p in host] == [len(p) for p in prof] == [40] * 4
    assert not {tuple(p[:16]) for p in host} & {tuple(p[:16]) for p in prof}


def test_host_phase_timer_restores_the_engine():
    from voltllm.bench.profile import HostPhaseTimer

    class Part:
        def __init__(self):
            self.calls = []

        def schedule(self):
            self.calls.append("schedule")

        update = prepare = execute_async = schedule

        def collect(self, handle):
            self.calls.append("collect")
            return handle

    class Engine:
        runner, scheduler = Part(), Part()

    eng = Engine()
    with HostPhaseTimer(eng) as t:
        eng.scheduler.schedule()
        assert eng.runner.collect("h") == "h"
        assert "collect" in vars(eng.runner)  # wrapped on the instance
    assert set(vars(eng.runner)) == set(vars(eng.scheduler)) == {"calls"}  # the class's methods again
    assert eng.runner.calls == ["collect"] and eng.scheduler.calls == ["schedule"]
    per = t.per_step(1.0, 2)
    assert per["other"] > 0 and per["schedule"] >= 0 and per["wait"] >= 0


def test_gpu_step_timer_medians_and_nesting(monkeypatch):
    """GpuStepTimer brackets each launch with timing events: median launch -> step end and launch -> next launch;
    inside HostPhaseTimer it restores that timer's wrapper on exit, and both leave the class's method."""
    import torch

    from voltllm.bench.profile import GpuStepTimer, HostPhaseTimer

    clock = [0.0]

    class Event:  # a GPU clock that the fake steps advance
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, other):
            return other.t - self.t  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    steps = iter([0.9, 1.1, 1.0])  # GPU ms of each step

    class Runner:
        device = "cuda"

        def execute_async(self, sched):
            clock[0] += next(steps)
            return ("handle", sched)

        def prepare(self):
            pass

        def collect(self, handle):
            return handle

    class Scheduler:
        def schedule(self):
            pass

        update = schedule

    class Engine:
        runner, scheduler = Runner(), Scheduler()

    eng = Engine()
    with HostPhaseTimer(eng), GpuStepTimer(eng) as gpu:
        for i, gap in enumerate((0.3, 0.4, 0.2)):
            assert eng.runner.execute_async(i) == ("handle", i)
            clock[0] += gap  # the host's time before the next launch (the GPU idles)
    assert "execute_async" not in vars(eng.runner)
    per = gpu.per_step()
    assert per["gpu_us_per_step"] == pytest.approx(1000.0)  # median of 900, 1,100, 1,000 us
    assert per["gpu_period_us"] == pytest.approx(1350.0)  # median of 900 + 300 and 1,100 + 400 us
    cpu = type("E", (), {"runner": type("R", (), {"device": "cpu"})()})()
    with GpuStepTimer(cpu) as off:
        pass
    assert off.per_step() == {"gpu_us_per_step": None, "gpu_period_us": None}


def test_profile_needs_the_engine_in_process():
    from voltllm.bench.cli import main

    with pytest.raises(ValueError, match="--profile"):
        main(["--random-weights", "qwen3-0.6b-shape", "--base-url", "http://127.0.0.1:9", "--profile"])
    with pytest.raises(ValueError, match="add --profile"):
        main(["--random-weights", "qwen3-0.6b-shape", "--profile-trace"])
    with pytest.raises(ValueError, match="--profile"):
        main(["--random-weights", "qwen3-0.6b-shape", "--device", "cpu", "--profile", "--profile-steps", "0"])


def test_bench_profile_switch_is_not_a_launch_profile(capsys):
    """`voltllm bench --profile` (a switch) must reach the bench, not the launch-profile merge of `serve --profile NAME`
    (which read it as a list of names and raised TypeError)."""
    from voltllm.cli import main

    assert main(["bench", "--random-weights", "qwen3-0.6b-shape", "--base-url", "http://127.0.0.1:9",
                 "--profile"]) == 2
    assert "--profile runs torch.profiler" in capsys.readouterr().err
